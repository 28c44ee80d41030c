"""The equivalence tests' own machinery (tests/equivalence.py): the comparison rejects what it
must and says where; poisoning reaches the buffers ucm code allocates and nothing else; the
implementations come from the registry."""
import numpy as np
import pytest

import ucm  # noqa: F401  (registers the foundation and transfer ops)
from equivalence import (GOT, TOLERANCES, assert_equivalent, implementation_params, poisoned,
                         tolerance)


def test_exact_ops_reject_any_difference_and_name_the_place():
    want = np.arange(12, dtype=np.uint64).reshape(3, 4)
    assert_equivalent("hash_blocks", want.copy(), want, np.uint64)
    got = want.copy()
    got[2, 1] += 1
    with pytest.raises(AssertionError, match=r"1 of 12 elements differ.*\(2, 1\).*got.*10.*want.*9"):
        assert_equivalent("hash_blocks", got, want, np.uint64)
    with pytest.raises(AssertionError, match="shape"):
        assert_equivalent("hash_blocks", want[:2], want, np.uint64)
    with pytest.raises(AssertionError, match="dtype"):
        assert_equivalent("hash_blocks", want.astype(np.int64), want, np.uint64)


def test_tolerances_nan_and_infinities():
    torch = pytest.importorskip("torch")
    atol, rtol = tolerance("score_blocks", torch.float32)
    want = torch.tensor([[1.0, float("-inf")], [100.0, 0.0]])
    inside = want + torch.tensor([[atol / 2, 0.0], [rtol * 50, 0.0]])
    assert_equivalent("score_blocks", inside, want, torch.float32)
    for bad, match in [(torch.tensor([[1.1, float("-inf")], [100.0, 0.0]]), r"max abs error 0\.1.*\(0, 0\)"),
                       (torch.tensor([[1.0, 0.0], [100.0, 0.0]]), r"non-finite mismatch at \(0, 1\)"),
                       (torch.tensor([[1.0, float("-inf")], [100.0, float("nan")]]), r"NaN at \(1, 1\)")]:
        with pytest.raises(AssertionError, match=match):
            assert_equivalent("score_blocks", bad, want, torch.float32)
    with pytest.raises(KeyError, match="TOLERANCES"):
        tolerance("score_blocks", torch.float64)
    assert all(len(v) == 2 and min(v) >= 0 for v in TOLERANCES.values())


def test_nested_outputs_name_the_element():
    a = np.zeros(3, np.int32)
    with pytest.raises(AssertionError, match=r"\[1\]\['x'\]"):
        assert_equivalent("select_blocks", (a, {"x": a + 1}), (a, {"x": a}), "int32")


def test_poisoning_reaches_ucm_allocations_only():
    torch = pytest.importorskip("torch")
    src = ("import numpy as np, torch\n"
           "def alloc():\n"
           "    return (np.empty(3, np.int32), np.empty(2), torch.empty(2, dtype=torch.int64),\n"
           "            torch.empty(2), torch.empty_like(torch.zeros(2, dtype=torch.int16)))\n")
    scope = {"__name__": "ucm.fake_module"}                  # code of a ucm module
    exec(compile(src, "<ucm.fake_module>", "exec"), scope)
    with poisoned(GOT):
        ints, floats, tints, tfloats, like = scope["alloc"]()
        mine = np.empty(1 << 16, np.uint8)                  # the test's own allocation
    assert ints.view(np.uint8).tolist() == [0x5A] * 12 and np.isnan(floats).all()
    assert tints.tolist() == [0x5A5A5A5A5A5A5A5A] * 2 and torch.isnan(tfloats).all()
    assert like.tolist() == [0x5A5A] * 2
    assert not (mine == 0x5A).all()
    assert getattr(np.empty, "__wrapped__", None) is None and \
        getattr(torch.empty, "__wrapped__", None) is None   # the allocators are restored


def test_implementations_come_from_the_registry():
    torch = pytest.importorskip("torch")

    class Layout:
        def __init__(self, device):
            self.device = torch.device(device)

    params = implementation_params("gather_blocks", lambda d: (Layout(d),))
    assert {"reference-cpu", "native-cpu", "triton-cpu"} <= {p.id for p in params}
    [triton] = [p for p in params if p.id == "triton-cpu"]   # CPU tensors: the interpreter
    assert triton.values[0][2] is True and any(m.name == "triton_interpreter" for m in triton.marks)
