"""Per-request parameters from API users (``kv_transfer_params``, e.g. ``{"ucm_blend": ...}``)
are untrusted input: a malformed one is a :class:`ucm.blend.chunks.ChunkSpecError` with a short,
readable message (logged by the scheduler, the request served without Blend), never another
exception out of the scheduler's step, never a log line as large as the input, and never
quadratic work in the scheduler's thread.

The engine-level tests drive vLLM's real scheduler with ucm's connector and CPU workers
(``connector_harness``, no model): a bad request beside a good one in the same step.
"""
import logging

import numpy as np
import pytest

from conftest import require_vllm_module

from ucm.blend import chunks

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

HUGE_INT = 10 ** 5000      # str() of it is refused by Python (int_max_str_digits: 4300)


def _nested(depth: int):
    x = [0, 1]
    for _ in range(depth):
        x = [x]
    return x


def _parse(spec, prompt=None):
    prompt = list(range(100)) if prompt is None else prompt
    return chunks.parse_request(prompt, {"ucm_blend": spec})


# ---------------------------------------------------------------------------------------------
# parse_request: any malformed marking is a ChunkSpecError (the only error the scheduler treats
# as the request's own fault)

@pytest.mark.parametrize("spec", [
    pytest.param({"chunks": [[0, 5]], "recompute_ratio": HUGE_INT}, id="ratio-huge-int"),
    pytest.param({"chunks": [[0, HUGE_INT]]}, id="chunk-end-huge-int"),
    pytest.param({"chunks": [[-HUGE_INT, 5]]}, id="chunk-start-huge-negative"),
    pytest.param({"chunks": [[0, 5], HUGE_INT]}, id="chunk-is-huge-int"),
    pytest.param({"separator": [3, HUGE_INT]}, id="separator-huge-int"),
    pytest.param({"chunks": [_nested(5000)]}, id="chunk-deeply-nested"),
    pytest.param({"chunks": [[0, 5]], "recompute_ratio": _nested(5000)}, id="ratio-deeply-nested"),
    pytest.param({"separator": _nested(5000)}, id="separator-deeply-nested"),
    pytest.param({"chunks": _nested(5000)[0]}, id="chunks-deeply-nested"),
    pytest.param(_nested(5000), id="spec-deeply-nested"),
    pytest.param({"chunks": [[0, 5]], HUGE_INT: 1}, id="unknown-key-huge-int"),
])
def test_malformed_marking_is_a_chunk_spec_error_not_another_exception(spec):
    """Before the fix the error messages repr'd the bad value: a 5000-digit int raised
    ValueError (Python's int_max_str_digits) and a deeply nested list RecursionError, neither
    caught by the scheduler (it catches ChunkSpecError only)."""
    with pytest.raises(chunks.ChunkSpecError, match=r"kv_transfer_params\['ucm_blend'\]"):
        _parse(spec)


@pytest.mark.parametrize("spec,what", [
    pytest.param({"separator": list(range(10 ** 6)) + [-1]}, "['separator']", id="separator-1e6"),
    pytest.param({"chunks": [[0, list(range(10 ** 6))]]}, "['chunks'][0]", id="chunk-holds-1e6"),
    pytest.param({"chunks": [[0, 5]], "recompute_ratio": "x" * 10 ** 6},
                 "['recompute_ratio']", id="ratio-str-1e6"),
    pytest.param({"chunks": [[0, 5]], **{f"ucm_k\u00e9y{i}": 1 for i in range(10 ** 5)}},
                 "exactly one of", id="1e5-unknown-keys"),
    pytest.param("\u2603" * 10 ** 6, "expected an object", id="spec-str-1e6"),
])
def test_error_messages_stay_short_whatever_the_input_size(spec, what):
    """A request's 10^6-element separator with one bad token id gave a 7.9 MB message, logged by
    the scheduler at every lookup of that request (vLLM asks again each step it waits)."""
    with pytest.raises(chunks.ChunkSpecError) as ei:
        _parse(spec)
    msg = str(ei.value)
    assert what in msg
    assert len(msg) < 1000, len(msg)


def test_large_valid_and_invalid_markings_are_parsed():
    n = 20000
    prompt = list(range(100, 100 + n))
    spans = [[i, i + 1] for i in range(n)]
    assert _parse({"chunks": spans}, prompt)[0] == [tuple(s) for s in spans]
    with pytest.raises(chunks.ChunkSpecError, match=r"\['chunks'\]\[1\]"):
        _parse({"chunks": [[0, 5]] * 10 ** 6}, prompt)       # the first overlap is the error


def test_a_long_separator_is_not_quadratic_in_the_prompt(monkeypatch):
    """A separator of m tokens that matches all but its last token at every position of a prompt
    of n tokens cost O(n * m) in the scheduler's thread (1.4 s for a 128k-token prompt, per
    lookup, blocking every other request): the search must be linear. Counted, not timed: the
    tokens the search compares one candidate at a time stay within a few times n + m."""
    compared = [0]
    equal = np.array_equal

    def counting(a, b, *args, **kwargs):
        compared[0] += min(np.size(a), np.size(b))
        return equal(a, b, *args, **kwargs)

    monkeypatch.setattr(np, "array_equal", counting)
    n = 65536
    prompt = [7] * n
    sep = [7] * (n // 2 - 1) + [8]
    assert _parse({"separator": sep}, prompt) == ([], None)
    assert compared[0] <= 8 * (n + len(sep)), compared[0]


@pytest.mark.parametrize("prompt,sep", [
    ([7, 7, 7, 1, 7, 7], [7, 7]),
    ([1, 2, 9, 9, 3, 9, 9, 9, 9, 4, 9, 9, 5], [9, 9]),
    ([5] * 50 + [6] + [5] * 50, [5] * 20 + [6] + [5] * 20),
    (list(np.random.default_rng(3).integers(0, 3, 400)), [1, 2, 1, 0, 1]),
    (list(np.random.default_rng(4).integers(0, 2, 3000)), [1, 0] * 20 + [1]),
    ([1, 2, 3], [1, 2, 3, 4]),
    ([1, 0] * 2000 + [1], [1, 0] * 30 + [1]),      # many overlapping matches
    ([4] * 300 + [1], [4] * 40 + [1]),
])
def test_the_separator_search_finds_leftmost_non_overlapping_occurrences(prompt, sep):
    want, i, m = [], 0, len(sep)
    while i + m <= len(prompt):
        if list(prompt[i:i + m]) == list(sep):
            want.append(i)
            i += m
        else:
            i += 1
    spans = [(a + m, b) for a, b in zip(want, want[1:]) if b > a + m]
    assert chunks.spans_from_separator(prompt, sep) == spans


# ---------------------------------------------------------------------------------------------
# the scheduler: a bad request beside a good one, in vLLM's real scheduler

require_vllm_module()

import connector_harness as H  # noqa: E402


def _prompt(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(100, 30000, size=n).tolist()


@pytest.fixture
def engine(tmp_path):
    cfg = H.store_config(tmp_path, "posix")
    cfg["blend"] = {"enabled": True}
    with H.Engine(cfg) as e:
        assert e.connector.sched._blend, "Blend must be on for this engine"
        yield e


def _serve_beside_a_good_one(engine, caplog, params, seeds, max_tokens, good_len=70):
    """A good request and one carrying ``params``, run to the end with the ucm warnings captured;
    both finish with ``max_tokens`` tokens. Returns ``(good, bad)``."""
    good = engine.add(_prompt(seeds[0], good_len), max_tokens=max_tokens)
    bad = engine.add(_prompt(seeds[1], 90), max_tokens=max_tokens)
    bad.request.kv_transfer_params = params
    with caplog.at_level(logging.WARNING, logger="ucm"):
        engine.run()
    for r in (good, bad):
        assert r.request.is_finished() and len(r.output) == max_tokens, r.req_id
    return good, bad


@pytest.mark.parametrize("params", [
    pytest.param({"ucm_blend": {"chunks": [[0, 16]], "recompute_ratio": HUGE_INT}},
                 id="ratio-huge-int"),
    pytest.param({"ucm_blend": {"chunks": [[0, HUGE_INT]]}}, id="chunk-end-huge-int"),
    pytest.param({"ucm_blend": {"separator": [HUGE_INT]}}, id="separator-huge-int"),
    pytest.param({"ucm_blend": {"chunks": [_nested(5000)]}}, id="chunk-deeply-nested"),
])
def test_a_bad_request_does_not_crash_the_step_nor_touch_the_other_request(engine, params,
                                                                          caplog):
    # (the harness checks every KV slot attention reads)
    _serve_beside_a_good_one(engine, caplog, params, (1, 2), 3)
    assert "served without Blend" in caplog.text
    assert len(caplog.text) < 5000
    H.assert_scheduler_empty(engine)


def test_a_parser_fault_costs_its_request_blend_not_the_step(engine, caplog, monkeypatch):
    """Whatever a request's parameters make the chunk parser raise (here a ZeroDivisionError,
    injected: a mock of a parser bug, which no input produces today) is that request's loss of
    Blend, logged with its traceback; the step and the other request go on."""
    from ucm.blend import chunks as blend_chunks

    real = blend_chunks.parse_request

    def parse(prompt, params, *args, **kwargs):
        if isinstance(params, dict) and params.get("ucm_blend") == "explode":
            raise ZeroDivisionError("a parser bug")
        return real(prompt, params, *args, **kwargs)

    monkeypatch.setattr(blend_chunks, "parse_request", parse)
    _serve_beside_a_good_one(engine, caplog, {"ucm_blend": "explode"}, (1, 2), 3)
    assert "could not be read" in caplog.text and "ZeroDivisionError" in caplog.text
    H.assert_scheduler_empty(engine)


@pytest.mark.parametrize("params", [
    pytest.param({"ucm_blend": {"chunks": [[40, 30]]}}, id="out-of-order"),
    pytest.param({"ucm_blend": {"chunks": [[0, 40], [30, 60]]}}, id="overlapping"),
    pytest.param({"ucm_blend": {"chunks": [[-16, 16]]}}, id="negative"),
    pytest.param({"ucm_blend": {"chunks": [[0, 10 ** 6]]}}, id="past-the-prompt"),
    pytest.param({"ucm_blend": {"chunks": [[0, 16]], "recompute_ratio": float("nan")}}, id="nan"),
    pytest.param({"ucm_blend": {"chunks": [[0, 16]], "recompute_ratio": -0.5}}, id="ratio<0"),
    pytest.param({"ucm_blend": {"chunks": [[0, 16]], "recompute_ratio": "0.5"}}, id="ratio-str"),
    pytest.param({"ucm_blend": [[0, 16]]}, id="list-not-dict"),
    pytest.param({"ucm_blend": {"chunks": {"0": 16}}}, id="chunks-dict"),
    pytest.param({"ucm_blend": {"separator": list(range(10 ** 5)) + [None]}}, id="sep-1e5-None"),
])
def test_malformed_markings_are_logged_once_per_lookup_and_served_in_full(engine, params,
                                                                         caplog):
    _, bad = _serve_beside_a_good_one(engine, caplog, params, (3, 4), 2)
    warned = [rec for rec in caplog.records if "served without Blend" in rec.getMessage()]
    assert warned and all(bad.req_id in rec.getMessage() for rec in warned)
    assert all(len(rec.getMessage()) < 1000 for rec in warned)
    assert bad.ext == 0          # nothing blended nor loaded: a full prefill
    H.assert_scheduler_empty(engine)


@pytest.mark.parametrize("params,key", [
    pytest.param({"ucm_blnd": {"chunks": [[0, 16]]}}, "ucm_blnd", id="typo"),
    pytest.param({"ucm_recompute_ratio": 0.5, "ucm_blend": False}, "ucm_recompute_ratio",
                 id="beside-ucm_blend"),
    pytest.param({"ucm_\u2603" * 1000: 1}, "ucm_\u2603", id="unicode-long-name"),
])
def test_an_unknown_ucm_key_is_ignored_with_one_warning(engine, params, key, caplog):
    """A misspelt ucm parameter was dropped without a word: the user believes the request
    blended (or was stored) as asked. It must be ignored with a warning naming the key, once
    per request, and the request served as usual."""
    # (others' keys beside them: ok)
    _, bad = _serve_beside_a_good_one(engine, caplog, dict(params, do_remote_prefill=False),
                                      (5, 6), 2, good_len=40)
    warned = [rec.getMessage() for rec in caplog.records if "unknown" in rec.getMessage()]
    assert len(warned) == 1, warned
    assert bad.req_id in warned[0] and key in warned[0] and len(warned[0]) < 1000
    assert "do_remote_prefill" not in warned[0]
    H.assert_scheduler_empty(engine)
    assert not engine.connector.sched._warned_params


def test_known_ucm_keys_warn_nothing(engine, caplog):
    r = engine.add(_prompt(7, 90), max_tokens=2)
    r.request.kv_transfer_params = {"ucm_blend": False}
    with caplog.at_level(logging.WARNING, logger="ucm"):
        engine.run()
    assert r.request.is_finished()
    assert not [rec for rec in caplog.records if "unknown" in rec.getMessage()]
