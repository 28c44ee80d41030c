"""RULER-style retrieval accuracy of every sparse attention method against its budget.

For each task x length x depth (``evals/retrieval_tasks.py``: pass key, multi-key needle
with distractors, key-value recall) the prompt (question included) is prefilled densely except
its last token; that token and the answer tokens are then fed as decode steps
(``ucm/reference/llama.py``, paged cache, block size 16), one batch row per method and
``sparse_ratio`` plus one dense row, each method choosing the blocks every layer attends to at
every step (``ucm.sparse.create``). So *every* answer token is predicted under sparse attention
(in vLLM the first answer token would come from the dense prefill: this is stricter). An
instance counts as solved when every answer token is the argmax given the previous answer tokens,
which is exactly "greedy decoding produces the answer" (exact match).

Reported per method and budget: accuracy (pooled and per task x length), the share of the
instances dense attention solves that the method also solves, the attention mass the attended
blocks hold under dense attention, and the smallest budget from which on (this and every larger
budget) the method solves every instance that dense attention solves ("matches dense"). ``oracle`` (exact block mass) and ``random``
are baselines. The target: dense-level retrieval accuracy at <= 20% of blocks.

The model is SmolLM2-135M by default (``ucm.models.ensure_smollm2``); ``--model DIR`` takes any
Llama-architecture Hugging Face folder with a ``tokenizer.json``. Run with the project's virtualenv
(it has ``tokenizers``)::

    .venv/bin/python evals/sparse_retrieval.py --json benchmarks/results/sparse_retrieval.json
    .venv/bin/python evals/sparse_retrieval.py --quick     # about a minute
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import retrieval_tasks as rt  # noqa: E402
from evals import argtypes  # noqa: E402
from evals.sparse_model import check_methods, method_variant  # noqa: E402
from ucm.reference.llama import Llama, run_continuation  # noqa: E402

METHODS = ("esa", "gsa", "kvstar", "quest", "adaptive", "oracle", "random")
RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5)
TARGET_RATIO = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face folder (default: SmolLM2-135M)")
    ap.add_argument("--tasks", type=argtypes.names, default="passkey,multikey",
                    help=f"comma-separated, of {rt.TASKS} (default %(default)s)")
    ap.add_argument("--lengths", type=argtypes.listed(argtypes.count(256)), default="2048,4096",
                    help="prompt lengths in tokens, >= 256 (default %(default)s)")
    ap.add_argument("--depths", type=argtypes.listed(argtypes.number(0.0, 1.0)),
                    default="0.1,0.5,0.9", help="needle depths in [0, 1] (default %(default)s)")
    ap.add_argument("--seeds", type=argtypes.count(1), default=1,
                    help="instances per task x length x depth (seeds --first-seed, +1, ...)")
    ap.add_argument("--first-seed", type=argtypes.count(0), default=0,
                    help="seed of the first instance (default %(default)s)")
    ap.add_argument("--methods", type=argtypes.names, default=",".join(METHODS),
                    help="comma-separated; NAME:kvhead+gN variants as in sparse_quality.py")
    ap.add_argument("--ratios", type=argtypes.listed(argtypes.ratio()),
                    default=",".join(str(r) for r in RATIOS),
                    help="sparse_ratio values in (0, 1] (default %(default)s)")
    ap.add_argument("--config", type=argtypes.json_object, default="{}",
                    help="extra ucm options as a JSON object (init_window, local_window, "
                         "retrieval_stride...)")
    ap.add_argument("--threads", type=argtypes.count(1), default=2,
                    help="torch threads for the prefill")
    ap.add_argument("--quick", action="store_true",
                    help="one pass-key instance of 2K tokens, budgets 0.1 and 0.2 (about a minute)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--summarize", default=None, metavar="JSON", type=argtypes.existing_file,
                    help="recompute the summary and tables of an earlier run's JSON (no model run); "
                         "with --json, write the updated result there")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.lengths, args.depths, args.seeds = ["passkey"], [2048], [0.5], 1
        args.ratios = [0.1, 0.2]
    for t in args.tasks:
        if t not in rt.TASKS:
            ap.error(f"--tasks: unknown task {t!r}; expected some of {rt.TASKS}")
    args.ratios = sorted(args.ratios)
    import ucm.sparse

    known = tuple(ucm.sparse.METHODS)
    for m in args.methods:
        if m.partition(":")[0] not in known:
            ap.error(f"--methods: unknown method {m!r}; expected some of {known}")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        ap.error(f"--model: {args.model!r} is not a Hugging Face folder with a tokenizer.json")
    args.error = ap.error
    return args


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def run_instance(model, tok, inst: rt.Instance, methods, ratios, base_cfg: dict) -> dict:
    """Dense row + one row per (method, ratio) on one instance -> per-row exact match, mass."""
    prompt, answer = rt.encode(tok, inst)
    shape = dict(num_layers=model.num_layers, num_q_heads=model.num_q_heads,
                 num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=16)
    rows, keys = [None], [("dense", 1.0)]
    for ratio in ratios:
        for name in methods:
            cfg = dict(base_cfg, sparse_method="esa", sparse_ratio=ratio)
            rows.append(method_variant(name, cfg, **shape))
            keys.append((name, ratio))
    # Prefill all but the last prompt token; feed it and the answer (teacher-forced) as decode
    # steps: step t predicts answer[t].
    context, steps = prompt[:-1], [prompt[-1]] + answer[:-1]
    t0 = time.perf_counter()
    res = run_continuation(model, context, steps, rows)
    target = torch.tensor(answer)
    pred = res.logits.argmax(-1)                                     # [rows, T]
    ok = (pred == target[None, :]).all(dim=1)
    prefill_ok = bool((res.dense_logits.argmax(-1) == target).all())
    out = dict(task=inst.task, length=inst.length, depth=inst.depth, seed=inst.seed,
               prompt_tokens=len(prompt), answer=inst.answer, answer_tokens=len(answer),
               blocks=-(-len(prompt) // 16), dense_prefill_ok=prefill_ok,
               seconds=round(time.perf_counter() - t0, 2), rows=[])
    for r, (name, ratio) in enumerate(keys):
        out["rows"].append(dict(method=name, ratio=ratio, ok=bool(ok[r]),
                                first_wrong=None if ok[r] else int((pred[r] != target).nonzero()[0]),
                                mass=round(float(res.mass[r].mean()), 4),
                                blocks_kept=round(float(res.blocks[r].mean()) / out["blocks"], 4)))
    return out


def summarize(instances: list, methods, ratios) -> dict:
    """Accuracy per (method, ratio), pooled and per task x length; smallest matching budget."""
    def acc(rows):      # (None: no instance to count, e.g. no instance that dense solves)
        return sum(r["ok"] for r in rows) / len(rows) if rows else None

    groups = sorted({(i["task"], i["length"]) for i in instances})
    all_rows = [(i, r) for i in instances for r in i["rows"]]
    summary = {"dense": {"accuracy": acc([r for _, r in all_rows if r["method"] == "dense"]),
                         "by_task": {f"{t}@{n}": acc([r for i, r in all_rows if r["method"] == "dense"
                                                      and i["task"] == t and i["length"] == n])
                                     for t, n in groups}},
               "methods": {}}
    for name in methods:
        per_ratio = {}
        for ratio in ratios:
            sel = [(i, r) for i, r in all_rows if r["method"] == name and r["ratio"] == ratio]
            per_ratio[str(ratio)] = dict(
                accuracy=acc([r for _, r in sel]),
                kept_of_dense=acc([r for i, r in sel if i["rows"][0]["ok"]]),
                mass=sum(r["mass"] for _, r in sel) / len(sel),
                blocks_kept=sum(r["blocks_kept"] for _, r in sel) / len(sel),
                by_task={f"{t}@{n}": acc([r for i, r in sel if i["task"] == t and i["length"] == n])
                         for t, n in groups})
        match = None
        for ratio in sorted(ratios, reverse=True):  # from the largest budget down
            if per_ratio[str(ratio)]["kept_of_dense"] == 1.0:
                match = ratio
            else:
                break
        summary["methods"][name] = dict(per_ratio=per_ratio, matches_dense_from=match,
                                        meets_target=match is not None and match <= TARGET_RATIO)
    return summary


def _share(x) -> str:
    """A share for the tables: ``-`` where there is nothing to count (dense solved nothing)."""
    return "-" if x is None or x != x else f"{x:.2f}"


def markdown(summary: dict, ratios, meta: dict) -> str:
    lines = [f"Dense accuracy: {summary['dense']['accuracy']:.2f} "
             f"({meta['instances']} instances: {meta['description']})", "",
             "| method | " + " | ".join(f"{r:g}" for r in ratios)
             + " | matches dense from | <= 20% |",
             "| --- | " + " | ".join("---" for _ in ratios) + " | --- | --- |"]
    for name, m in summary["methods"].items():
        cells = [f"{m['per_ratio'][str(r)]['accuracy']:.2f} / "
                 f"{_share(m['per_ratio'][str(r)]['kept_of_dense'])} "
                 f"({m['per_ratio'][str(r)]['mass']:.2f})" for r in ratios]
        match = "never" if m["matches_dense_from"] is None else f"{m['matches_dense_from']:g}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {match} | "
                     + ("yes" if m["meets_target"] else "no") + " |")
    lines += ["", "Cells: accuracy / share of the dense-solved instances solved (attention mass "
              "kept by the attended blocks, mean over steps, layers, heads). Accuracy per task x "
              "length:", "",
              "| method | ratio | " + " | ".join(summary["dense"]["by_task"]) + " |",
              "| --- | --- | " + " | ".join("---" for _ in summary["dense"]["by_task"]) + " |",
              "| dense | 1 | " + " | ".join(f"{v:.2f}" for v in summary["dense"]["by_task"].values())
              + " |"]
    for name, m in summary["methods"].items():
        for r in ratios:
            bt = m["per_ratio"][str(r)]["by_task"]
            lines.append(f"| {name} | {r:g} | " + " | ".join(f"{v:.2f}" for v in bt.values()) + " |")
    return "\n".join(lines)


def report(instances: list, meta: dict, json_path) -> dict:
    """Summarize, print the tables, write the JSON."""
    summary = summarize(instances, meta["methods"], meta["ratios"])
    mismatch = sum(i["dense_prefill_ok"] != i["rows"][0]["ok"] for i in instances)
    print(f"\ndense decode vs dense prefill: {mismatch} of {len(instances)} instances disagree")
    print(markdown(summary, meta["ratios"], meta))
    result = dict(meta=meta, summary=summary, instances=instances,
                  decode_vs_prefill_disagreements=mismatch)
    if json_path:
        argtypes.write_json(json_path, result, indent=1)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.summarize:
        try:
            with open(args.summarize) as f:
                earlier = json.load(f)
            instances, meta = earlier["instances"], earlier["meta"]
        except (ValueError, KeyError, TypeError):
            args.error(f"--summarize: {args.summarize!r} is not the JSON of a sparse_retrieval.py run")
        return report(instances, meta, args.json)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from ucm.models import ensure_smollm2

        args.model = ensure_smollm2()
    tok = load_tokenizer(args.model)
    try:                # (a length too short for a task's fixed text fails here, not mid-run)
        for task in args.tasks:
            for length in args.lengths:
                rt.make_instance(task, length, args.depths[0], args.first_seed, tok)
    except ValueError as exc:
        args.error(f"--lengths: {exc} (task {task})")
    model = Llama.load(args.model)
    base_cfg = {"min_blocks": 16, **args.config}
    try:
        check_methods(args.methods, args.ratios, base_cfg, num_layers=model.num_layers,
                      num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads,
                      head_dim=model.head_dim, block_size=16)
    except ValueError as exc:
        args.error(str(exc))
    instances = []
    t_start = time.perf_counter()
    for task in args.tasks:
        for length in args.lengths:
            for depth in args.depths:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    inst = rt.make_instance(task, length, depth, seed, tok)
                    res = run_instance(model, tok, inst, args.methods, args.ratios, base_cfg)
                    instances.append(res)
                    solved = [f"{r['method']}@{r['ratio']:g}" for r in res["rows"][1:] if r["ok"]]
                    print(f"{task} {length} depth={depth:g} seed={seed}: dense "
                          f"{'ok' if res['rows'][0]['ok'] else 'FAIL'}; sparse solved "
                          f"{len(solved)}/{len(res['rows']) - 1} ({res['seconds']:.0f} s)",
                          flush=True)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        model=os.path.basename(os.path.normpath(args.model)), tasks=args.tasks,
        lengths=args.lengths, depths=args.depths, seeds=args.seeds, first_seed=args.first_seed,
        ratios=args.ratios,
        methods=args.methods, config=base_cfg, instances=len(instances),
        seconds=round(time.perf_counter() - t_start, 1),
        description=f"{'/'.join(args.tasks)} x {'/'.join(str(n) for n in args.lengths)} tokens x "
                    f"depths {'/'.join(f'{d:g}' for d in args.depths)} x {args.seeds} seed(s)"
                    + (f" from {args.first_seed}" if args.first_seed else ""),
        protocol="prompt prefilled densely except its last token; that token and the answer "
                 "teacher-forced as decode steps; solved = every answer token is the argmax")
    return report(instances, meta, args.json)


if __name__ == "__main__":
    main()
