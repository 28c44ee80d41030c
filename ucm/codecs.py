"""KV codec formats (the base layer of :mod:`ucm.compress`): :class:`KVShape`, :class:`CodecSpec`,
the byte layout of an encoded shard (:func:`segments`, :func:`offsets`, :func:`encoded_bytes`) and
learned projections (:class:`Projection`, :func:`fit_projection`). Every implementation of the
codec ops reads its layout from here; the rules themselves are in :mod:`ucm.compress`."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import numbers
import os
import threading
import zipfile
from typing import Optional

import numpy as np

from ucm.files import open_regular

METHODS = ("quantize", "sparse", "learned")
BITS = (4, 8)
GROUPS = (32, 64)
KEY_MODES = ("auto", "channel", "token")
DTYPES = ("float16", "bfloat16", "float32")
#: Encoding refuses a shard holding a value whose magnitude reaches this (or NaN): the top of
#: the element type's range, where a quantizer's scale, rounded up, or a range ``max - min``
#: (float32) would decode or compute past the largest finite value. Finite KV this large is an
#: overflow in the making, never a value worth caching. As float32 bits: ``LIMIT_BITS``. The
#: learned codec's limit is lower, from its projection: :func:`magnitude_limit`.
MAGNITUDE_LIMIT = {"float16": 2.0 ** 15, "bfloat16": 2.0 ** 126, "float32": 2.0 ** 126}
LIMIT_BITS = {"float16": 0x47000000, "bfloat16": 0x7E800000, "float32": 0x7E800000}
ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
DIMS = "kthd"
KEY_ORDERS = ("td", "dt")
#: INT8 ``key_mode="auto"``: keys per channel from blocks of this many tokens (CodecSpec.for_shape)
INT8_CHANNEL_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class KVShape:
    """How one shard's bytes are a KV tensor: ``order`` is the memory order of the dims
    ``k`` (key/value, 2), ``t`` (tokens), ``h`` (KV heads), ``d`` (channels, innermost), e.g.
    ``"hktd"`` for vLLM-CPU (per head: the block's keys, then its values) and ``"kthd"`` for
    vLLM's CUDA layouts (keys, then values, each token-major).

    ``key_order``: how each key plane (the ``T x D`` keys of one head) is stored when ``order``
    ends in ``"td"``: ``"td"`` like the values, or ``"dt"`` channel-major (vLLM-CPU's attention
    keeps keys transposed for its dot products). The codecs quantize the same numbers either
    way (the encoded bytes do not depend on it)."""
    order: str
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    key_order: str = "td"

    def __post_init__(self):
        if sorted(self.order) != sorted(DIMS) or self.order[-1] != "d":
            raise ValueError(f"KVShape.order: a permutation of 'kthd' ending in 'd', got {self.order!r}")
        for name in ("tokens", "heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"KVShape.{name}: expected an int >= 1, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVShape.dtype: one of {DTYPES}, got {self.dtype!r}")
        if self.key_order not in KEY_ORDERS:
            raise ValueError(f"KVShape.key_order: one of {KEY_ORDERS}, got {self.key_order!r}")
        if self.key_order == "dt" and not self.order.endswith("td"):
            raise ValueError(f"KVShape.key_order 'dt' needs whole key planes: an order ending "
                             f"in 'td', got {self.order!r}")

    @property
    def esize(self) -> int:
        return ESIZE[self.dtype]

    @property
    def raw_bytes(self) -> int:
        """Bytes of one raw shard."""
        return 2 * self.tokens * self.heads * self.head_dim * self.esize

    def sizes(self) -> dict:
        return {"k": 2, "t": self.tokens, "h": self.heads, "d": self.head_dim}

    def with_token_major_keys(self) -> "KVShape":
        """This shape with keys stored like the values."""
        return dataclasses.replace(self, key_order="td")


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """One codec and its parameters (``compression.*`` options)."""
    method: str = "quantize"
    bits: int = 8
    group: int = 64
    key_mode: str = "auto"
    salient: float = 0.0078125      # 1/128: token 0 alone in blocks of <= 128 tokens
    ratio: float = 0.25
    projection: Optional["Projection"] = dataclasses.field(default=None, compare=False, repr=False)
    #: keys per channel: how the encoder picks their codes (:class:`KeyRounding`); not part of
    #: the format (the codes decode the same way whichever rule chose them)
    rounding: Optional["KeyRounding"] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"compression.method: one of {METHODS}, got {self.method!r}")
        for name, allowed in (("bits", BITS), ("group", GROUPS)):
            v = getattr(self, name)
            # ints only (8.0 or a numpy integer would pass ``in`` but make float byte counts
            # or an identity that cannot be serialized): normalized to a Python int
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"compression.{name}: one of {allowed}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.bits not in BITS:
            raise ValueError(f"compression.bits: one of {BITS}, got {self.bits!r}")
        if self.method in ("sparse", "learned") or self.bits == 4:
            if self.group not in GROUPS:
                raise ValueError(f"compression.group: one of {GROUPS}, got {self.group!r}")
        if self.key_mode not in KEY_MODES:
            raise ValueError(f"compression.key_mode: one of {KEY_MODES}, got {self.key_mode!r}")
        if self.key_mode == "auto" and not self.int8:
            # INT4 and sparse: keys per channel (KIVI), which more than halves their error.
            # INT8's choice depends on the block's length (for_shape).
            object.__setattr__(self, "key_mode", "channel")
        if self.method == "sparse" and not 0.0 < float(self.salient) <= 0.5:
            raise ValueError(f"compression.salient: a fraction in (0, 0.5], got {self.salient!r}")
        if self.method == "learned":
            if not 0.0 < float(self.ratio) < 1.0:
                raise ValueError(f"compression.ratio: a fraction in (0, 1), got {self.ratio!r}")
            if self.projection is None:
                raise ValueError("compression.method 'learned' needs a projection "
                                 "(compression.projection: a file from fit_projection)")

    @property
    def int4(self) -> bool:
        return self.method == "sparse" or (self.method == "quantize" and self.bits == 4)

    @property
    def int8(self) -> bool:
        return self.method == "quantize" and self.bits == 8

    @property
    def rounds_keys(self) -> bool:
        """Whether a key rounding picks this codec's key codes: keys per channel (INT8, INT4,
        sparse) with a :class:`KeyRounding` (``key_mode`` resolved: :meth:`for_shape`)."""
        return self.rounding is not None and self.key_mode == "channel" and self.method != "learned"

    def for_shape(self, shape: "KVShape") -> "CodecSpec":
        """This codec with ``key_mode`` ``auto`` resolved for blocks of ``shape``. INT8: keys
        per channel (asymmetric, token 0 exact) where a block has at least
        :data:`INT8_CHANNEL_TOKENS` tokens, else per token. Per-channel keys cut the KL of
        SmolLM2's next-token distributions 3.7x against keys per token (RESULTS.md, "How
        far 8-bit keys can go"), but their minimum and scale, and the exact first token (whose
        codes are not stored), cost 6 bytes per (head, channel) and block (bfloat16): 1.2-1.6%
        of bfloat16's bytes from 128 tokens, 10% at 16 (vLLM's CUDA blocks), where per-token
        keys stay within 0.52 of bfloat16's bytes."""
        if self.key_mode != "auto":
            return self
        mode = "channel" if shape.tokens >= INT8_CHANNEL_TOKENS else "token"
        return dataclasses.replace(self, key_mode=mode)

    def params(self) -> dict:
        """What identifies the encoded bytes (no field that does not change them)."""
        if self.int8:       # ("auto": unresolved; stores name blocks by the resolved spec)
            p = {"method": "quantize", "bits": 8, "key_mode": self.key_mode}
            if self.key_mode == "channel":
                p["keys"] = "asymmetric"
                p["token0"] = "exact"
            return p
        if self.method == "learned":
            return {"method": "learned", "ratio": float(self.ratio),
                    "projection": self.projection.digest}
        p = {"method": self.method, "bits": 4, "group": self.group, "key_mode": self.key_mode}
        if self.method == "sparse":
            p["salient"] = float(self.salient)
        return p

    def digest(self) -> bytes:
        """16 bytes naming this codec's format (mixed into the namespace)."""
        text = json.dumps({"format": 1, **self.params()}, sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=16, person=b"ucm-codec").digest()

    def code(self) -> int:
        """The block header's codec field (nonzero; 0 is raw)."""
        return int.from_bytes(self.digest()[:4], "little") | 1

    def check(self, shape: KVShape) -> None:
        """ValueError when this codec cannot encode shards of ``shape``."""
        if self.key_mode == "auto":
            return self.for_shape(shape).check(shape)
        if self.int8 and self.key_mode == "channel" and shape.tokens < 2:
            raise ValueError("compression.key_mode 'channel' of INT8 keeps token 0 exact "
                             "and quantizes the others: blocks of 1 token have none "
                             "(use 'token')")
        if self.int4:
            d = shape.head_dim
            if d % 2:
                raise ValueError(f"compression: INT4 packs two channels per byte; head_dim {d} is odd")
            if d % self.group:
                raise ValueError(f"compression.group: {self.group} must divide head_dim {d} "
                                 f"(allowed: {[g for g in GROUPS if d % g == 0] or 'none'})")
        if self.method == "sparse" and n_salient(self, shape) >= shape.tokens:
            raise ValueError(f"compression.salient: {self.salient} of {shape.tokens} tokens "
                             f"leaves none to quantize")
        if self.method == "learned":
            self.projection.check(shape, rank(self, shape))
        if self.rounds_keys:
            self.rounding.check(shape)


def n_salient(spec: CodecSpec, shape: KVShape) -> int:
    return max(1, math.ceil(float(spec.salient) * shape.tokens))


def rank(spec: CodecSpec, shape: KVShape) -> int:
    return max(1, min(shape.head_dim, round(float(spec.ratio) * shape.head_dim)))


#: the element types' largest finite values
TYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
_LEARNED_LIMITS: dict = {}


def magnitude_limit(spec: CodecSpec, shape: KVShape, layer: int = 0) -> float:
    """The magnitude from which ``encode`` refuses a shard (a power of two, so exact in every
    element type): :data:`MAGNITUDE_LIMIT` for the quantizers. For ``learned`` it is lower, so
    that no value below it decodes past ``TYPE_MAX / 2`` or rounds a coefficient past
    bfloat16's range: a decoded value is ``mean_i + sum_j P_ij (x_j - mean_j)`` with ``P`` the
    rank-``r`` projector ``B B^T`` of the layer, so ``|x| < lim`` bounds it by ``m + s (lim +
    m)`` (``s``: the largest row sum of ``|P|`` over the layer's heads, ``m``: the largest
    ``|mean|``), and a coefficient by ``sqrt(D) (lim + m)``."""
    lim = MAGNITUDE_LIMIT[shape.dtype]
    if spec.for_shape(shape).rounds_keys:
        return min(lim, ROUNDING_LIMIT)
    if spec.method != "learned":
        return lim
    p, r = spec.projection, rank(spec, shape)
    key = (p.digest, int(layer), r, shape.dtype)
    if key not in _LEARNED_LIMITS:
        b = p.bases[layer][..., :r].astype(np.float64)                  # [2, H, D, r]
        s = float(np.abs(np.einsum("khdr,kher->khde", b, b)).sum(-1).max())
        m = float(np.abs(p.means[layer]).max())
        d = shape.head_dim
        while lim > 2.0 ** -14 and (m + s * (lim + m) > TYPE_MAX[shape.dtype] / 2
                                    or math.sqrt(d) * (lim + m) > 2.0 ** 126):
            lim /= 2
        _LEARNED_LIMITS[key] = lim
    return _LEARNED_LIMITS[key]


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _int4_segments(spec: CodecSpec, t: int, h: int, d: int, prefix: str) -> list:
    """The INT4 part of a block of ``t`` tokens: packed keys, packed values, their (min, scale)
    bfloat16 pairs."""
    g = spec.group
    kp = (h, d, 2) if spec.key_mode == "channel" else (t, h, d // g, 2)
    return [(prefix + "kq", "uint8", (t, h, d // 2)), (prefix + "vq", "uint8", (t, h, d // 2)),
            (prefix + "kp", "bfloat16", kp), (prefix + "vp", "bfloat16", (t, h, d // g, 2))]


def segments(spec: CodecSpec, shape: KVShape) -> list:
    """``[(name, dtype, shape)]`` of one encoded shard, in byte order (each segment starts at a
    multiple of 8 bytes)."""
    spec = spec.for_shape(shape)
    t, h, d = shape.tokens, shape.heads, shape.head_dim
    if spec.int8 and spec.key_mode == "channel":
        # token 0's key and value exact in x0; tokens 1..: q holds the keys' uint8 codes, then
        # the values' int8 codes, vscale the values' scales
        return [("q", "int8", (2, t - 1, h, d)), ("kp", "bfloat16", (h, d, 2)),
                ("vscale", "bfloat16", (t - 1, h)), ("x0", shape.dtype, (2, h, d))]
    if spec.method == "quantize" and spec.bits == 8:
        return [("q", "int8", (2, t, h, d)), ("scale", "bfloat16", (2, t, h))]
    if spec.method == "quantize":
        return _int4_segments(spec, t, h, d, "")
    if spec.method == "sparse":
        k = n_salient(spec, shape)
        return [("bitmap", "uint8", (-(-t // 8),)), ("exact", shape.dtype, (k, 2, h, d))] + \
            _int4_segments(spec, t - k, h, d, "")
    return [("coef", "bfloat16", (2, t, h, rank(spec, shape)))]


_NP = {"uint8": np.uint8, "int8": np.int8, "bfloat16": np.uint16, "float16": np.float16,
       "float32": np.float32}
_SIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def offsets(spec: CodecSpec, shape: KVShape) -> dict:
    """``name -> (byte offset, dtype, shape)`` of one encoded shard."""
    out, at = {}, 0
    for name, dt, shp in segments(spec, shape):
        out[name] = (at, dt, shp)
        at += _pad8(math.prod(shp) * _SIZE[dt])
    return out


def encoded_bytes(spec: CodecSpec, shape: KVShape) -> int:
    """Bytes of one encoded shard (a multiple of 8)."""
    return sum(_pad8(math.prod(shp) * _SIZE[dt]) for _, dt, shp in segments(spec, shape))


# ---------------------------------------------------------------------------------------------
# fitted files (learned projections, key roundings): arrays and their digest in one .npz

def _save_npz(path: str, digest: str, **arrays) -> None:
    """Write the arrays and their digest to ``path`` whole or not at all: into a temporary file
    beside it (named by process and thread: concurrent saves never share one), flushed to disk,
    then renamed over ``path``. A failed step removes the temporary file."""
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, digest=np.array(digest), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load_npz(path: str, key: str, build, *names):
    """``build(*arrays)`` of the arrays ``names`` in ``path``; ValueError naming the config
    ``key`` when the file cannot be read (never unpickled) or its arrays do not match its
    recorded digest."""
    try:
        with open_regular(path) as f:                   # (not a FIFO or a device: no hang)
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):     # a .npy file: one array, read whole
                raise ValueError("not an .npz archive (one .npy array)")
            with z:
                obj = build(*(z[n] for n in names))
                stored = str(z["digest"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as exc:
        # (MemoryError: an array header claiming more than memory, numpy allocates it first)
        raise ValueError(f"config key {key!r}: cannot read {path!r}: {exc}")
    if stored != obj.digest:
        raise ValueError(f"config key {key!r}: {path!r} is damaged (digest {obj.digest}, "
                         f"recorded {stored})")
    return obj


def _array(x, what: str, kinds: str, dtype) -> np.ndarray:
    """A C-ordered copy of ``x`` as ``dtype`` (a fitted object owns its arrays: its digest must
    keep describing them); ValueError unless ``x``'s elements are of the numpy ``kinds``."""
    a = np.asarray(x)
    if a.dtype.kind not in kinds:
        raise ValueError(f"{what}: {'integer' if kinds == 'iu' else 'real'} values expected, "
                         f"got dtype {a.dtype}")
    return np.array(a, dtype=dtype, order="C")


def _float64(x) -> np.ndarray:
    """``x`` as a float64 array; a torch tensor (bfloat16 has no numpy type) via the CPU."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double()
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# learned projections

@dataclasses.dataclass(frozen=True)
class Projection:
    """Per layer, per key/value and per head: a mean ``[H, D]`` and an orthonormal basis
    ``[H, D, R]`` (columns by decreasing variance), float32. ``digest``: 16 hex bytes of the
    arrays, the projection's version."""
    means: np.ndarray   # [L, 2, H, D]
    bases: np.ndarray   # [L, 2, H, D, R]
    digest: str

    @classmethod
    def build(cls, means, bases) -> "Projection":
        means = _array(means, "projection: means", "iuf", np.float32)
        bases = _array(bases, "projection: bases", "iuf", np.float32)
        if means.ndim != 4 or bases.ndim != 5 or means.shape != bases.shape[:4]:
            raise ValueError(f"projection: means [L, 2, H, D] and bases [L, 2, H, D, R], got "
                             f"{list(means.shape)} and {list(bases.shape)}")
        if not (np.isfinite(means).all() and np.isfinite(bases).all()):
            raise ValueError("projection: NaN or infinite values")
        h = hashlib.blake2b(digest_size=16, person=b"ucm-project")
        for a in (means, bases):
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        return cls(means, bases, h.hexdigest())

    @property
    def layers(self) -> int:
        return self.means.shape[0]

    @property
    def max_rank(self) -> int:
        return self.bases.shape[-1]

    def check(self, shape: KVShape, r: int) -> None:
        if self.means.shape[2:] != (shape.heads, shape.head_dim):
            raise ValueError(f"projection {self.digest}: fitted for {self.means.shape[2]} heads x "
                             f"{self.means.shape[3]} channels, the KV has {shape.heads} x "
                             f"{shape.head_dim}")
        if r > self.max_rank:
            raise ValueError(f"projection {self.digest}: rank {self.max_rank} < the {r} that "
                             f"compression.ratio asks")

    def save(self, path: str) -> None:
        _save_npz(path, self.digest, means=self.means, bases=self.bases)

    @classmethod
    def load(cls, path: str, expect: Optional[str] = None) -> "Projection":
        p = _load_npz(path, "compression.projection", cls.build, "means", "bases")
        if expect is not None and expect != p.digest:
            raise ValueError(f"config key 'compression.projection': {path!r} is version "
                              f"{p.digest}, expected {expect}")
        return p


def fit_projection(samples, max_rank: Optional[int] = None) -> Projection:
    """PCA per layer, key/value and head. ``samples``: a sequence over layers of arrays
    ``[n, 2, H, D]`` (calibration KV vectors of that layer, any float type)."""
    means, bases = [], []
    for layer, s in enumerate(samples):
        x = np.asarray(s, dtype=np.float64)
        if x.ndim != 4 or x.shape[1] != 2 or x.shape[0] < 2:
            raise ValueError(f"fit_projection: layer {layer}: expected [n >= 2, 2, H, D], got "
                             f"{list(x.shape)}")
        if not np.isfinite(x).all():
            raise ValueError(f"fit_projection: layer {layer}: NaN or infinite values")
        mu = x.mean(axis=0)                                   # [2, H, D]
        c = x - mu
        cov = np.einsum("nkhd,nkhe->khde", c, c) / (x.shape[0] - 1)
        w, v = np.linalg.eigh(cov)                            # ascending
        v = v[..., ::-1]                                      # [2, H, D, D] by decreasing variance
        r = v.shape[-1] if max_rank is None else min(int(max_rank), v.shape[-1])
        means.append(mu)
        bases.append(v[..., :r])
    return Projection.build(np.stack(means), np.stack(bases))


# ---------------------------------------------------------------------------------------------
# key rounding (keys per channel: INT8, INT4, sparse)

#: the magnitude from which an encoder with a :class:`KeyRounding` refuses a shard: with the
#: rounding errors bounded (``|e| <= 128 s``) and ``|F| <=`` :data:`FEEDBACK_LIMIT`, every
#: value the feedback makes stays finite
ROUNDING_LIMIT = 2.0 ** 64
FEEDBACK_LIMIT = 2.0 ** 20


@dataclasses.dataclass(frozen=True)
class KeyRounding:
    """How an encoder picks the codes of keys quantized per channel (INT8, INT4, sparse) so that
    the error of the attention logits ``q . k``
    is small, not each key's own error: per layer and KV head, the channels in the order
    ``order [L, H, D]`` (decreasing query energy) and the feedback ``feedback [L, H, D, D]``
    float32, ``F[j, i]``: how much of channel ``j``'s rounding error channel ``i`` takes before
    it is coded (zero for the channels coded before ``j``); :func:`fit_key_rounding` derives
    both from the second moments of calibration queries. The rule is in
    :func:`ucm.reference.compress.round_keys`. ``digest``: the file's version (not part of the
    codec's identity: the codes decode the same way whichever rule chose them)."""
    order: np.ndarray
    feedback: np.ndarray
    digest: str

    @classmethod
    def build(cls, order, feedback) -> "KeyRounding":
        order = _array(order, "key rounding: order", "iu", np.int64)
        feedback = _array(feedback, "key rounding: feedback", "iuf", np.float32)
        if order.ndim != 3 or feedback.shape != order.shape + order.shape[-1:] or not order.size:
            raise ValueError(f"key rounding: order [L, H, D] and feedback [L, H, D, D] with "
                             f"L, H, D >= 1, got {list(order.shape)} and {list(feedback.shape)}")
        d = order.shape[-1]
        if not (np.sort(order, axis=-1) == np.arange(d)).all():
            raise ValueError("key rounding: each order must be a permutation of the channels")
        if not np.isfinite(feedback).all() or np.abs(feedback).max(initial=0) > FEEDBACK_LIMIT:
            raise ValueError(f"key rounding: feedback must be finite and within "
                             f"{FEEDBACK_LIMIT:g} in magnitude")
        h = hashlib.blake2b(digest_size=16, person=b"ucm-rounding")
        for a in (order, feedback):
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        return cls(order, feedback, h.hexdigest())

    @property
    def layers(self) -> int:
        return self.order.shape[0]

    def check(self, shape: KVShape, layer: Optional[int] = None) -> None:
        if self.order.shape[1:] != (shape.heads, shape.head_dim):
            raise ValueError(f"key rounding {self.digest}: fitted for {self.order.shape[1]} heads "
                             f"x {self.order.shape[2]} channels, the KV has {shape.heads} x "
                             f"{shape.head_dim}")
        if layer is not None and not 0 <= layer < self.layers:
            raise ValueError(f"key rounding {self.digest}: fitted for {self.layers} layers, "
                             f"asked for layer {layer}")

    def save(self, path: str) -> None:
        _save_npz(path, self.digest, order=self.order, feedback=self.feedback)

    @classmethod
    def load(cls, path: str) -> "KeyRounding":
        return _load_npz(path, "compression.key_rounding", cls.build, "order", "feedback")


def query_moments(queries, kv_heads: int) -> np.ndarray:
    """``[H, D, D]`` second moments of one layer's queries ``[n, Hq, D]`` (after the rotary
    embedding, as they meet the cached keys; an array or a tensor of any float type), the
    ``Hq / H`` query heads of each KV head pooled (a mean over positions and heads; average
    several batches' results with equal weights)."""
    if isinstance(kv_heads, (bool, np.bool_)) or not isinstance(kv_heads, (int, np.integer)) \
            or kv_heads < 1:
        raise ValueError(f"query_moments: kv_heads: an int >= 1, got {kv_heads!r}")
    try:
        q = _float64(queries)
    except (TypeError, ValueError):
        raise ValueError(f"query_moments: expected real queries [n, Hq, D], got "
                         f"{type(queries).__name__}") from None
    if q.ndim != 3 or 0 in q.shape or q.shape[1] % kv_heads:
        raise ValueError(f"query_moments: expected [n >= 1, Hq, D] with Hq a multiple of "
                         f"kv_heads={kv_heads} and D >= 1, got {list(q.shape)}")
    n, hq, d = q.shape
    g = q.reshape(n, kv_heads, hq // kv_heads, d).transpose(1, 0, 2, 3).reshape(kv_heads, -1, d)
    return np.einsum("hnd,hne->hde", g, g) / g.shape[1]


def fit_key_rounding(moments, damp: float = 0.1) -> KeyRounding:
    """A :class:`KeyRounding` from per-layer query moments ``[H, D, D]`` (:func:`query_moments`).
    Per head: ``M + damp * mean(diag M) * I``, the channels ordered by decreasing diagonal, and
    in that order the upper Cholesky factor ``U`` of its inverse, ``F[j, i] = U[j, i] / U[j, j]``
    (GPTQ's error feedback for the logit error ``e^T M e``)."""
    damp = check_damp(damp)
    try:
        layers = [] if isinstance(moments, (str, bytes)) else list(moments)
    except TypeError:
        layers = []
    if not layers:
        raise ValueError(f"fit_key_rounding: moments: a sequence over layers of [H, D, D] "
                         f"arrays (query_moments), got {type(moments).__name__} {moments!r:.40}")
    orders, feedbacks = [], []
    for layer, m in enumerate(layers):
        try:
            m = _float64(m)
        except (TypeError, ValueError):
            m = np.zeros(0)
        if m.ndim != 3 or m.shape[1] != m.shape[2] or 0 in m.shape or not np.isfinite(m).all():
            raise ValueError(f"fit_key_rounding: layer {layer}: expected finite [H, D, D] with "
                             f"H, D >= 1, got {list(m.shape)}"
                             f"{'' if np.isfinite(m).all() else ' with NaN or infinite values'}")
        if layer and m.shape != first:
            raise ValueError(f"fit_key_rounding: layer {layer}: {list(m.shape)}, layer 0 has "
                             f"{list(first)}")
        first = m.shape
        h_n, d = m.shape[0], m.shape[1]
        order = np.empty((h_n, d), dtype=np.int64)
        fb = np.zeros((h_n, d, d), dtype=np.float64)
        for h in range(h_n):
            # the feedback does not depend on the moments' scale: a power of four brings them
            # near 1, exactly (also through the Cholesky factor's square roots), so that
            # subnormal or near-overflow moments give the same rounding as any other scale
            e = int(np.frexp(np.abs(m[h]).max())[1])
            a = np.ldexp(m[h], -(e - e % 2))
            a = (a + a.T) / 2
            if not a.any():
                raise ValueError(f"fit_key_rounding: layer {layer}, head {h}: zero moments")
            # second moments are positive semi-definite; moments rounded to float32 (rank-
            # deficient ones: fewer queries than channels) show eigenvalues down to -1e-7 of
            # the largest, which the damping covers
            w = np.linalg.eigvalsh(a)                                   # ascending
            if w[-1] <= 0 or w[0] < -1e-4 * w[-1]:
                raise ValueError(f"fit_key_rounding: layer {layer}, head {h}: not positive "
                                 f"semi-definite (smallest eigenvalue {w[0]:.3g}, largest "
                                 f"{w[-1]:.3g}), as second moments of queries are")
            a = a + damp * (float(np.trace(a)) / d) * np.eye(d)
            p = np.argsort(-np.diag(a), kind="stable")
            try:
                inv = np.linalg.inv(a[np.ix_(p, p)])
                u = np.linalg.cholesky((inv + inv.T) / 2).T             # upper: inv = U^T U
            except np.linalg.LinAlgError:
                raise ValueError(f"fit_key_rounding: layer {layer}, head {h}: singular with "
                                 f"damp {damp:g} (a larger damp makes it positive definite)") \
                    from None
            f = np.triu(u / np.diag(u)[:, None], k=1)
            order[h] = p
            fb[h][np.ix_(p, p)] = f
        orders.append(order)
        feedbacks.append(fb)
    return KeyRounding.build(np.stack(orders), np.stack(feedbacks))


def check_damp(damp) -> float:
    """``damp`` of :func:`fit_key_rounding` as a float; ValueError unless a real number (not a
    bool) in (0, 10]."""
    if isinstance(damp, (bool, np.bool_)) or not isinstance(damp, numbers.Real) \
            or not 0.0 < float(damp) <= 10.0:
        raise ValueError(f"fit_key_rounding: damp in (0, 10] (a real number), got {damp!r}")
    return float(damp)
