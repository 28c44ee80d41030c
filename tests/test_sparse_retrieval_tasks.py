"""The RULER-style retrieval task generators (evals/retrieval_tasks.py): needle depth,
answer uniqueness among distractors, length, determinism, errors. Seconds, no model needed."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "evals"))
import retrieval_tasks as rt  # noqa: E402


class WordTokenizer:
    """A deterministic stand-in with BPE-like pieces: words with their leading space, single
    digits, single punctuation characters, whitespace runs."""

    PATTERN = re.compile(r" ?[A-Za-z]+|\d|\s+|[^\sA-Za-z\d]")

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(p, len(self.vocab)) for p in self.PATTERN.findall(text)]


TOK = WordTokenizer()
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@pytest.mark.parametrize("task", rt.TASKS)
def test_needle_at_asked_depth(task):
    positions = []
    for depth in DEPTHS:
        inst = rt.make_instance(task, 2048, depth, 3, TOK)
        assert inst.prompt[inst.needle_char:].startswith(inst.needle)
        before = len(TOK.encode(inst.prompt[:inst.needle_char]))
        total = len(TOK.encode(inst.prompt))
        positions.append(before / total)
        # head and question are a few percent of 2K tokens; multikey has distractor needles too
        assert abs(before / total - depth) < 0.06, (task, depth, before / total)
    assert positions == sorted(positions)


@pytest.mark.parametrize("task", rt.TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_answer_once_among_distractors(task, length):
    for seed in range(3):
        inst = rt.make_instance(task, length, 0.5, seed, TOK)
        assert inst.prompt.count(inst.answer) == 1
        assert inst.needle in inst.prompt and inst.answer in inst.needle
        assert inst.answer not in inst.prompt[inst.needle_char + len(inst.needle):]
        assert inst.answer not in inst.distractors
        for d in inst.distractors:
            assert inst.prompt.count(d) == 1
        if task == "passkey":
            assert inst.distractors == ()
            assert re.fullmatch(r"\d{5}", inst.answer)
        elif task == "multikey":
            assert len(inst.distractors) == 3
            key = re.search(r"numbers for (\S+) is:", inst.needle).group(1)
            assert inst.prompt.endswith(f"magic number for {key} is ")
            assert inst.prompt.count(f"for {key} is") == 2  # the needle and the question
        else:
            assert len(inst.distractors) > length // 40  # the whole context is pairs
            key = re.match(r'"(\w+)":', inst.needle).group(1)
            assert inst.prompt.endswith(f'"{key}": "')
        # no answer-shaped digit run outside needles
        if task != "kv":
            runs = set(re.findall(r"\d{5,}", inst.prompt))
            assert runs == {inst.answer, *inst.distractors}


@pytest.mark.parametrize("task", rt.TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_length_in_tokens(task, length):
    inst = rt.make_instance(task, length, 0.3, 1, TOK)
    n = len(TOK.encode(inst.prompt))
    assert length - 80 <= n <= length


@pytest.mark.parametrize("task", rt.TASKS)
def test_deterministic_by_seed(task):
    a = rt.make_instance(task, 1024, 0.5, 7, TOK)
    b = rt.make_instance(task, 1024, 0.5, 7, TOK)
    c = rt.make_instance(task, 1024, 0.5, 8, TOK)
    assert a == b
    assert c.answer != a.answer and c.prompt != a.prompt


def test_encode_splits_prompt_and_answer():
    inst = rt.make_instance("passkey", 512, 0.5, 0, TOK)
    prompt, answer = rt.encode(TOK, inst)
    assert prompt + answer == TOK.encode(inst.prompt + inst.answer)
    assert len(answer) == 5  # one token per digit


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="task"):
        rt.make_instance("nope", 1024, 0.5, 0, TOK)
    with pytest.raises(ValueError, match="length"):
        rt.make_instance("passkey", 100, 0.5, 0, TOK)
    with pytest.raises(ValueError, match="depth"):
        rt.make_instance("passkey", 1024, 1.5, 0, TOK)
    with pytest.raises(ValueError, match="tokenizer"):
        rt.make_instance("passkey", 1024, 0.5, 0, object())
    with pytest.raises(ValueError, match="num_keys"):
        rt.make_instance("multikey", 1024, 0.5, 0, TOK, num_keys=1)
