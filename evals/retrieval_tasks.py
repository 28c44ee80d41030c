"""RULER-style retrieval task generators for long-context (sparse attention) evaluation.

Three tasks, each an instance with a prompt that ends where the answer should start, and the
exact answer string (scored by exact match of a greedy continuation):

- ``passkey``: one "The pass key is NNNNN. Remember it." needle buried in real text;
- ``multikey``: several "One of the special magic numbers for <key> is: NNNNNNN." needles with
  different keys (the distractors) in real text; the question asks for one key's number;
- ``kv``: a JSON-like list of short random ``"key": "value"`` pairs (no other text); the question
  asks for one key's value.

The filler text is CPython's own documentation (``pydoc_data.topics``), present on every machine,
split into sentences. ``depth`` (0..1) places the asked needle that far into the context: the
needle starts after ``round(depth * filler_tokens)`` filler tokens (to the nearest sentence or
pair boundary). Lengths are in tokens of the given tokenizer (any object with ``encode(text)``
returning token ids, e.g. a Hugging Face tokenizer); the prompt is at most ``length`` tokens and
usually within a few tokens of it. Everything is deterministic for a given ``seed``.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
from typing import Any, Protocol, Sequence

TASKS = ("passkey", "multikey", "kv")

# Words for multikey needle keys: two words joined by '-' (RULER uses words / UUIDs).
_KEY_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
    "jasper", "kestrel", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven",
    "saffron", "tundra", "umber", "velvet", "willow", "xenon", "yarrow", "zephyr", "cobalt",
    "meadow", "orchid", "granite", "lantern", "copper", "thistle", "walnut", "crimson", "silver",
)


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class Instance:
    """One retrieval question.

    ``prompt`` ends right before the answer (the model continues with ``answer``);
    ``needle_char`` is where the asked needle starts in ``prompt``; ``depth`` the asked depth;
    ``distractors`` the other values present in the prompt (never equal to ``answer``).
    """

    task: str
    length: int
    depth: float
    seed: int
    prompt: str
    answer: str
    needle: str
    needle_char: int
    distractors: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def filler_sentences() -> tuple[str, ...]:
    """Sentences of CPython's topic documentation, whitespace-normalised, 40..400 characters."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    text = re.sub(r"\s+", " ", text)
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
    # Drop sentences that contain digit runs that look like answers, so an answer-shaped number
    # only ever appears in a needle.
    return tuple(s for s in parts if 40 <= len(s) <= 400 and not re.search(r"\d{4,}", s))


def _check(task: str, length: int, depth: float, tokenizer: Any) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not isinstance(length, int) or length < 256:
        raise ValueError(f"length must be an int >= 256 (tokens), got {length!r}")
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise ValueError("tokenizer must have an encode(text) -> list[int] method")


class _Counter:
    """Token counts of pieces, cached per tokenizer (pieces are joined with one space)."""

    def __init__(self, tokenizer: Any):
        # A Hugging Face fast tokenizer's Rust backend is several times faster than its wrapper.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
            backend = tokenizer  # a plain ``tokenizers.Tokenizer``
        if backend is not None:
            self.encode = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:
            self.encode = tokenizer.encode
        self.cache: dict[str, int] = {}

    def __call__(self, piece: str) -> int:
        n = self.cache.get(piece)
        if n is None:
            if len(self.cache) > 100_000:  # random key-value pairs never repeat: stay bounded
                self.cache.clear()
            n = self.cache[piece] = len(self.encode(" " + piece))
        return n

    def full(self, text: str) -> int:
        return len(self.encode(text))


@functools.lru_cache(maxsize=8)
def _counter(tokenizer: Any) -> _Counter:
    return _Counter(tokenizer)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _assemble(
    counter: _Counter,
    pieces_iter,
    needles: Sequence[tuple[float, str]],
    head: str,
    tail: str,
    length: int,
) -> tuple[str, int]:
    """Join ``head``, filler pieces with needles inserted at their depths, and ``tail``.

    Returns ``(prompt, needle_char)``, ``needle_char`` being where ``needles[0]`` starts. Filler
    is taken from ``pieces_iter`` while the prompt stays within ``length`` tokens.
    """
    fixed = counter.full(head) + counter.full(tail) + sum(counter(n) for _, n in needles) + 2
    budget = length - fixed
    if budget < 32:
        raise ValueError(f"length {length} is too short for this task's fixed text ({fixed} tokens)")
    filler: list[str] = []
    used = 0
    misses = 0
    for piece in pieces_iter:
        n = counter(piece)
        if used + n > budget:
            misses += 1  # too long for what is left: try a few shorter ones, then stop
            if misses > 50 or budget - used < 8:
                break
            continue
        filler.append(piece)
        used += n
    while True:
        prompt, needle_char = _join(counter, filler, needles, head, tail)
        # Piece counts are additive only approximately: drop filler (never a needle) to fit.
        over = counter.full(prompt) - length
        if over <= 0 or not filler:
            return prompt, needle_char
        while over > 0 and filler:
            over -= counter(filler.pop())


def _join(counter: _Counter, filler: list[str], needles: Sequence[tuple[float, str]], head: str,
          tail: str) -> tuple[str, int]:
    """Place each needle at the filler boundary nearest to its depth (in filler tokens)."""
    bounds = [0]
    for piece in filler:
        bounds.append(bounds[-1] + counter(piece))
    slots: dict[int, list[int]] = {}
    for idx, (depth, _) in enumerate(needles):
        target = depth * bounds[-1]
        pos = min(range(len(bounds)), key=lambda i: (abs(bounds[i] - target), i))
        slots.setdefault(pos, []).append(idx)
    out = [head]
    char = len(head)
    needle_char = -1
    for i in range(len(filler) + 1):
        for idx in slots.get(i, []):
            if idx == 0:
                needle_char = char + 1
            out.append(needles[idx][1])
            char += 1 + len(needles[idx][1])
        if i < len(filler):
            out.append(filler[i])
            char += 1 + len(filler[i])
    return " ".join(out) + tail, needle_char


def _text_pieces(rng: random.Random):
    sents = filler_sentences()
    start = rng.randrange(len(sents))
    i = start
    while True:
        yield sents[i % len(sents)]
        i += 1


def make_instance(task: str, length: int, depth: float, seed: int, tokenizer: Any,
                  *, num_keys: int = 4) -> Instance:
    """Build one instance of ``task`` with about ``length`` tokens, needle at ``depth``."""
    _check(task, length, depth, tokenizer)
    if not isinstance(num_keys, int) or num_keys < 2:
        raise ValueError(f"num_keys must be an int >= 2, got {num_keys!r}")
    rng = random.Random(f"{task}:{length}:{depth:.4f}:{seed}")
    counter = _counter(tokenizer)
    if task == "passkey":
        answer = _digits(rng, 5)
        needle = f"The pass key is {answer}. Remember it."
        head = ("There is an important piece of information hidden inside a lot of irrelevant "
                "text. Find it and memorize it.")
        tail = "\nQuestion: What is the pass key? Answer: The pass key is "
        prompt, nchar = _assemble(counter, _text_pieces(rng), [(depth, needle)], head, tail,
                                     length)
        distractors: tuple[str, ...] = ()
    elif task == "multikey":
        words = rng.sample(_KEY_WORDS, 2 * num_keys)
        keys = [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(num_keys)]
        values: list[str] = []
        while len(values) < num_keys:
            v = _digits(rng, 7)
            if v not in values:
                values.append(v)
        needles = [(depth, f"One of the special magic numbers for {keys[0]} is: {values[0]}.")]
        others = [d for d in (0.05 + 0.9 * rng.random() for _ in range(num_keys - 1))]
        needles += [(d, f"One of the special magic numbers for {k} is: {v}.")
                    for d, k, v in zip(others, keys[1:], values[1:])]
        answer, needle = values[0], needles[0][1]
        head = ("Some special magic numbers are hidden inside the following text. Make sure to "
                "memorize them. I will quiz you about the numbers afterwards.")
        tail = (f"\nQuestion: What is the special magic number for {keys[0]} mentioned in the "
                f"text? Answer: The special magic number for {keys[0]} is ")
        prompt, nchar = _assemble(counter, _text_pieces(rng), needles, head, tail, length)
        distractors = tuple(values[1:])
    else:  # kv
        alphabet = string.ascii_lowercase + string.digits
        seen: set[str] = set()

        def token() -> str:
            while True:
                s = "".join(rng.choice(alphabet) for _ in range(6))
                if s not in seen and not s.isdigit():
                    seen.add(s)
                    return s

        key, answer = token(), token()
        needle = f'"{key}": "{answer}",'
        head = "JSON data:\n{"
        # The question ends with the key written as in the data, so the answer follows it there.
        tail = f'}}\nQuestion: What is the value of "{key}" in the JSON data?\nAnswer: "{key}": "'

        def pairs():
            while True:
                yield f'"{token()}": "{token()}",'

        prompt, nchar = _assemble(counter, pairs(), [(depth, needle)], head, tail, length)
        found = re.findall(r'"([a-z0-9]{6})": "([a-z0-9]{6})",', prompt)
        distractors = tuple(v for k, v in found if k != key)
    return Instance(task=task, length=length, depth=float(depth), seed=seed, prompt=prompt,
                    answer=answer, needle=needle, needle_char=nchar, distractors=distractors)


def make_instances(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
                   seeds: Sequence[int], tokenizer: Any) -> list[Instance]:
    """Every combination of task x length x depth x seed, in that nesting order."""
    return [make_instance(t, n, d, s, tokenizer)
            for t in tasks for n in lengths for d in depths for s in seeds]


def encode(tokenizer: Any, inst: Instance) -> tuple[list[int], list[int]]:
    """``(prompt ids, answer ids)``: the answer's tokens as they follow the prompt's.

    Raises ``ValueError`` if tokenizing prompt + answer does not start with the prompt's tokens
    (the answer would then not be a plain continuation)."""
    enc = _counter(tokenizer).encode
    prompt = list(enc(inst.prompt))
    full = list(enc(inst.prompt + inst.answer))
    if full[:len(prompt)] != prompt or len(full) == len(prompt):
        raise ValueError(f"inst: the answer {inst.answer!r} does not tokenize as a continuation "
                         "of the prompt")
    return prompt, full[len(prompt):]
