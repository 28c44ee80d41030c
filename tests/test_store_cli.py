"""``ucm store`` on real posix roots written by real stores: du, ls, inspect, verify (a damaged
block is found, quarantined and then a clean miss), gc, clear --namespace (the usage count the
stores keep stays exact), --json for scripts, and clear refusals (a directory that is not a ucm
root, a block in no root)."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ucm.store import open_store

BB, SB = 8192, 4096


def _cli(*args, check_rc=None, env=None):
    p = subprocess.run([sys.executable, "-m", "ucm.cli", "store", *args], capture_output=True,
                       text=True, timeout=120, env=env)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.stdout, p.stderr)
    return p


def _fill(root, ns: bytes, n: int, seed: int):
    cfg = {"store": {"pipeline": "posix", "posix": {"roots": [str(root)]}}}
    s = open_store(cfg, block_bytes=BB, shard_bytes=SB, namespace=ns)
    ids = (np.arange(2 * n, dtype=np.uint64) + 1000 * seed).reshape(n, 2)
    data = np.random.default_rng(seed).integers(0, 255, (n, BB), dtype=np.uint8)
    s.wait(s.dump(ids, 0, data))
    s.commit(ids, [True] * n)
    s.close()
    return cfg, ids, data


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    a = _fill(r, b"A" * 16, 6, 1)
    b = _fill(r, b"B" * 16, 4, 2)
    return r, a, b


def test_du_ls_inspect(root):
    r, (cfg, ids, _), _ = root
    du = json.loads(_cli("--root", str(r), "--json", "du", check_rc=0).stdout)[0]
    assert du["blocks"] == 10
    by_ns = {d["namespace"]: d for d in du["spaces"].values()}
    assert by_ns[(b"A" * 16).hex()]["blocks"] == 6 and by_ns[(b"B" * 16).hex()]["blocks"] == 4
    assert by_ns[(b"A" * 16).hex()]["block_bytes"] == BB
    assert du["usage_count"] is None or du["usage_count"] == du["bytes"]
    rows = json.loads(_cli("--root", str(r), "--json", "ls", check_rc=0).stdout)
    assert len(rows) == 10 and all(len(x["id"]) == 32 for x in rows)
    first = ids[0].astype("<u8").tobytes().hex()
    h = json.loads(_cli("--root", str(r), "--json", "inspect", first, check_rc=0).stdout)
    assert len(h) == 1 and h[0]["valid"] and h[0]["size_ok"]
    assert h[0]["namespace"] == (b"A" * 16).hex() and h[0]["shards"] == BB // SB
    text = _cli("--root", str(r), "du", check_rc=0).stdout
    assert "10 blocks" in text
    assert _cli("--root", str(r), "inspect", "f" * 32, check_rc=1).stderr.strip()


def test_verify_quarantines_damage_and_the_store_then_misses(root):
    r, (cfg, ids, data), _ = root
    victim = ids[2].astype("<u8").tobytes().hex()
    [path] = glob.glob(f"{r}/*/*/{victim}.blk")
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    p = _cli("--root", str(r), "--json", "verify", check_rc=1)
    rep = json.loads(p.stdout)[0]
    assert rep["checked"] == 10 and [b["id"] for b in rep["bad"]] == [victim]
    assert "checksum" in rep["bad"][0]["reason"] and rep["quarantined"] == 1
    assert not os.path.exists(path)
    s = open_store(cfg, block_bytes=BB, shard_bytes=SB, namespace=b"A" * 16)
    try:
        assert s.lookup(ids) == [True, True, False, True, True, True]
        out = np.zeros((1, BB), np.uint8)
        s.wait(s.load(ids[3:4], 0, out))
        assert np.array_equal(out[0], data[3])
    finally:
        s.close()
    p = _cli("--root", str(r), "verify", check_rc=0)
    assert "9 blocks checked, 0 damaged" in p.stdout
    assert "9/9" in p.stderr                # the progress bar (--json turns it off)


def test_clear_a_namespace_keeps_the_usage_count_exact(root):
    r, (cfg_a, ids_a, _), (cfg_b, ids_b, data_b) = root
    rep = json.loads(_cli("--root", str(r), "--json", "clear", "--namespace", (b"A" * 16).hex(),
                          check_rc=0).stdout)[0]
    assert rep["removed"] == 6
    du = json.loads(_cli("--root", str(r), "--json", "du", check_rc=0).stdout)[0]
    assert du["blocks"] == 4 and du["usage_count"] in (None, du["bytes"])
    s = open_store(cfg_b, block_bytes=BB, shard_bytes=SB, namespace=b"B" * 16)
    try:
        assert s.usage() == du["bytes"]
        assert all(s.lookup(ids_b))
    finally:
        s.close()
    s = open_store(cfg_a, block_bytes=BB, shard_bytes=SB, namespace=b"A" * 16)
    try:
        assert not any(s.lookup(ids_a))
    finally:
        s.close()


def test_gc_evicts_to_a_target_and_reads_a_config_file(root, tmp_path):
    r, _, _ = root
    conf = tmp_path / "ucm.yaml"
    conf.write_text(f"store:\n  pipeline: posix\n  posix:\n    roots: [{r}]\n")
    rep = json.loads(_cli("--file", str(conf), "--json", "gc", "--target", str(5 * (BB + 4096)),
                          check_rc=0).stdout)[0]
    assert rep["bytes"] <= 5 * (BB + 4096)
    du = json.loads(_cli("--file", str(conf), "--json", "du", check_rc=0).stdout)[0]
    assert du["blocks"] == 5


def test_refuses_what_is_not_a_ucm_root(tmp_path):
    plain = tmp_path / "home"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    for action in (["du"], ["verify"], ["clear", "--namespace", "0" * 32], ["gc"]):
        p = _cli("--root", str(plain), *action, check_rc=2)
        assert "not a ucm root" in p.stderr
    assert (plain / "notes.txt").read_text() == "mine" and sorted(os.listdir(plain)) == ["notes.txt"]
    p = _cli("--root", str(tmp_path / "missing"), "du", check_rc=2)
    assert "not a directory" in p.stderr
    # no --root: the configuration's default root (under $HOME), which does not exist here
    p = _cli("du", check_rc=2, env=dict(os.environ, HOME=str(tmp_path)))
    assert f"{tmp_path}/.cache/ucm/kv' is not a directory" in p.stderr
