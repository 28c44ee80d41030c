"""ucm as SGLang's HiCache L3 backend, against SGLang's own file backend and a raw memcpy: pages
written from and read back into SGLang's real host pool (``MHATokenToKVPoolHost`` on CPU), as
its cache controller drives them, in one run.

* ``ucm memory`` / ``ucm posix``: ``UCMStorage.batch_set_v1`` / ``batch_get_v1`` (zero-copy
  interface) over ucm's memory tier, and over its posix tier alone (files, like SGLang's);
* ``HiCacheFile``: SGLang 0.5.23's built-in file backend through the generic path its
  controller uses for it (``get_data_page`` -> ``batch_set``; ``batch_get`` into flat pages ->
  ``set_from_flat_data_page``), in a folder of its own on the same disk;
* ``memcpy``: the same bytes copied once between two contiguous buffers (torch ``copy_``): the
  ceiling of any path that moves every byte once.

Rates are GB/s of page bytes; each figure is the median of ``--rounds`` rounds, set then get,
the stores emptied between rounds (posix writes go to the page cache: no fsync on either side).
Runs with SGLang's modules on the path (``scripts/install_sglang.sh``)::

    PYTHONPATH=.:.sglang-site .venv/bin/python benchmarks/hicache_sglang.py --json OUT.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from _argtypes import count as _count  # noqa: E402

warnings.simplefilter("ignore")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=_count(1), default=1000, help="default %(default)s")
    ap.add_argument("--page-size", type=_count(1), default=32, help="tokens per page (default %(default)s)")
    ap.add_argument("--layout", default="page_first_direct",
                    choices=("layer_first", "page_first", "page_first_direct", "page_head"),
                    help="the host pool's layout (default %(default)s)")
    ap.add_argument("--rounds", type=_count(1), default=3, help="median of (default %(default)s)")
    ap.add_argument("--batch", type=_count(1), default=128,
                    help="pages per call (SGLang's batch; default %(default)s)")
    ap.add_argument("--dir", default=None, help="folder for the file-based stores")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir: no such directory {args.dir!r}")

    # torchvision, which SGLang's config package imports, cannot load beside a CPU torch: the
    # tests' named stand-in (its functions raise if called) takes its place
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "sglang_backend"))
    import torchvision_standin

    torchvision_standin.install()
    import torch
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise SystemExit("hicache_sglang.py: SGLang's modules are not importable; install them with "
                         "scripts/install_sglang.sh and run with PYTHONPATH=.:.sglang-site") from None
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64, bfloat16
    layers, heads, dim, ps, n = 30, 3, 64, args.page_size, args.pages
    tokens = n * ps
    dev = MHATokenToKVPool(size=tokens, page_size=ps, dtype=torch.bfloat16, head_num=heads,
                           head_dim=dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=layers,
                           enable_alt_stream=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    del dev
    host = MHATokenToKVPoolHost(info, 2.0, 0, ps, args.layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
    host.kv_buffer.view(torch.int16).random_()
    page_bytes = host.get_size_per_token() * ps
    total = n * page_bytes
    src_pages = list(range(n))                      # first half of the pool: written from
    dst_pages = list(range(n, 2 * n))               # second half: read into
    assert host.kv_buffer.numel() * host.kv_buffer.element_size() >= 2 * total
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + str(i).encode()).digest()
        keys.append(prev.hex())

    check = min(7, n - 1)                           # the page compared after each path

    def same_page(a, b):                            # (bit patterns: random bits hold NaNs)
        return torch.equal(host.get_data_page(a * ps).view(torch.int16),
                           host.get_data_page(b * ps).view(torch.int16))

    def idx(pages):
        return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)

    def config(extra):
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                    attn_cp_size=1, is_mla_model=False,
                                    enable_storage_metrics=False,
                                    is_page_first_layout=args.layout == "page_first",
                                    model_name="SmolLM2-135M", extra_config=extra)

    base = args.dir or tempfile.mkdtemp(prefix="ucm-hicache-bench-")
    B = args.batch

    def batches():
        for a in range(0, n, B):
            yield a, min(n, a + B)

    def ucm_backend(pipeline, root):
        extra = {"backend_name": "ucm", "module_path": "ucm.integration.sglang",
                 "class_name": "UCMStorage", "interface_v1": 1,
                 "ucm": {"store": {"pipeline": pipeline, "posix": {"roots": [root]},
                                   "memory": {"capacity": f"{2 * total // 2**20 + 64}MiB"}}}}
        b = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        b.register_mem_pool_host(host)
        return b

    def run_ucm(pipeline):
        root = tempfile.mkdtemp(dir=base)
        b = ucm_backend(pipeline, root)
        t0 = time.perf_counter()
        for a, e in batches():
            assert all(b.batch_set_v1(keys[a:e], idx(src_pages[a:e])))
        t1 = time.perf_counter()
        if pipeline == "posix":                      # a restarted server: reads the files
            b.close()
            b = ucm_backend(pipeline, root)
        t2 = time.perf_counter()
        for a, e in batches():
            assert all(b.batch_get_v1(keys[a:e], idx(dst_pages[a:e])))
        t3 = time.perf_counter()
        ok = same_page(dst_pages[check], src_pages[check])
        b.close()
        shutil.rmtree(root)
        return t1 - t0, t3 - t2, ok

    def run_file():
        root = tempfile.mkdtemp(dir=base)
        b = StorageBackendFactory.create_backend("file", config({"file_storage_path": root}),
                                                 host)
        b.register_mem_pool_host(host)
        t0 = time.perf_counter()
        for a, e in batches():
            data = [host.get_data_page(p * ps) for p in src_pages[a:e]]
            assert b.batch_set(keys[a:e], data)
        t1 = time.perf_counter()
        for a, e in batches():
            flat = [host.get_dummy_flat_data_page() for _ in range(e - a)]
            got = b.batch_get(keys[a:e], flat)
            for p, g in zip(dst_pages[a:e], got):
                host.set_from_flat_data_page(p * ps, g)
        t2 = time.perf_counter()
        ok = same_page(dst_pages[check], src_pages[check])
        shutil.rmtree(root)
        return t1 - t0, t2 - t1, ok

    def run_memcpy():
        a = torch.empty(total, dtype=torch.uint8).random_()
        c = torch.empty_like(a)
        c.copy_(a)                                   # (fault the pages in)
        t0 = time.perf_counter()
        c.copy_(a)
        t1 = time.perf_counter()
        a.copy_(c)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, True

    runs = {"ucm memory": lambda: run_ucm("memory"), "ucm posix": lambda: run_ucm("posix"),
            "HiCacheFile": run_file, "memcpy": run_memcpy}
    times = {k: {"set": [], "get": []} for k in runs}
    for r in range(args.rounds):                     # interleaved: drift hits every path alike
        for name, fn in runs.items():
            s, g, ok = fn()
            if not ok:
                raise SystemExit(f"{name}: a page read back differs from the page written")
            times[name]["set"].append(s)
            times[name]["get"].append(g)
    rows = {}
    for name, t in times.items():
        rows[name] = {op: total / statistics.median(v) / 1e9 for op, v in t.items()}
    ref = rows["HiCacheFile"]
    cpy = rows["memcpy"]
    print(f"{n} pages of {page_bytes / 1024:.0f} KiB ({total / 2**20:.0f} MiB), layout "
          f"{args.layout}, {B} pages per call, median of {args.rounds}")
    print("| path | set GB/s | get GB/s | set vs HiCacheFile | get vs HiCacheFile | "
          "set vs memcpy | get vs memcpy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['set']:.2f} | {r['get']:.2f} | {r['set'] / ref['set']:.2f}x | "
              f"{r['get'] / ref['get']:.2f}x | {r['set'] / cpy['set']:.2f} | "
              f"{r['get'] / cpy['get']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"pages": n, "page_bytes": page_bytes, "layout": args.layout,
                       "batch": B, "rounds": args.rounds, "machine": platform.node(),
                       "cpus": os.cpu_count(), "sglang": "0.5.23",
                       "date": time.strftime("%Y-%m-%d"), "gb_per_s": rows}, f, indent=1)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
