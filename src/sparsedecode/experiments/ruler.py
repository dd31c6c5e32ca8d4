"""RULER-style long-context tasks, generated offline at a length measured in the model's own tokens.

After RULER ("RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv 2404.06654),
its synthetic tasks, rebuilt here so that nothing is downloaded. The tasks (a table of them, and how each draws and
renders its prompt) are :mod:`.ruler_tasks`; this module writes a task's prompt as the model reads it, fitted to a
length, and scores answers.

A :class:`Sample` is deterministic given (task, context, index, seed, tokenizer, corpus). Its ``text`` is the whole
prompt as the model reads it: the task in the user turn of the model's chat template (when the tokenizer has one and
``template`` allows it; :attr:`Sample.prompt_format` says which), then the answer prefix RULER puts at the start of
the reply. ``ids`` encode ``text`` as lm-evaluation-harness's ``hf`` model encodes a context (the tokenizer's own
special tokens, unless the text already starts with BOS). The haystack is sized so that ``len(ids)`` lies within 1%
of the requested context, never above it. ``ids[question_start:]`` is the question tail: the question, the rest of
the template and the answer prefix, which the evaluation feeds one token at a time (see
:mod:`sparsedecode.experiments.evaluate`).

Scoring follows RULER's ``string_match_all``: the share of expected answers that appear (case-insensitive substring)
in the output. RULER's few-shot examples for ``cwe`` and ``fwe`` are left out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SparseDecodeError
from .corpus import DEFAULT_CORPUS
from .ruler_tasks import (
    CWE_COMMON,
    CWE_COMMON_MAX_FREQ,
    CWE_RARE_FREQ,
    FWE_DOTS,
    NEEDLE,
    TASK_NAMES,
    TASKS,
    Parts,
    check_tasks,
)

__all__ = [  # this module's names, and the tasks' names its callers import from here
    "CWE_RARE_FREQ",
    "FWE_DOTS",
    "GENERATOR_VERSION",
    "NEEDLE",
    "TASKS",
    "TASK_NAMES",
    "TEMPLATES",
    "TOLERANCE",
    "Sample",
    "add_special_tokens",
    "assemble",
    "build_sample",
    "check_tasks",
    "encode",
    "prompt_format",
    "score",
]

GENERATOR_VERSION = 2
"""Bumped whenever the same arguments would give other samples; stored with every evaluation."""
TOLERANCE = 0.01
"""A sample's token count lies in ``[(1 - TOLERANCE) * context, context]``."""
CHAT_DATE = "26 Jul 2024"
"""The date a chat template is given (``date_string``): Llama 3.2's and 3.3's write today's date where none is given,
which would make a sample depend on the day it is built; Llama 3.1's template writes this one by default."""
TEMPLATES = ("auto", "chat", "plain")
"""``auto``: the chat template when the tokenizer has one, else plain text; ``chat``: refuse a tokenizer without."""


# --- scoring ------------------------------------------------------------------------------------------------------


def score(output: str, answers: list[str]) -> float:
    """RULER's ``string_match_all``: the share of ``answers`` found in ``output`` (case-insensitive substrings)."""
    if not answers:
        raise SparseDecodeError("a sample needs at least one expected answer")
    text = output.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


# --- samples ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One generated prompt. ``ids[:question_start]`` is prefilled densely, ``ids[question_start:]`` is fed one token
    at a time, then the model answers (at most ``max_new_tokens`` tokens); ``answers`` are what scoring looks for."""

    task: str
    context: int
    index: int
    seed: int
    text: str = field(repr=False)
    ids: list[int] = field(repr=False)
    question_start: int
    answers: list[str]
    prompt_format: str
    max_new_tokens: int
    info: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def question_tokens(self) -> int:
        return len(self.ids) - self.question_start


# --- the prompt as the model reads it -----------------------------------------------------------------------------


def prompt_format(tokenizer, template: str = "auto") -> str:
    """``chat-template`` or ``plain``: how prompts for ``tokenizer`` are written under ``template``."""
    if template not in TEMPLATES:
        raise SparseDecodeError(f"unknown template {template!r}; choose one of: {', '.join(TEMPLATES)}")
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_chat:
        raise SparseDecodeError("template chat: this tokenizer has no chat template; use auto or plain")
    return "chat-template" if has_chat and template != "plain" else "plain"


def assemble(tokenizer, parts: Parts, fmt: str) -> tuple[str, int]:
    """The full prompt text and the character where the question tail (question, template end, answer prefix)
    starts. Chat: the user turn holds body and question, the reply starts with the answer prefix (a template that
    writes a date is given :data:`CHAT_DATE`); plain: body, question, a newline and the answer prefix."""
    user = parts.body + parts.question
    if fmt == "plain":
        return user + "\n" + parts.answer_prefix, len(parts.body)
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True, date_string=CHAT_DATE
    )
    at = head.rfind(user)
    if at < 0:
        raise SparseDecodeError("the chat template rewrites the user message; use --template plain")
    return head + parts.answer_prefix, at + len(parts.body)


def add_special_tokens(tokenizer, text: str) -> bool:
    """As lm-evaluation-harness's ``hf`` model encodes a context: the tokenizer's own special tokens, unless the
    text already starts with its BOS token."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and text.startswith(bos))


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens(tokenizer, text))["input_ids"])


def _token_start(tokenizer, text: str, char: int) -> int:
    """Index of the first token of ``encode(text)`` that starts at or after character ``char``."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens(tokenizer, text), return_offsets_mapping=True)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, ((start, end), token) in enumerate(zip(encoded["offset_mapping"], encoded["input_ids"])):
        if start >= char and not (start == end == 0 and token in special):
            return i
    return len(encoded["input_ids"])


def build_sample(
    tokenizer,
    task: str,
    context: int,
    index: int,
    *,
    seed: int = 0,
    corpus: str = DEFAULT_CORPUS,
    template: str = "auto",
    max_new_tokens: int | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at ``context`` tokens of ``tokenizer`` (within 1% below, never above)."""
    if task not in TASKS:
        check_tasks((task,))
    if not isinstance(context, int) or context < 1:
        raise SparseDecodeError(f"context must be a positive integer, got {context!r}")
    spec = TASKS[task]
    fmt = prompt_format(tokenizer, template)
    # seeded as in version 1: a new version changes what a task draws, not the seeds, so tasks it left alone keep
    # their samples (version 2 changed cwe's alone)
    rng = random.Random(f"sparsedecode-ruler-v1-{seed}-{task}-{context}-{index}")
    render = spec.prepare(rng, corpus)

    def length(units: int) -> int:
        return len(encode(tokenizer, assemble(tokenizer, render(units), fmt)[0]))

    if task == "cwe":  # size the common words' frequency from the context's capacity in list items
        probe = render.probe  # type: ignore[attr-defined]
        capacity = _fit(lambda n: len(encode(tokenizer, assemble(tokenizer, probe(n), fmt)[0])), context, start=1)
        render.frequency = min(CWE_COMMON_MAX_FREQ, 2 * capacity // (3 * CWE_COMMON))  # type: ignore[attr-defined]
        if render.frequency < CWE_RARE_FREQ + 2:  # type: ignore[attr-defined]
            raise SparseDecodeError(f"context {context} is too short for cwe ({capacity} list items fit)")
    start = 50 if task == "fwe" else 0
    if length(start) > context:
        raise SparseDecodeError(
            f"context {context} is too short for task {task}: {length(start)} tokens without any haystack"
        )
    units = _fit(length, context, start=start)
    parts = render(units)
    text, question_char = assemble(tokenizer, parts, fmt)
    ids = encode(tokenizer, text)
    if not (1 - TOLERANCE) * context <= len(ids) <= context:
        raise SparseDecodeError(
            f"task {task} could not be fitted to {context} tokens within {TOLERANCE:.0%} (closest: {len(ids)}); "
            "use a longer context"
        )
    question_start = _token_start(tokenizer, text, question_char)
    if not 1 <= question_start < len(ids):
        raise SparseDecodeError(f"task {task}: the question does not start inside the prompt ({question_start})")
    return Sample(
        task=task,
        context=context,
        index=index,
        seed=seed,
        text=text,
        ids=ids,
        question_start=question_start,
        answers=parts.answers,
        prompt_format=fmt,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else spec.max_new_tokens,
        info={**parts.info, "haystack_units": units},
    )


def _fit(length: Callable[[int], int], limit: int, *, start: int) -> int:
    """A number of units ``n >= start`` whose ``length(n)`` lies in ``[(1 - TOLERANCE / 2) * limit, limit]``, for a
    ``length`` that grows about linearly with ``n``: secant steps from ``start``, bisection when they stall. Returns
    the largest ``n`` found with ``length(n) <= limit`` (``start`` when even that is too long)."""
    low, low_length = start, length(start)
    if low_length > limit:
        return start
    floor = (1 - TOLERANCE / 2) * limit
    aim = (1 - TOLERANCE / 4) * limit
    high: int | None = None
    last, last_length = low, low_length
    n = start + max(16, start)
    for _ in range(64):
        size = length(n)
        if floor <= size <= limit:
            return n
        rate = (size - last_length) / (n - last) if n != last else 0.0
        last, last_length = n, size
        if size <= limit:
            low, low_length = n, size
        else:
            high = n
        if high is not None and high - low <= 1:
            return low
        guess = low + int((aim - low_length) / rate) if rate > 0 else (2 * low if high is None else low + 1)
        upper = high - 1 if high is not None else max(guess, low + 1)
        if not low < guess <= upper or guess == n:
            guess = (low + high) // 2 if high is not None else 2 * max(low, 1)
        n = max(low + 1, min(guess, upper))
    return low
