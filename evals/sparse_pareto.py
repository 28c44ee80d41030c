"""The sparse-attention Pareto table: per ``sparse_ratio``, every method's H200 decode speed-up
beside its SmolLM2 quality and retrieval accuracy, with the seed design's promise under it.

The halves come from different machines (SmolLM2 quality runs on CPU; the speed needs the H200),
so this script runs the CPU halves, or reads their JSON, and joins them with the speed JSON of
``benchmarks/bench_sparse_pareto.py``::

    # everything at once on this CPU machine, reading the committed H200 speed figures:
    .venv/bin/python evals/sparse_pareto.py --run --markdown benchmarks/results/sparse_pareto.md
    # or join runs made before (several quality JSON files are merged):
    .venv/bin/python evals/sparse_pareto.py --quality A.json,B.json --retrieval R.json \\
        --speed benchmarks/results/sparse_pareto_speed_h200.json --markdown OUT.md

Quality: ``evals/sparse_quality.py`` (perplexity change vs dense pooled over the 2K / 4K / 8K
contexts and their documents, top-1 agreement, KL(dense || sparse)); retrieval:
``evals/sparse_retrieval.py`` (RULER-style passkey / multikey accuracy). A configuration is
beaten by the seed's row at a ratio unless it is at least as fast at both shapes and its
perplexity change is at most the lower end of the seed's range (``< 0.5%`` at 0.7).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from evals import argtypes  # noqa: E402

RATIOS = (0.7, 0.5, 0.3, 0.2)

#: the seed design's promise per ratio: (speed-up, quality loss range in % of perplexity)
SEED = {0.7: (1.2, (0.0, 0.5)), 0.5: (1.5, (0.5, 1.0)), 0.3: (2.0, (1.0, 3.0)),
        0.2: (2.5, (3.0, 5.0))}
#: issue targets beyond the seed's row at 0.2: perplexity change, speed at 1 x 128K, 8 x 32K
TARGET_02 = (1.0, 3.0, 3.5)


@dataclass(frozen=True)
class Row:
    label: str             # what the table prints
    quality: str           # the method name in the quality / retrieval harnesses
    speed: Optional[str]   # the configuration name in bench_sparse_pareto (None: not timed)
    settings: str          # how a user gets it


ROWS = (
    Row("**esa (the default: stride 4, 2-token means)**", "esa:g2+s4", "esa stride 4, g2",
        "`sparse_method: esa`"),
    Row("esa stride 1, g2", "esa:g2+s1", "esa stride 1, g2", "esa, `retrieval_stride: 1`"),
    Row("esa stride 2, g2", "esa:g2+s2", "esa stride 2, g2", "esa, `retrieval_stride: 2`"),
    Row("esa stride 3, g2", "esa:g2+s3", "esa stride 3, g2", "esa, `retrieval_stride: 3`"),
    Row("esa stride 8, g2", "esa:g2+s8", "esa stride 8, g2", "esa, `retrieval_stride: 8`"),
    Row("esa stride 8, g4 (the previous default)", "esa:g4+s8", "esa (stride 8, g4)",
        "esa, `retrieval_stride: 8`, `sparse_repr_group: 4`"),
    Row("quest, g4", "quest:g4", "quest (g4)", "`sparse_method: quest`, `sparse_repr_group: 4`"),
    Row("quest per KV head, g2", "quest:kvhead+g2", "quest per KV head, g2",
        "quest, `sparse_per_kv_head: true`"),
    Row("mass (int4 keys, every step)", "mass", "mass", "`sparse_method: mass`"),
    Row("mass per KV head", "mass:kvhead", "mass per KV head",
        "mass, `sparse_per_kv_head: true`"),
    Row("kvstar, g4", "kvstar:g4", None, "`sparse_method: kvstar`, `sparse_repr_group: 4`"),
    Row("gsa", "gsa", None, "`sparse_method: gsa`"),
    Row("adaptive", "adaptive", None, "`sparse_method: adaptive`"),
    Row("oracle (exact block mass)", "oracle", None, "baseline, not a method"),
)


def load_quality(paths: list) -> dict:
    """(method, ratio) -> pooled summary over every context of every file."""
    from evals.sparse_quality import summarize

    records, meta = [], []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        records.extend(d["records"])
        meta.append(d.get("meta", {}))
    out = {}
    for r in summarize(records):
        if r["context"] == "all":
            out[(r["method"], float(r["ratio"]))] = r
    contexts = sorted({rec["context"] for rec in records})
    return {"rows": out, "meta": meta, "contexts": contexts}


def load_retrieval(path: Optional[str]) -> dict:
    """(method, ratio) -> accuracy from one or more comma-separated sparse_retrieval JSON files
    (a later file's rows win; dense accuracy and meta from the first)."""
    if not path:
        return {}
    out: dict = {}
    for p in path.split(","):
        with open(p) as f:
            d = json.load(f)
        for m, x in d["summary"]["methods"].items():
            for ratio, r in x["per_ratio"].items():
                out[(m, float(ratio))] = r["accuracy"]
        out.setdefault("dense", d["summary"]["dense"]["accuracy"])
        out.setdefault("meta", d.get("meta", {}))
    return out


def load_speed(path: Optional[str]) -> dict:
    """(configuration, ratio, shape) -> speed-up, from one or more comma-separated
    bench_sparse_pareto JSON files (a later file's rows win; the meta is the first file's)."""
    if not path:
        return {}
    out: dict = {}
    for p in path.split(","):
        with open(p) as f:
            d = json.load(f)
        out.setdefault("meta", {k: d.get(k) for k in ("machine", "date", "command")})
        for shape in d["timings"]:
            tag = f"{shape['batch']}x{shape['tokens'] // 1024}K"
            for ratio, row in shape["ratios"].items():
                for name, x in row.items():
                    out[(name, float(ratio), tag)] = x["speedup"]
    return out


def beats_seed(ratio: float, ppl: Optional[float], speeds: list) -> Optional[bool]:
    if ppl is None or not speeds or any(s is None for s in speeds):
        return None
    seed_speed, (low, high) = SEED[ratio]
    limit = high if ratio == 0.7 else low
    ok = all(s >= seed_speed for s in speeds) and (ppl < limit if ratio == 0.7 else ppl <= limit)
    if ratio == 0.2:
        ok &= ppl <= TARGET_02[0] and speeds[0] >= TARGET_02[2] and speeds[1] >= TARGET_02[1]
    return ok


def table(quality: dict, retrieval: dict, speed: dict, ratios=RATIOS) -> str:
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    lines = []
    for ratio in ratios:
        seed_speed, (low, high) = SEED[ratio]
        lines += [f"### sparse_ratio {ratio}", "",
                  "| configuration | speed-up 8 × 32K | speed-up 1 × 128K | ppl change % | "
                  "top-1 agree | KL | retrieval accuracy | beats the seed row |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in ROWS:
            q = quality["rows"].get((row.quality, ratio))
            speeds = [speed.get((row.speed, ratio, tag)) if row.speed else None
                      for tag in ("8x32K", "1x128K")]
            ppl = q["ppl_change_pct"] if q else None
            verdict = beats_seed(ratio, ppl, speeds) if row.quality != "oracle" else None
            ret = retrieval.get((row.quality, ratio))
            lines.append(
                f"| {row.label} | {fmt(speeds[0], '.2f')}{'×' if speeds[0] else ''} | "
                f"{fmt(speeds[1], '.2f')}{'×' if speeds[1] else ''} | "
                f"{fmt(ppl, '+.2f')} | {fmt(q and q['top1_agreement'], '.3f')} | "
                f"{fmt(q and q['kl'], '.4f')} | {fmt(ret, '.2f')} | "
                f"{'—' if verdict is None else ('**yes**' if verdict else 'no')} |")
        seed_q = f"< {high}" if ratio == 0.7 else f"{low}–{high}"
        lines.append(f"| *seed design* | {seed_speed}× | {seed_speed}× | {seed_q} | | | | |")
        if ratio == 0.2:
            lines.append(f"| *issue target at 0.2* | ≥ {TARGET_02[2]}× | ≥ {TARGET_02[1]}× | "
                         f"≤ {TARGET_02[0]} | | | | |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run the quality and retrieval harnesses "
                    "here first (CPU; about an hour on 2 cores)")
    ap.add_argument("--quality", default="", help="quality JSON files (sparse_quality.py --json), "
                    "comma-separated")
    ap.add_argument("--retrieval", default="", help="retrieval JSON, comma-separated "
                    "(sparse_retrieval.py --json)")
    speed = os.path.join(REPO, "benchmarks", "results", "sparse_pareto_speed_h200.json")
    ap.add_argument("--speed", default=None, help="speed JSON, comma-separated (bench_sparse_pareto.py --json; "
                    f"default {os.path.relpath(speed, REPO)}, left out if missing)")
    ap.add_argument("--docs", type=argtypes.count(1), default=3,
                    help="documents per context (with --run)")
    ap.add_argument("--tokens", type=argtypes.count(1), default=32,
                    help="tokens per document (with --run)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"),
                    help="where --run writes its JSON (default: %(default)s)")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    quality_paths = [p for p in args.quality.split(",") if p]
    inputs = [] if args.run else quality_paths + args.retrieval.split(",")   # (--run writes these)
    for p in [x for x in inputs + (args.speed.split(",") if args.speed else []) if x]:
        if not os.path.isfile(p):
            ap.error(f"no such file: {p!r}")
    if args.speed is None and os.path.exists(speed):
        args.speed = speed
    if args.run:
        from evals import sparse_quality, sparse_retrieval

        methods = ",".join(r.quality for r in ROWS)
        qpath = os.path.join(args.out, "sparse_pareto_quality_cpu.json")
        rpath = os.path.join(args.out, "sparse_pareto_retrieval_cpu.json")
        sparse_quality.main(["--contexts", "2048,4096,8192", "--docs", str(args.docs),
                             "--tokens", str(args.tokens), "--methods", methods,
                             "--json", qpath])
        sparse_retrieval.main(["--methods", methods, "--ratios", ",".join(map(str, RATIOS)),
                               "--json", rpath])
        quality_paths, args.retrieval = [qpath], rpath
    if not quality_paths:
        ap.error("--quality (or --run) is required")
    try:
        quality = load_quality(quality_paths)
    except (ValueError, KeyError, TypeError):
        ap.error(f"--quality: {args.quality!r}: not the JSON of sparse_quality.py runs")
    try:
        retrieval = load_retrieval(args.retrieval or None)
    except (ValueError, KeyError, TypeError, AttributeError):
        ap.error(f"--retrieval: {args.retrieval!r}: not the JSON of a sparse_retrieval.py run")
    try:
        speed = load_speed(args.speed)
    except (ValueError, KeyError, TypeError, AttributeError):
        ap.error(f"--speed: {args.speed!r}: not the JSON of a bench_sparse_pareto.py run")
    wanted = {(row.quality, r) for row in ROWS for r in RATIOS}
    if not wanted & set(quality["rows"]):
        print(f"note: no quality row is one of the table's (the methods {[r.quality for r in ROWS]} "
              f"at ratios {list(RATIOS)}): its quality columns stay empty", file=sys.stderr)
    text = table(quality, retrieval, speed)
    sm = speed.get("meta", {})
    head = (f"Speed: {sm.get('machine', {}).get('gpu', 'no speed file')} "
            f"({sm.get('date', '?')}), per decode step of one layer, scoring and selection "
            f"included, over the dense Triton kernel in the same run. Quality: SmolLM2-135M "
            f"(float32, CPU), contexts {quality['contexts']}, pooled. Retrieval: "
            f"{retrieval.get('meta', {}).get('description', 'not run')}"
            + (f", dense accuracy {retrieval['dense']:.2f}" if "dense" in retrieval else "")
            + ".\n\n")
    print(head + text)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(head + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
