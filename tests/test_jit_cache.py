"""ucm's numba kernels are cached on disk per digest of their sources (ucm/fast/numba/_jit.py):
a second process loads instead of compiling, other numba code keeps numba's own rules, and an
unusable cache directory only means compiling, never an error."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _run(env_extra, code):
    env = {k: v for k, v in os.environ.items() if k not in ("UCM_JIT_CACHE", "NUMBA_CACHE_DIR")}
    env.update(env_extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


USE_INDEX = textwrap.dedent("""
    import json
    import numpy as np
    from ucm.fast.numba import _jit, index
    from ucm.ops import BlockIndex
    probe = BlockIndex(4, backend="fast")
    ids = np.arange(8, dtype=np.uint64).reshape(4, 2)
    probe.insert(ids, [0, 1, 2, 3])
    assert list(probe.lookup(ids)) == [0, 1, 2, 3]
    fn = index._lookup
    print(json.dumps({"root": _jit._ROOT, "hits": len(fn.stats.cache_hits),
                      "misses": len(fn.stats.cache_misses)}))
""")


def test_a_second_process_loads_the_compiled_kernels(tmp_path):
    import json

    env = {"UCM_JIT_CACHE": str(tmp_path / "jit")}
    first = json.loads(_run(env, USE_INDEX))
    assert first["root"] is not None and first["root"].startswith(str(tmp_path / "jit"))
    assert first["hits"] == 0 and first["misses"] == 1  # compiled, then saved
    files = os.listdir(first["root"])
    assert any(f.startswith("index._lookup-") and f.endswith(".nbi") for f in files), files
    second = json.loads(_run(env, USE_INDEX))
    assert second["root"] == first["root"]
    assert second["hits"] == 1 and second["misses"] == 0  # loaded, not compiled
    # one directory per digest of the package's sources, nothing else under the root
    assert os.listdir(tmp_path / "jit") == [os.path.basename(first["root"])]


def test_off_or_an_unwritable_directory_compiles_without_a_cache(tmp_path):
    import json

    got = json.loads(_run({"UCM_JIT_CACHE": "off"}, USE_INDEX))
    assert got["root"] is None and got["hits"] == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    got = json.loads(_run({"UCM_JIT_CACHE": str(blocker)}, USE_INDEX))
    assert got["root"] is None and got["hits"] == 0
    if os.geteuid() != 0:  # (root writes anywhere)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        got = json.loads(_run({"UCM_JIT_CACHE": str(ro)}, USE_INDEX))
        assert got["root"] is None
    # and numba's own per-file cache was not used in their place
    pycache = os.path.join(REPO, "ucm", "fast", "numba", "__pycache__")
    assert not os.path.isdir(pycache) or not [f for f in os.listdir(pycache) if f.endswith((".nbi", ".nbc"))]


def test_other_numba_code_keeps_numbas_own_cache_rules(tmp_path):
    mod = tmp_path / "userkernel.py"
    mod.write_text("import numba\n\n@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import ucm.fast.numba._jit as j
        from ucm.fast.numba import index  # ucm's locator is installed
        import userkernel
        assert userkernel.twice(21) == 42
        print(j._ROOT)
    """)
    root = _run({"UCM_JIT_CACHE": str(tmp_path / "jit")}, code)
    assert os.listdir(tmp_path / "__pycache__")  # numba's in-tree cache beside the user's file
    assert not any(f.startswith("userkernel") for f in os.listdir(root))
