"""The learned codec's decode on AMX tiles (:mod:`ucm.fast.numba._amx`) and the path it
replaces: the tile kernel against float64 products on every shape it takes (rows in groups of
16 and the rest untouched, ranks in one or several 32-coefficient chunks, column groups of four
vectors and single vectors), and the numba decode of 16-bit caches with and without the tiles
against the reference. On a CPU without AMX-BF16 the tile kernel's test skips (the hardware is
absent) and the decode runs its only path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from ucm import compress  # noqa: E402
from ucm.codecs import CodecSpec, KVShape, encoded_bytes, fit_projection  # noqa: E402
from ucm.fast.numba import _amx  # noqa: E402
from ucm.fast.numba import compress as numba_compress  # noqa: E402

OUT = {"float32": (torch.float32, np.float32, 2.0 ** -23),
       "bfloat16": (torch.bfloat16, np.uint16, 2.0 ** -8),
       "float16": (torch.float16, np.int16, 2.0 ** -11)}


def test_tiles_fit():
    assert _amx.tiles_fit(16, 64) and _amx.tiles_fit(32, 16) and _amx.tiles_fit(2, 16)
    assert _amx.tiles_fit(64, 128) and _amx.tiles_fit(96, 48)
    for k, m in [(0, 64), (15, 64), (48, 64), (16, 40), (16, 0), (34, 64)]:
        assert not _amx.tiles_fit(k, m), (k, m)


@pytest.mark.parametrize("out", list(OUT))
def test_affine_tiles(out):
    """Rows ``16 * (n // 16)`` of coefficients (bfloat16 at an odd byte offset and pitch) times
    a bfloat16 basis plus a bias, within two rounding steps of the float64 result rounded to the
    output type (plus the float32 sums' error near zero); nothing written past those rows or
    outside the columns."""
    if not _amx.tiles_ready():
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    from numba import njit

    @njit
    def run(y, yi, ys, a, ai, pitch, bp, bias, n, k, m):
        _amx.affine_tiles(y, yi, ys, a, ai, pitch, bp, bias, n, k, m)

    tdt, bits, step = OUT[out]
    rng = np.random.default_rng(3)
    for n, k, m in [(16, 16, 16), (37, 16, 64), (128, 32, 64), (48, 64, 48), (16, 2, 16),
                    (32, 96, 80), (15, 16, 64), (64, 8, 144)]:
        coef = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(torch.bfloat16)
        basis = torch.from_numpy(rng.standard_normal((k, m)).astype(np.float32)).to(torch.bfloat16)
        pitch, ai = 2 * k + 6, 3
        a = np.zeros(ai + n * pitch + 5, np.uint8)
        for r in range(n):
            a[ai + r * pitch:ai + r * pitch + 2 * k] = coef[r].view(torch.uint8).numpy()
        b16 = basis.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
        bp = np.ascontiguousarray((b16[1::2] << 16) | b16[0::2])        # b[2j] in the low half
        bias = (4 * rng.standard_normal(m)).astype(np.float32)
        ys, yi = m + 3, 5
        y = np.full(yi + n * ys + 4, 7, bits)
        run(y, yi, ys, a, ai, pitch, bp, bias, n, k, m)
        done = 16 * (n // 16)
        exact = coef.double().numpy() @ basis.double().numpy() + bias
        got = torch.from_numpy(y[yi:yi + n * ys].view(np.int16 if bits == np.uint16 else bits)
                               ).view(tdt).reshape(n, ys)[:done, :m]
        want = torch.from_numpy(exact[:done]).to(tdt)
        err = (got.double() - want.double()).abs()
        assert (err <= 2 * step * want.double().abs() + 1e-5 * k).all(), (n, k, m, float(err.max()))
        pad = y.copy()
        pad[yi:yi + done * ys].reshape(done, ys)[:, :m] = 7
        assert (pad == 7).all(), (n, k, m)


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "pairs"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_learned_decode_16bit(dtype, tiles, monkeypatch):
    """The numba decode of a 16-bit cache agrees with the reference within one rounding step
    of the cache's type, through the tiles (where the CPU has them) and through the pairs
    (every other CPU), token- and channel-major keys, 128 tokens (whole groups of 16) and 23
    (a remainder)."""
    if tiles and not _amx.tiles_ready():
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    if not tiles:
        monkeypatch.setattr(numba_compress, "tiles_ready", lambda: False)
    monkeypatch.setattr(numba_compress, "_LEARNED_DECODE", {})
    rng = np.random.default_rng(9)
    tt = OUT[dtype][0]
    proj = fit_projection([rng.standard_normal((512, 2, 3, 64)).astype(np.float32)])
    spec = CodecSpec("learned", ratio=0.25, projection=proj)
    for t, key_order in [(128, "td"), (128, "dt"), (23, "td")]:
        shape = KVShape("hktd", t, 3, 64, dtype, key_order=key_order)
        raw = torch.from_numpy(rng.standard_normal((4, 3, 2, t, 64)).astype(np.float32))
        raw = raw.to(tt).contiguous().view(torch.uint8).reshape(4, shape.raw_bytes)
        enc = torch.empty((4, encoded_bytes(spec, shape)), dtype=torch.uint8)
        assert compress.encode(spec, shape, raw, enc, backend="reference").all()
        got, want = torch.empty_like(raw), torch.empty_like(raw)
        compress.decode(spec, shape, enc, got, backend="numba")
        compress.decode(spec, shape, enc, want, backend="reference")
        g, w = got.view(tt).float(), want.view(tt).float()
        step = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
        assert bool(((g - w).abs() <= 2e-5 + step * w.abs()).all()), (t, key_order)
    built = [v[3] for v in numba_compress._LEARNED_DECODE.values()]
    assert built and all((c.shape[2] > 0) == tiles for c in built)


def test_tile_state_survives_fork():
    """Linux grants the tile state per process and a forked child inherits it (engines fork
    workers after ucm is imported): the child decodes through the tiles without asking again
    (an AMX instruction without the grant kills the process with SIGILL)."""
    import os

    if not _amx.tiles_ready() or not hasattr(os, "fork"):
        pytest.skip("no AMX-BF16 on this CPU (or no fork)")
    rng = np.random.default_rng(2)
    proj = fit_projection([rng.standard_normal((256, 2, 2, 64)).astype(np.float32)])
    spec = CodecSpec("learned", ratio=0.25, projection=proj)
    shape = KVShape("hktd", 32, 2, 64, "bfloat16")
    raw = torch.from_numpy(rng.standard_normal((2, 2, 2, 32, 64)).astype(np.float32))
    raw = raw.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(2, shape.raw_bytes)
    enc = torch.empty((2, encoded_bytes(spec, shape)), dtype=torch.uint8)
    compress.encode(spec, shape, raw, enc, backend="reference")
    want = torch.empty_like(raw)
    compress.decode(spec, shape, enc, want, backend="numba")
    pid = os.fork()
    if pid == 0:                                     # the child: decode, compare, exit
        got = torch.empty_like(raw)
        compress.decode(spec, shape, enc, got, backend="numba")
        os._exit(0 if torch.equal(got, want) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
