"""Config: one table, YAML / env / dict sources with precedence, presets, loud errors."""
import os

import pytest

import ucm
from ucm.config import OPTIONS, PRESETS, Config, options_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_and_access():
    c = Config()
    for o in OPTIONS:
        assert c[o.name] == o.default and c.source(o.name) == "default"
    assert c.compression.bits == c["compression.bits"] == 8
    assert c.store.posix.o_direct is False
    with pytest.raises(AttributeError, match="sparse_ratio"):
        c.sparse_ration
    with pytest.raises(AttributeError, match="immutable"):
        c.sparse_ratio = 0.5


@pytest.mark.parametrize("name,promise", [
    ("realtime_chat", lambda c, d: c.buffer_number > d.buffer_number and c["store.write_back"]
     and c.retrieval_stride < d.retrieval_stride),
    ("batch", lambda c, d: c.sparse_ratio < d.sparse_ratio and c["store.io_threads"] > d["store.io_threads"]
     and not c["connector.save_generated"]),
    ("high_quality", lambda c, d: c.sparse_ratio > d.sparse_ratio and c.min_blocks > d.min_blocks
     and c.sparse_dense_layers > d.sparse_dense_layers),
    ("low_memory", lambda c, d: c.buffer_number < d.buffer_number and c.cache_capacity < d.cache_capacity),
])
def test_presets_differ_from_the_defaults_as_their_names_promise(name, promise):
    c, d = Config(preset=name), Config()
    assert promise(c, d)
    changed = [k for k in PRESETS[name] if c[k] != d[k]]
    assert changed, f"preset {name} changes nothing"
    assert all(c.source(k) == f"preset {name}" for k in PRESETS[name]) and c.preset == name
    key = next(iter(PRESETS[name]))  # explicit values beat the preset
    assert Config({"preset": name, key: d[key]})[key] == d[key]
    assert set(PRESETS) == {"realtime_chat", "batch", "high_quality", "low_memory"}


def test_precedence_file_env_dict(tmp_path):
    f = tmp_path / "ucm.yaml"
    f.write_text("preset: batch\nsparse_ratio: 0.4\nmin_blocks: 32\n"
                 "store:\n  pipeline: memory|posix\n  posix:\n    roots: [/a, /b]\n")
    env = {"UCM_CONFIG_FILE": str(f), "UCM_MIN_BLOCKS": "64", "UCM_STORE_POSIX_FSYNC": "yes",
           "UCM_REQUIRE_NATIVE": "1"}
    c = Config.load(env=env, overrides={"min_blocks": 128})
    assert c.buffer_number == 4096 and c.source("buffer_number") == "preset batch"
    assert c.sparse_ratio == 0.4 and c.source("sparse_ratio").startswith("file")
    assert c.min_blocks == 128 and c.source("min_blocks") == "dict"
    assert c.store.posix.fsync is True and c.source("store.posix.fsync") == "env"
    assert c["store.posix.roots"] == ["/a", "/b"]
    c2 = Config.load(str(f), env={"UCM_MIN_BLOCKS": "64"})
    assert c2.min_blocks == 64
    assert Config.load({"store": {"posix": {"fsync": True}}}, env={}).store.posix.fsync is True


def test_env_parsing():
    c = Config(env={"UCM_SPARSE_RATIO": "0.25", "UCM_STORE_POSIX_ROOTS": "/x, /y",
                    "UCM_CACHE_CAPACITY": "2GiB",
                    "UCM_PRESET": "low_memory", "PATH": "/bin"})
    assert c.sparse_ratio == 0.25 and c["store.posix.roots"] == ["/x", "/y"]
    assert c.cache_capacity == 2 * 1024**3
    assert c.buffer_number == 512


@pytest.mark.parametrize("values,match", [
    ({"sparse_ration": 0.3}, r"unknown config key 'sparse_ration' \(dict\); did you mean 'sparse_ratio'"),
    ({"compresion": {"bits": 4}}, r"did you mean 'compression.bits'"),
    ({"sparse_ratio": 0.0}, r"'sparse_ratio' \(dict\): expected a number in \(0, 1\], got 0.0"),
    ({"sparse_ratio": 1.5}, r"in \(0, 1\]"),
    ({"sparse_ratio": "0.3"}, r"'sparse_ratio'.*expected a number, got '0.3'"),
    ({"sparse_ratio": float("nan")}, r"finite"),
    ({"min_blocks": 0}, r"'min_blocks'.*\[1, inf\]"),
    ({"min_blocks": True}, r"'min_blocks'.*an integer"),
    ({"buffer_number": -1}, r"'buffer_number'"),
    ({"cache_capacity": -5}, r"'cache_capacity'"),
    ({"cache_capacity": "lots"}, r"'cache_capacity'.*64GiB"),
    ({"compression": {"bits": 3}}, r"'compression.bits'.*one of 4, 8"),
    ({"compression": {"enabled": True, "method": "learned"}}, r"'compression.projection'.*learned"),
    ({"compression": {"group": 48}}, r"'compression.group'.*one of 32, 64"),
    ({"compression": {"method": "kivi"}}, r"'compression.method'.*quantize"),
    ({"block_size": 16}, r"unknown config key 'block_size'"),  # the engine's block size is used
    ({"store": {"memory": {"capacity": "lots"}}}, r"'store.memory.capacity'"),
    ({"sparse_method": "esa2"}, r"'sparse_method'.*'esa'"),
    ({"store": {"pipeline": "memory||posix"}}, r"'store.pipeline'.*joined by '\|'"),
    ({"store": {"posix": {"roots": []}}}, r"'store.posix.roots'.*at least one"),
    ({"store": {"posix": {"roots": [1]}}}, r"'store.posix.roots'.*list of strings"),
    ({"preset": "fast_chat"}, r"'preset'.*'batch'"),
    ({"init_window": 10, "local_window": 10}, r"'init_window'.*'min_blocks'"),
    ({"backend": "gpu"}, r"'backend'.*'reference'"),
])
def test_bad_values_name_the_key(values, match):
    with pytest.raises(ValueError, match=match):
        Config(values)


@pytest.mark.parametrize("env,match", [
    ({"UCM_SPARSE_RATO": "0.2"}, r"UCM_SPARSE_RATO; did you mean 'UCM_SPARSE_RATIO'"),
    ({"UCM_DISABLE_PATCH": "1"}, r"did you mean 'UCM_DISABLE_PATCHES'"),
    ({"UCM_COMPRESSION_BITS": "3"}, r"'compression.bits' \(env UCM_COMPRESSION_BITS\).*one of 4, 8"),
    ({"UCM_SPARSE_RATIO": "abc"}, r"'sparse_ratio' \(env UCM_SPARSE_RATIO\): expected a number"),
    ({"UCM_STORE_POSIX_FSYNC": "maybe"}, r"boolean"),
    ({"UCM_MIN_BLOCKS": "1.5"}, r"integer"),
])
def test_bad_env(env, match):
    with pytest.raises(ValueError, match=match):
        Config(env=env)


def test_an_unrelated_ucm_variable_only_warns(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="ucm.config"):
        c = Config(env={"UCM_HOME": "/opt/something-else", "UCM_SPARSE_RATIO": "0.4"})
    assert c.sparse_ratio == 0.4
    assert any("UCM_HOME" in r.getMessage() for r in caplog.records)


def _variables_read(root: str) -> set:
    """UCM_ variables the project's code reads from the environment: ``environ.get``,
    ``environ[...]`` and ``getenv`` of a quoted ``UCM_`` name in Python, ``UCM_<NAME>=...`` in
    the Makefile, CI and scripts."""
    import re

    py = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](UCM_[A-Z0-9_]+)["']""")
    sh = re.compile(r"\b(UCM_[A-Z0-9_]+)=")
    found = set()
    for top in ("ucm", "tests", "benchmarks", "evals", "scripts", ".ci", "Makefile"):
        path = os.path.join(root, top)
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
            if f.endswith((".py", ".sh")) or d.endswith(".ci")]
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            found |= set(py.findall(text))
            if not f.endswith(".py"):
                found |= set(sh.findall(text))
    return found


def test_every_variable_ucm_reads_is_known_to_the_config():
    """A variable ucm or its test and benchmark tooling reads must not make every Config.load
    warn that it is unknown (UCM_PROGRESS=0 and UCM_JIT_CACHE=off did, inside vLLM too)."""
    from ucm.config import RESERVED_ENV

    known = {o.env for o in OPTIONS} | {"UCM_PRESET"} | set(RESERVED_ENV)
    read = _variables_read(REPO)
    assert {"UCM_PROGRESS", "UCM_JIT_CACHE", "UCM_BACKEND"} <= read   # the scan sees them
    assert sorted(read - known) == []


def test_tooling_variables_load_without_a_warning(caplog):
    import logging

    env = {"UCM_PROGRESS": "0", "UCM_JIT_CACHE": "off", "UCM_TEST_TRITON_INTERPRETER": "1",
           "UCM_MODEL_OPS": "100", "UCM_MODEL_SEED": "3"}
    with caplog.at_level(logging.WARNING, logger="ucm.config"):
        Config(env=env)
    assert [r.getMessage() for r in caplog.records if "UCM_" in r.getMessage()] == []


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        Config.load(str(tmp_path / "missing.yaml"), env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparse_ratio: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        Config.load(str(bad), env={})
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        Config.load(str(lst), env={})
    typo = tmp_path / "typo.yaml"
    typo.write_text("store:\n  posix:\n    root: [/a]\n")
    with pytest.raises(ValueError, match=r"'store.posix.root' \(file .*typo.yaml\); did you mean 'store.posix.roots'"):
        Config.load(str(typo), env={})


def test_replace_and_equality():
    c = Config(preset="batch")
    d = c.replace(**{"store.pipeline": "posix"})
    assert d["store.pipeline"] == "posix" and d.buffer_number == 4096 and c["store.pipeline"] == "memory|posix"
    with pytest.raises(ValueError, match="sparse_ratio"):
        c.replace(sparse_ratio=2)
    assert Config() == Config() and Config() != d


def test_docs_document_every_option():
    ref = open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8").read()
    assert options_markdown() in ref, ("regenerate the table in docs/configuration.md: "
                                       "python -m ucm config --markdown")
    for name in PRESETS:
        assert name in ref
    assert ucm.Config is Config


def test_the_memory_tier_takes_a_byte_size():
    from ucm.store import open_store

    with open_store({"store": {"pipeline": "memory", "memory": {"capacity": "1MiB"}}},
                    block_bytes=64 * 1024) as s:
        assert s.stats()["memory"]["slots"] == 16
    with open_store({"store": {"pipeline": "memory"}, "buffer_number": 7}, block_bytes=4096) as s:
        assert s.stats()["memory"]["slots"] == 7


def test_the_posix_default_budget_is_bounded_by_free_space_and_logged_once(tmp_path, caplog):
    import logging

    from ucm.store import factory, open_store

    st = os.statvfs(tmp_path)
    half_free = st.f_bavail * st.f_frsize // 2
    cfg = Config({"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path / "kv")]}}})
    factory._BUDGET_LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="ucm.store"):
        budget = factory._posix_budget(cfg, ucm.store.base.BlockGeometry(4096, 4096))
        factory._posix_budget(cfg, ucm.store.base.BlockGeometry(4096, 4096))
    assert budget <= 64 * 1024**3 and budget <= max(half_free, 2 * (4096 + (1 << 20)))
    assert abs(budget - min(64 * 1024**3, half_free)) <= st.f_frsize * 64  # (free space moves)
    logged = [r.getMessage() for r in caplog.records if "storing up to" in r.getMessage()]
    assert len(logged) == 1 and str(tmp_path / "kv") in logged[0]
    explicit = cfg.replace(cache_capacity="1TiB")  # an explicit budget is taken as given
    assert factory._posix_budget(explicit, ucm.store.base.BlockGeometry(4096, 4096)) == 1024**4
    (tmp_path / "kv").mkdir()
    with open_store(cfg, block_bytes=4096) as s:
        assert s.roots[0].budget <= budget + st.f_frsize * 64
