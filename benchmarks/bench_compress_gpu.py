#!/usr/bin/env python3
"""KV codecs on a CUDA GPU: the Triton kernels (ucm.fast.triton.compress) against the device's own
copy bandwidth and against moving raw KV, every output checked against the reference first.

    python3 benchmarks/bench_compress_gpu.py [--json $OUT/bench_compress_h200.json] [--gib 1.0]
                                             [--repeats 20] [--no-sweep]

(a) codec rates: 1 GiB of bf16 KV as raw shard rows, shapes SmolLM2-135M-like (3 KV heads,
    head_dim 64) and Llama-70B-like (8 KV heads, head_dim 128), 16-token blocks. Per codec
    (INT8; INT4 keys per channel / per token, groups 32 / 64; sparse): ``encode`` and ``decode``
    as GB/s of raw KV, against one ``torch`` device copy of the same bytes (read + write), same
    run. ``op``: the public ``ucm.compress`` call (validation, dispatch, the ``ok`` flags' one
    synchronization); ``kernel``: the launch alone. Median of ``--repeats`` (``do_bench``). A
    sweep of launch constants (``--no-sweep`` skips it) prints the kernel times of alternatives.
(b) round trip GPU -> pinned host -> GPU of about 1 GiB of paged KV (Llama-70B-like: 80 layers,
    FlashAttention layout per layer, random blocks in, other random blocks out): uncompressed
    (Triton ``gather_blocks`` into device staging, D2H into pinned memory, H2D back,
    ``scatter_blocks``) against INT8 (``gather_encode``, D2H of the encoded bytes, H2D,
    ``decode_scatter``); the effective rate counts the raw KV bytes moved; ratio INT8 /
    uncompressed; median of 7 round trips each.

Checks, before any timing: every codec's Triton encoding equals the reference's on the GPU over
the whole GiB and the CPU reference's (the documented rules) on a sample of rows, byte for byte;
Triton decode equals the reference decode; the fused ops equal the reference (gather + encode,
decode + scatter) over the round trip's blocks; both round trips leave the destination blocks
equal to what the reference gives. On any failure: the failures are printed and the script exits
1 without reporting figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from _argtypes import count as _count, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB = 1 << 30
GB = 1e9
#: "cuda"; "cpu" only for a dry run of the script's logic under the Triton interpreter
#: (``--dry-run-cpu``, tiny sizes, times meaningless).
DEV = "cuda"


def _specs():
    from ucm.compress import CodecSpec

    return {
        "int8": CodecSpec("quantize", 8),      # (auto: keys per token in these 16-token blocks)
        "int8_channel": CodecSpec("quantize", 8, key_mode="channel"),
        "int8_token": CodecSpec("quantize", 8, key_mode="token"),
        "int4_channel_g32": CodecSpec("quantize", 4, 32, "channel"),
        "int4_channel_g64": CodecSpec("quantize", 4, 64, "channel"),
        "int4_token_g32": CodecSpec("quantize", 4, 32, "token"),
        "int4_token_g64": CodecSpec("quantize", 4, 64, "token"),
        "sparse_channel_g32": CodecSpec("sparse", 4, 32, "channel"),
    }


def _shapes(tokens: int = 16):
    """The two head geometries in blocks of ``tokens`` tokens (16: vLLM's CUDA default; the
    names carry ``_t{tokens}`` otherwise)."""
    from ucm.compress import KVShape

    tail = "" if tokens == 16 else f"_t{tokens}"
    return {"smollm2_like" + tail: KVShape("kthd", tokens, 3, 64, "bfloat16"),
            "llama70b_like" + tail: KVShape("kthd", tokens, 8, 128, "bfloat16")}


SWEPT = ("int8", "int8_channel", "int4_channel_g32", "int4_token_g32", "sparse_channel_g32")


def kv_rows(torch, shape, n, seed):
    """Raw bf16 shard rows on the GPU: normal values, outlier channels and tokens."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn((n, 2, shape.tokens, shape.heads, shape.head_dim), generator=g,
                    device=DEV, dtype=torch.float32)
    x[..., 3] *= 20
    x[:, :, shape.tokens // 2] *= 4
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, shape.raw_bytes)


def bench_ms(torch, fn, repeats):
    import triton

    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=max(50, repeats * 5),
                                         return_mode="median"))


def first_diff(torch, a, b):
    d = (a != b).nonzero()
    return f"{d.shape[0]} bytes differ, first {d[:3].tolist()}" if d.numel() else ""


def codec_rates(torch, args, failures, out):
    from ucm import compress
    from ucm.compress import encoded_bytes
    from ucm.fast.triton import compress as tc

    specs, shapes = _specs(), _shapes(args.tokens)
    if args.codecs:
        specs = {k: v for k, v in specs.items() if k in args.codecs}
    res = {}
    for sname, shape in shapes.items():
        n = int(args.gib * GiB) // shape.raw_bytes
        raw = kv_rows(torch, shape, n, seed=1)
        nbytes = n * shape.raw_bytes
        copy_dst = torch.empty_like(raw)
        t_copy = bench_ms(torch, lambda: copy_dst.copy_(raw), args.repeats)
        entry = {"rows": n, "raw_bytes": nbytes, "copy_ms": round(t_copy, 4),
                 "copy_GBps_raw": round(nbytes / t_copy / 1e6, 1), "codecs": {}}
        del copy_dst
        for cname, spec in specs.items():
            spec = spec.for_shape(shape)          # (the kernels below are called directly)
            E = encoded_bytes(spec, shape)
            enc = torch.empty((n, E), dtype=torch.uint8, device=DEV)
            ok = compress.encode(spec, shape, raw, enc, backend="triton")
            # checks: whole GiB vs the GPU reference, a sample vs the CPU reference
            want = torch.empty_like(enc)
            ok_ref = compress.encode(spec, shape, raw, want, backend="reference")
            msg = first_diff(torch, enc, want)
            if msg or not (ok == ok_ref).all():
                failures.append(f"{sname}/{cname} encode vs GPU reference: {msg or 'ok flags differ'}")
            sample = slice(0, min(n, 512))
            cpu_want = torch.empty((sample.stop, E), dtype=torch.uint8)
            compress.encode(spec, shape, raw[sample].cpu(), cpu_want, backend="reference")
            msg = first_diff(torch, enc[sample].cpu(), cpu_want)
            if msg:
                failures.append(f"{sname}/{cname} encode vs CPU reference: {msg}")
            del want
            dec = torch.empty_like(raw)
            compress.decode(spec, shape, enc, dec, backend="triton")
            dec_want = torch.empty_like(raw)
            compress.decode(spec, shape, enc, dec_want, backend="reference")
            msg = first_diff(torch, dec, dec_want)
            if msg:
                failures.append(f"{sname}/{cname} decode vs GPU reference: {msg}")
            del dec_want
            torch.cuda.empty_cache()
            if failures:
                continue
            t_enc_op = bench_ms(torch, lambda: compress.encode(spec, shape, raw, enc,
                                                               backend="triton"), args.repeats)
            t_dec_op = bench_ms(torch, lambda: compress.decode(spec, shape, enc, dec,
                                                               backend="triton"), args.repeats)
            t_enc_k = bench_ms(torch, lambda: _encode_kernel(torch, tc, spec, shape, raw, enc,
                                                              tc.LAUNCH), args.repeats)
            t_dec_k = bench_ms(torch, lambda: _decode_kernel(torch, tc, spec, shape, enc, dec,
                                                              tc.LAUNCH), args.repeats)
            c = {"encoded_bytes": E, "ratio_of_raw": round(E / shape.raw_bytes, 4),
                 "encode_op_ms": round(t_enc_op, 4), "decode_op_ms": round(t_dec_op, 4),
                 "encode_kernel_ms": round(t_enc_k, 4), "decode_kernel_ms": round(t_dec_k, 4),
                 "encode_op_GBps_raw": round(nbytes / t_enc_op / 1e6, 1),
                 "decode_op_GBps_raw": round(nbytes / t_dec_op / 1e6, 1),
                 "encode_op_vs_copy": round(t_copy / t_enc_op, 3),
                 "decode_op_vs_copy": round(t_copy / t_dec_op, 3),
                 "encode_kernel_vs_copy": round(t_copy / t_enc_k, 3),
                 "decode_kernel_vs_copy": round(t_copy / t_dec_k, 3),
                 "encode_decode_op_vs_copy": round(2 * t_copy / (t_enc_op + t_dec_op), 3)}
            if args.sweep and cname in SWEPT and (sname.startswith("llama70b_like")
                                                  or cname == "int8_channel"):
                c["sweep"] = _sweep(torch, tc, spec, shape, raw, enc, dec, args.repeats)
            entry["codecs"][cname] = c
            print(f"{sname:14s} {cname:20s} enc {c['encode_op_GBps_raw']:7.1f} GB/s "
                  f"({c['encode_op_vs_copy']:.2f}x copy; kernel {c['encode_kernel_vs_copy']:.2f}x)  "
                  f"dec {c['decode_op_GBps_raw']:7.1f} GB/s ({c['decode_op_vs_copy']:.2f}x copy; "
                  f"kernel {c['decode_kernel_vs_copy']:.2f}x)", flush=True)
            del enc, dec
            torch.cuda.empty_cache()
        res[sname] = entry
        del raw
        torch.cuda.empty_cache()
    out["codec_rates"] = res


def _encode_kernel(torch, tc, spec, shape, raw, enc, launch):
    tabs = tc._plain_tables(shape, shape.raw_bytes // shape.esize, raw.device)
    flags = tc._new_flags(raw.shape[0], raw.device)
    tc._encode_launch(spec, shape, tc._encodable(spec, shape, raw, tabs), tabs, None, enc,
                      enc.stride(0), flags, raw.shape[0], 1, launch)


def _decode_kernel(torch, tc, spec, shape, enc, dec, launch):
    rows = dec.view(torch.bfloat16)
    tabs = tc._plain_tables(shape, rows.stride(0), rows.device)
    tc._decode_launch(spec, shape, rows, tabs, None, enc, enc.stride(0), enc.shape[0], 1, launch)


def _sweep(torch, tc, spec, shape, raw, enc, dec, repeats):
    """Kernel times of alternative launch constants (checked against the default's output)."""
    if spec.int8 and spec.key_mode == "channel":
        alts = [dict(int8_channel_fused=0), dict(int8_channel_fused=1 << 20)]
        alts += [dict(int8_channel_key_warps=w, int8_channel_key_tokens=t) for w in (1, 2, 4)
                 for t in (16, 32, 64)]
        alts += [dict(int8_value_elems=e, int8_value_warps=w) for e in (1024, 2048, 4096)
                 for w in (2, 4)]
    elif spec.method == "quantize" and spec.bits == 8:
        alts = [dict(int8_vectors=v, int8_warps=w) for v in (16, 32, 64) for w in (4, 8)]
    else:
        alts = [dict(int4_token_heads=h, int4_token_warps=w) for h in (1, 2, 4)
                for w in (2, 4, 8)]
        if spec.key_mode == "channel":
            alts += [dict(int4_channel_warp_words=w) for w in (256, 512, 2048)]
        alts += [dict(int4_decode_heads=h, int4_decode_warps=w, int4_decode_warps_token=w)
                 for h in (1, 2) for w in (2, 4, 8)]
    out = {}
    ref_enc, ref_dec = enc.clone(), dec.clone()
    for a in alts:
        launch = tc.LAUNCH.replace(**a)
        key = ",".join(f"{k}={v}" for k, v in a.items())
        e2, d2 = torch.empty_like(enc), torch.empty_like(dec)
        _encode_kernel(torch, tc, spec, shape, raw, e2, launch)
        _decode_kernel(torch, tc, spec, shape, ref_enc, d2, launch)
        if not (torch.equal(e2, ref_enc) and torch.equal(d2, ref_dec)):
            out[key] = "output differs"
            continue
        te = bench_ms(torch, lambda: _encode_kernel(torch, tc, spec, shape, raw, e2, launch), repeats)
        td = bench_ms(torch, lambda: _decode_kernel(torch, tc, spec, shape, ref_enc, d2, launch),
                      repeats)
        out[key] = {"encode_ms": round(te, 4), "decode_ms": round(td, 4)}
        del e2, d2
    return out


def round_trip(torch, args, failures, out):
    from ucm import compress, gather_blocks, scatter_blocks
    from ucm.compress import CodecSpec, KVShape, encoded_bytes
    from ucm.layout import KVLayout

    L, T, H, D = (80, 16, 8, 128) if DEV == "cuda" else (3, 16, 8, 128)
    shape = KVShape("kthd", T, H, D, "bfloat16")
    spec = CodecSpec("quantize", 8)
    block_bytes = L * shape.raw_bytes
    n = max(2, int(args.gib * GiB) // block_bytes)
    nb = n + 16
    g = torch.Generator(device=DEV).manual_seed(7)

    def cache():
        bufs = [torch.empty((2, nb, T, H, D), dtype=torch.bfloat16, device=DEV) for _ in range(L)]
        return bufs, KVLayout.from_views([v for b in bufs for v in b.unbind(0)],
                                         [l for l in range(L) for _ in range(2)])
    src_bufs, src_layout = cache()
    for b in src_bufs:
        x = torch.randn(b.shape, generator=g, device=DEV)
        x[..., 3] *= 20
        b.copy_(x)
    dst_bufs, dst_layout = cache()
    perm = torch.randperm(nb, generator=g, device=DEV)
    src_idx = perm[:n].contiguous()
    dst_idx = torch.randperm(nb, generator=g, device=DEV)[:n].contiguous()
    src_idx_h, dst_idx_h = src_idx.cpu(), dst_idx.cpu()
    E = encoded_bytes(spec, shape)
    raw_total = n * block_bytes

    staging = torch.empty((n, block_bytes), dtype=torch.uint8, device=DEV)
    staging2 = torch.empty_like(staging)
    pin = DEV == "cuda"
    sync = torch.cuda.synchronize if pin else (lambda: None)
    host = torch.empty((n, block_bytes), dtype=torch.uint8, pin_memory=pin)
    enc = torch.empty((n, L * E), dtype=torch.uint8, device=DEV)
    enc2 = torch.empty_like(enc)
    host_enc = torch.empty((n, L * E), dtype=torch.uint8, pin_memory=pin)

    def raw_trip():
        gather_blocks(src_layout, src_idx_h, staging, backend="triton")
        host.copy_(staging, non_blocking=True)
        staging2.copy_(host, non_blocking=True)
        scatter_blocks(dst_layout, staging2, dst_idx_h, backend="triton")

    def int8_trip():
        ok = compress.gather_encode(src_layout, src_idx_h, spec, shape, enc, backend="triton")
        host_enc.copy_(enc, non_blocking=True)
        enc2.copy_(host_enc, non_blocking=True)
        compress.decode_scatter(dst_layout, enc2, dst_idx_h, spec, shape, backend="triton")
        return ok

    def d2h():
        host.copy_(staging, non_blocking=True)

    def h2d():
        staging2.copy_(host, non_blocking=True)

    # checks
    for b in dst_bufs:
        b.fill_(0)
    raw_trip()
    check = torch.empty_like(staging)
    gather_blocks(dst_layout, dst_idx_h, check, backend="reference")
    gather_blocks(src_layout, src_idx_h, staging2, backend="reference")
    if not torch.equal(check, staging2):
        failures.append("round trip (raw): destination blocks differ from the source blocks")
    del check
    for b in dst_bufs:
        b.fill_(0)
    ok = int8_trip()
    sync()
    want = torch.empty_like(enc)
    ok_ref = compress.gather_encode(src_layout, src_idx_h, spec, shape, want, backend="reference")
    if not ok.all() or not (ok == ok_ref).all():
        failures.append("round trip (int8): ok flags")
    msg = first_diff(torch, enc, want)
    if msg:
        failures.append(f"round trip (int8): gather_encode vs reference: {msg}")
    ref_bufs, ref_layout = cache()
    for b in ref_bufs:
        b.fill_(0)
    compress.decode_scatter(ref_layout, want, dst_idx_h, spec, shape, backend="reference")
    for a, b in zip(dst_bufs, ref_bufs):
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            failures.append("round trip (int8): decode_scatter vs reference: cache differs")
            break
    del want, ref_bufs, ref_layout
    torch.cuda.empty_cache()
    if failures:
        return

    def timed(fn, k=7):
        fn()
        ts = []
        for _ in range(k):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), min(ts)

    t_raw, t_raw_best = timed(raw_trip)
    t_int8, t_int8_best = timed(int8_trip)
    t_d2h, _ = timed(d2h)
    t_h2d, _ = timed(h2d)
    t_gather = bench_ms(torch, lambda: gather_blocks(src_layout, src_idx_h, staging,
                                                     backend="triton"), args.repeats) / 1e3
    t_genc = bench_ms(torch, lambda: compress.gather_encode(src_layout, src_idx_h, spec, shape,
                                                            enc, backend="triton"), args.repeats) / 1e3
    t_scatter = bench_ms(torch, lambda: scatter_blocks(dst_layout, staging2, dst_idx_h,
                                                       backend="triton"), args.repeats) / 1e3
    t_dsc = bench_ms(torch, lambda: compress.decode_scatter(dst_layout, enc2, dst_idx_h, spec,
                                                            shape, backend="triton"), args.repeats) / 1e3
    r = {"layers": L, "blocks": n, "block_bytes": block_bytes, "raw_bytes": raw_total,
         "int8_bytes": n * L * E,
         "raw_round_trip_s": round(t_raw, 5), "int8_round_trip_s": round(t_int8, 5),
         "raw_effective_GBps": round(raw_total / t_raw / GB, 2),
         "int8_effective_GBps": round(raw_total / t_int8 / GB, 2),
         "raw_effective_GBps_best": round(raw_total / t_raw_best / GB, 2),
         "int8_effective_GBps_best": round(raw_total / t_int8_best / GB, 2),
         "int8_vs_raw": round(t_raw / t_int8, 3),
         "int8_vs_raw_best": round(t_raw_best / t_int8_best, 3),
         "pinned_d2h_GBps": round(raw_total / t_d2h / GB, 2),
         "pinned_h2d_GBps": round(raw_total / t_h2d / GB, 2),
         "gather_blocks_ms": round(t_gather * 1e3, 3), "gather_encode_ms": round(t_genc * 1e3, 3),
         "scatter_blocks_ms": round(t_scatter * 1e3, 3),
         "decode_scatter_ms": round(t_dsc * 1e3, 3)}
    out["round_trip"] = r
    print(f"round trip {raw_total / GiB:.3f} GiB of KV: raw {r['raw_effective_GBps']} GB/s, INT8 "
          f"{r['int8_effective_GBps']} GB/s -> {r['int8_vs_raw']}x (best {r['int8_vs_raw_best']}x); "
          f"pinned D2H {r['pinned_d2h_GBps']} / H2D {r['pinned_h2d_GBps']} GB/s; gather "
          f"{r['gather_blocks_ms']} ms, gather_encode {r['gather_encode_ms']} ms, scatter "
          f"{r['scatter_blocks_ms']} ms, decode_scatter {r['decode_scatter_ms']} ms", flush=True)


def op_overhead(torch, out):
    """Wall time of one small ``encode`` call (16 rows: the kernel is a few microseconds), and
    where the host time goes (cProfile, printed)."""
    import cProfile
    import io
    import pstats

    from ucm import compress
    from ucm.compress import CodecSpec, KVShape, encoded_bytes

    spec, shape = CodecSpec("quantize", 8), KVShape("kthd", 16, 8, 128, "bfloat16")
    raw = kv_rows(torch, shape, 16, seed=3)
    enc = torch.empty((16, encoded_bytes(spec, shape)), dtype=torch.uint8, device=DEV)
    dec = torch.empty_like(raw)
    for _ in range(20):
        compress.encode(spec, shape, raw, enc, backend="triton")
        compress.decode(spec, shape, enc, dec, backend="triton")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        compress.encode(spec, shape, raw, enc, backend="triton")
    t1 = time.perf_counter()
    for _ in range(200):
        compress.decode(spec, shape, enc, dec, backend="triton")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        compress.encode(spec, shape, raw, enc, backend="triton")
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print("\n".join(buf.getvalue().splitlines()[:40]))
    out["op_overhead_us"] = {"encode_16_rows": round((t1 - t0) / 200 * 1e6, 1),
                             "decode_16_rows": round((t2 - t1) / 200 * 1e6, 1)}
    print("op overhead", out["op_overhead_us"], flush=True)


def scalar_division_probe(torch, out):
    """How often PyTorch's CUDA ``x / 127.0`` (a multiplication by the float32 reciprocal)
    differs from the correctly rounded quotient (informational)."""
    x = torch.randn(1 << 22, device=DEV) * 3
    a = x / 127.0
    b = x / torch.full_like(x, 127.0)
    c = (x.cpu() / 127.0).cuda()
    out["torch_cuda_div_by_python_scalar"] = {
        "values": x.numel(), "differs_from_tensor_division": int((a != b).sum()),
        "tensor_division_differs_from_cpu": int((b != c).sum())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--gib", type=float, default=1.0,
                   help="GiB of raw KV per codec-rate shape (default %(default)s)")
    p.add_argument("--repeats", type=_count(1), default=20,
                   help="do_bench repetitions, the median reported (default %(default)s)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--skip-round-trip", action="store_true")
    p.add_argument("--tokens", type=_count(1), default=16, help="tokens per block of the codec-rate "
                   "shapes (16: vLLM's CUDA default; INT8's auto key mode is per channel from 128)")
    p.add_argument("--codecs", nargs="*", default=None, help="a subset of the codecs (names as "
                   "in the JSON)")
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.gib > 0:
        p.error(f"--gib: expected a positive number, got {args.gib}")
    if args.codecs is not None:
        unknown = sorted(set(args.codecs) - set(_specs()))
        if unknown or not args.codecs:
            p.error(f"--codecs: {f'unknown {unknown}' if unknown else 'none named'}; known: "
                    f"{list(_specs())}")
    global DEV
    if args.dry_run_cpu:
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_compress_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"bench": "compress_gpu",
           "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
           "gib": args.gib}
    failures: list = []
    if DEV == "cuda":
        scalar_division_probe(torch, out)
        op_overhead(torch, out)
    codec_rates(torch, args, failures, out)
    if not failures and not args.skip_round_trip:
        round_trip(torch, args, failures, out)
    if failures:
        print("FAILED checks, no figures reported:")
        for f in failures:
            print("  " + f)
        return 1
    out["checks"] = "passed"
    if args.json:
        write_json(args.json, out, indent=1, sort_keys=True)
    print(json.dumps({k: v for k, v in out.items() if k != "codec_rates"}, sort_keys=True))
    print("\nratios (kernel / op vs device copy of the same bytes):")
    for sname, e in out["codec_rates"].items():
        for cname, c in e["codecs"].items():
            print(f"  {sname:14s} {cname:20s} encode {c['encode_kernel_vs_copy']:.2f} / "
                  f"{c['encode_op_vs_copy']:.2f}   decode {c['decode_kernel_vs_copy']:.2f} / "
                  f"{c['decode_op_vs_copy']:.2f}")
    if "round_trip" in out:
        print(f"  round trip INT8 vs raw: {out['round_trip']['int8_vs_raw']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
