"""KV codecs (ucm.compress encode / decode): the reference's rules where they were ambiguous."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ucm import compress  # noqa: E402
from ucm.codecs import CodecSpec, KVShape, encoded_bytes, offsets  # noqa: E402

SEG_SIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def make_spec(name, projection=None):
    method, _, rest = name.partition("-")
    if method == "int8":
        return CodecSpec("quantize", bits=8)
    if method == "learned":
        return CodecSpec("learned", ratio=0.25, projection=projection)
    key_mode, group = rest.split("-g")
    return CodecSpec("quantize" if method == "int4" else "sparse", bits=4, group=int(group),
                     key_mode=key_mode)


def segment(rows, spec, shape, name):
    """Segment ``name`` of encoded rows ``[n, bytes]`` as numpy ``[n, *shape]`` (bfloat16 as
    float32)."""
    at, dt, shp = offsets(spec, shape)[name]
    b = np.ascontiguousarray(rows[:, at:at + math.prod(shp) * SEG_SIZE[dt]])
    if dt == "bfloat16":
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(
            (len(b),) + tuple(shp))
    return b.view({"uint8": np.uint8, "int8": np.int8, "float16": np.float16,
                   "float32": np.float32}[dt]).reshape((len(b),) + tuple(shp))


# ---------------------------------------------------------------------------------------------
# the reference's rules where they were ambiguous

@pytest.mark.parametrize("name", ["int4-channel-g32", "int4-token-g32", "sparse-channel-g32"])
def test_reference_zero_extremes_are_positive(name):
    """A group whose minimum or maximum is a zero stores it as +0, whichever zeros (-0, +0) the
    group holds and wherever they sit: the min / max of -0 and +0 is either, and torch's choice
    follows its reduction order (the same values gave min bits 0x8000 or 0x0000 by position),
    which another implementation cannot follow."""
    spec = make_spec(name)
    shape = KVShape("kthd", 4, 1, 64, "float32")
    layouts = ([-0.0, 0.0, 0.0, 1.0], [0.0, -0.0, 0.0, 1.0], [0.0, 0.0, -0.0, 1.0],
               [-0.0, -0.0, 0.0, 1.0], [0.0, -0.0, -0.0, 1.0])
    params = set()
    for zeros in layouts:
        x = torch.ones(1, 2, 4, 1, 64)
        x[0, 0, :, 0, 0] = torch.tensor(zeros)              # keys, channel 0 over the tokens
        x[0, 0, 3, 0, 1] = 2.0                              # sparse: token 3 the salient one
        x[0, 1, 1, 0, :32] = torch.tensor(zeros * 8)        # values, token 1: a zero minimum
        x[0, 1, 1, 0, 32:] = -torch.tensor(zeros * 8)       # ... and a zero maximum
        src = x.reshape(1, -1).contiguous().view(torch.uint8)
        dst = torch.empty(1, encoded_bytes(spec, shape), dtype=torch.uint8)
        assert compress.encode(spec, shape, src, dst, backend="reference").all()
        kp = segment(dst.numpy(), spec, shape, "kp")
        vp = segment(dst.numpy(), spec, shape, "vp")
        assert not np.signbit(kp[kp == 0]).any() and not np.signbit(vp[vp == 0]).any(), zeros
        params.add(kp.tobytes() + vp.tobytes())
    assert len(params) == 1, "the same values in another order gave other (min, scale) bits"
