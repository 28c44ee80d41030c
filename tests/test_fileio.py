"""Block checksum and batched positioned I/O: the checksum's additivity and sensitivity, every
SIMD path alike, reads and writes with unit checksums and per-op errors, O_DIRECT, bad
arguments. Implementations against the reference: test_equiv_foundation.py."""
import errno
import os

import numpy as np
import pytest

import ucm.ops as ops
from conftest import impls_of, run_python


def test_checksum_is_additive_and_detects_changes(rng):
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    whole = ops.checksum(data)
    parts = sum(ops.checksum(data[k:k + 4096], k // 8) for k in range(0, len(data), 4096)) % 2**64
    assert whole == parts
    for pos in (0, 7, 8, 4095, len(data) - 1):
        for bit in (0, 7):
            bad = data.copy()
            bad[pos] ^= 1 << bit
            assert ops.checksum(bad) != whole
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    assert ops.checksum(swapped) != whole
    assert ops.checksum(data, 1) != whole  # position matters


@pytest.mark.parametrize("simd", ["scalar", "avx2", "auto"])
def test_every_simd_path_gives_the_same_checksum(simd):
    code = ("import numpy as np, ucm.ops as o; d = np.random.default_rng(3).integers(0, 256, (1 << 20) + 13,"
            " dtype=np.uint8); print(o.checksum(d, 11, backend='native'))")
    r = run_python(code, env={"UCM_NATIVE_SIMD": simd} if simd != "auto" else {})
    assert r.returncode == 0, r.stderr
    d = np.random.default_rng(3).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    assert int(r.stdout) == ops.checksum(d, 11, backend="reference")


def _file(tmp_path, data):
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return os.open(path, os.O_RDWR)


@pytest.mark.parametrize("backend", impls_of("io_batch"))
@pytest.mark.parametrize("threads", [1, 3])
def test_read_write_with_unit_checksums(backend, threads, tmp_path, rng):
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    fd = _file(tmp_path, np.zeros(1 << 20, np.uint8))
    unit = 16 << 10
    sums = np.zeros((8, (128 << 10) // unit), dtype=np.uint64)
    w = ops.new_io_ops(8)
    for k in range(8):
        w[k] = (fd, 1, data.ctypes.data + k * (128 << 10), 128 << 10, k * (128 << 10),
                k * (128 << 10) // 8, unit, sums.ctypes.data + k * sums.shape[1] * 8, 0, 0)
    assert ops.io_batch(w, threads, True, backend=backend) == 0
    assert (w["result"] == 128 << 10).all()
    expected = [ops.checksum(data[k * unit:(k + 1) * unit], k * unit // 8) for k in range(64)]
    assert sums.reshape(-1).tolist() == expected
    out = np.zeros_like(data)
    r = ops.new_io_ops(2)
    r[0] = (fd, 0, out.ctypes.data, 1 << 19, 0, 0, 0, 0, 0, 0)
    r[1] = (fd, 0, out.ctypes.data + (1 << 19), 1 << 19, 1 << 19, (1 << 19) // 8, 0, 0, 0, 0)
    assert ops.io_batch(r, threads, True, backend=backend) == 0
    assert np.array_equal(out, data)
    assert (int(r["checksum"][0]) + int(r["checksum"][1])) % 2**64 == ops.checksum(data)
    os.close(fd)


@pytest.mark.parametrize("backend", impls_of("io_batch"))
def test_errors_are_per_op(backend, tmp_path):
    data = np.arange(4096, dtype=np.uint8)
    fd = _file(tmp_path, data)
    buf = np.zeros(8192, np.uint8)
    o = ops.new_io_ops(4)
    o[0] = (fd, 0, buf.ctypes.data, 4096, 0, 0, 0, 0, 0, 0)          # fine
    o[1] = (fd, 0, buf.ctypes.data, 4096, 2048, 0, 0, 0, 0, 0)       # runs past the end
    o[2] = (9999, 0, buf.ctypes.data, 16, 0, 0, 0, 0, 0, 0)          # bad descriptor
    o[3] = (fd, 0, buf.ctypes.data, 64, 0, 0, 12, buf.ctypes.data, 0, 0)  # unit not a multiple of 8
    assert ops.io_batch(o, 2, True, backend=backend) == 3
    assert o["result"].tolist() == [4096, -errno.ENODATA, -errno.EBADF, -errno.EINVAL]
    os.close(fd)


def test_o_direct_path(tmp_path, rng):
    data = ucm_aligned = ops.alloc_aligned(1 << 20)
    data[:] = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "d.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    o = ops.new_io_ops(1)
    o[0] = (fd, 1, data.ctypes.data, 1 << 20, 0, 0, 0, 0, 0, 0)
    assert ops.io_batch(o, 1, True) == 0
    back = ops.alloc_aligned(1 << 20)
    o[0] = (fd, 0, back.ctypes.data, 1 << 20, 0, 0, 0, 0, 0, 0)
    assert ops.io_batch(o, 1, True) == 0 and np.array_equal(back, ucm_aligned)
    assert int(o["checksum"][0]) == ops.checksum(data)
    os.close(fd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="new_io_ops"):
        ops.io_batch(np.zeros(3, np.int64))
    o = ops.new_io_ops(1)
    o[0]["len"] = 5
    with pytest.raises(ValueError, match="null address"):
        ops.io_batch(o)
    o[0]["addr"] = 8
    o[0]["fd"] = -1
    with pytest.raises(ValueError, match="descriptor"):
        ops.io_batch(o)
    with pytest.raises(ValueError, match="word0"):
        ops.checksum(np.zeros(8, np.uint8), -1)
