"""RULER-style long-context tasks, generated offline at a length measured in the model's own tokens.

After RULER ("RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv 2404.06654),
its synthetic tasks, rebuilt here so that nothing is downloaded:

=====================  ========================================================================================
``niah_single_noise``  one needle ("One of the special magic numbers for KEY is: VALUE.") in repeated filler
                       sentences; answer: the 7-digit value
``niah_single_prose``  the same in corpus prose (``python-docs`` by default)
``niah_multikey``      four needles with different keys in prose; the question asks for one (three distractors)
``niah_multivalue``    four needles with the same key and different values; answer: all four values
``niah_multiquery``    four needles with different keys; the question asks for all four values
``vt``                 variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in
                       filler; answer: the five variable names
``cwe``                common-words extraction: a numbered list of words in which 10 words appear far more often
                       than the others (drawn from the corpus's vocabulary); answer: those 10 words
``fwe``                frequent-words extraction: coded words with Zipf-distributed counts (alpha = 2) and dots to
                       ignore; answer: the three most frequent coded words
=====================  ========================================================================================

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
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import SparseDecodeError
from .corpus import DEFAULT_CORPUS, FILLER, load_text

GENERATOR_VERSION = 1
"""Bumped whenever the same arguments would give other samples; stored with every evaluation."""
TOLERANCE = 0.01
"""A sample's token count lies in ``[(1 - TOLERANCE) * context, context]``."""
TEMPLATES = ("auto", "chat", "plain")
"""``auto``: the chat template when the tokenizer has one, else plain text; ``chat``: refuse a tokenizer without."""

ADJECTIVES = (
    "able ancient bitter blue brave bright broad calm careful cheap clean clever cold cool curious dark deep eager "
    "early easy empty fair famous fancy fast fierce flat fresh friendly gentle giant glad golden grand green happy "
    "heavy hidden honest huge humble icy jolly kind large late lazy little lively lonely loud lucky mighty modern "
    "narrow neat nervous noble odd old orange plain polite proud quick quiet rapid rare red rich round royal rural "
    "sharp shiny short silent silver simple slow small smooth soft solid spicy steady strong sudden sweet swift tall "
    "tame tender thick tidy tiny tough urban vast warm weak wide wild wise young"
).split()
NOUNS = (
    "anchor apple arrow badge basket beach bell bicycle blanket boat bottle bridge bucket cabin camera candle canyon "
    "carpet castle cherry circle cloud comet compass cookie copper cottage crayon crown desert diamond dragon drum "
    "eagle engine falcon feather fence forest fountain garden glacier guitar hammer harbor helmet island jacket "
    "jungle kettle kitten ladder lantern lemon lighthouse marble meadow mirror mountain needle ocean orchard owl "
    "paddle palace panda pepper piano pillow pirate planet pocket pond puzzle rabbit rainbow river rocket saddle "
    "sailor scarf shadow shell spider spoon squirrel stadium statue summit teapot thunder tiger tower tractor "
    "trumpet tunnel turtle umbrella valley violin volcano wagon walrus whistle window wizard zebra"
).split()


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


@dataclass
class Parts:
    """A task's prompt before templating: ``body`` (intro and haystack) ends where the question tail begins."""

    body: str
    question: str
    answer_prefix: str
    answers: list[str]
    info: dict = field(default_factory=dict)


Render = Callable[[int], Parts]
"""``render(units)``: the prompt with ``units`` haystack units (characters of filler or prose, list items, ...); more
units, more tokens."""


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    max_new_tokens: int
    prepare: Callable[[random.Random, str], Render]
    """``prepare(rng, corpus)`` draws everything random that does not depend on the haystack's size."""


# --- haystacks ----------------------------------------------------------------------------------------------------

_PIECE = re.compile(r"\S+\s*")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


@lru_cache(maxsize=4)
def _corpus_pieces(corpus: str) -> tuple[str, ...]:
    """The corpus as words with their trailing whitespace (joining them gives the text back, leading space aside)."""
    pieces = tuple(_PIECE.findall(load_text(corpus)))
    if len(pieces) < 100:
        raise SparseDecodeError(f"corpus {corpus} holds {len(pieces)} words; a haystack needs a bigger text")
    return pieces


_NOISE = tuple(_PIECE.findall(" ".join(s.strip() for s in FILLER) + " "))


def _haystack(kind: str, corpus: str, offset: int, chars: int) -> list[str]:
    """The first ``chars`` characters of the filler stream (``kind == "noise"``) or of the corpus from word
    ``offset`` on (cyclic), as words with their trailing whitespace; the last word may be cut."""
    source = _NOISE if kind == "noise" else _corpus_pieces(corpus)
    pieces: list[str] = []
    total = 0
    while total < chars:
        piece = source[(offset + len(pieces)) % len(source)]
        pieces.append(piece[: chars - total])
        total += len(pieces[-1])
    if pieces and not pieces[-1][-1:].isspace():
        pieces[-1] += " "
    return pieces


def _boundary(ends: list[int], count: int, depth: float) -> int:
    """The sentence boundary (``ends``: indices after a sentence-ending word, with 0 and ``count``) nearest to
    ``depth`` (0 = start, 1 = end) of ``count`` words; the nearest word boundary when no sentence ends close by."""
    target = depth * count
    nearest = min(ends, key=lambda b: (abs(b - target), b))
    return nearest if abs(nearest - target) <= max(64, 0.05 * count) else round(target)


def _plant(pieces: list[str], items: list[tuple[float, str]]) -> tuple[str, list[float]]:
    """Insert each ``(depth, text)`` at the sentence boundary nearest its depth (in order, for equal boundaries)."""
    ends = [0, len(pieces)] + [i + 1 for i, p in enumerate(pieces) if p[-1:].isspace() and _SENTENCE_END.search(p)]
    cuts = [(_boundary(ends, len(pieces), depth), i) for i, (depth, _) in enumerate(items)]
    out: list[str] = []
    start = 0
    for cut, i in sorted(cuts):
        out += pieces[start:cut]
        out.append(items[i][1] + " ")
        start = cut
    out += pieces[start:]
    return "".join(out), [cut / max(len(pieces), 1) for cut, _ in cuts]


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


# --- needle in a haystack -----------------------------------------------------------------------------------------

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."


def _niah(haystack: str, *, keys: int, values: int, queries: int) -> Callable[[random.Random, str], Render]:
    """``keys`` needle keys with ``values`` values each; the question asks for the values of ``queries`` keys."""

    def prepare(rng: random.Random, corpus: str) -> Render:
        taken_keys: set[str] = set()
        taken_values: set[str] = set()
        names = [_key(rng, taken_keys) for _ in range(keys)]
        needles = [(key, _number(rng, taken_values)) for key in names for _ in range(values)]
        depths = [rng.random() for _ in needles]
        asked = names if queries == keys else [rng.choice(names)]
        answers = [value for key, value in needles if key in asked]
        offset = rng.randrange(len(_corpus_pieces(corpus))) if haystack == "prose" else 0
        if queries == 1 and values == 1:
            question = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
            prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
        else:
            names = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + f", and {asked[-1]}"
            question = f"What are all the special magic numbers for {names} mentioned in the provided text?"
            prefix = f"The special magic numbers for {names} mentioned in the provided text are"

        def render(units: int) -> Parts:
            pieces = _haystack("noise" if haystack == "noise" else "prose", corpus, offset, units)
            text, placed = _plant(pieces, [(d, NEEDLE.format(key=k, value=v)) for d, (k, v) in zip(depths, needles)])
            info = {"needles": [[k, v] for k, v in needles], "depths": placed, "asked": asked}
            return Parts(NIAH_INTRO + text + "\n", question, prefix, answers, info)

        return render

    return prepare


# --- variable tracking --------------------------------------------------------------------------------------------

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def _vt(hops: int = 4) -> Callable[[random.Random, str], Render]:
    def prepare(rng: random.Random, corpus: str) -> Render:
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in chain)
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (
            "Answer: According to the chain(s) of variable assignment in the text above, "
            f"{len(names)} variables are assigned the value {value}, they are:"
        )

        def render(units: int) -> Parts:
            text, placed = _plant(_haystack("noise", corpus, 0, units), list(zip(depths, chain)))
            return Parts(VT_INTRO + text + "\n", question, prefix, list(names), {"chain": chain, "depths": placed})

        return render

    return prepare


# --- common words -------------------------------------------------------------------------------------------------

CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_COMMON = 10
CWE_COMMON_MAX_FREQ = 30
CWE_RARE_FREQ = 3
STOPWORDS = frozenset(
    "also been does each from have into more most must only other some such than that their them then there these "
    "they this those when where which while will with would your".split()
)


@lru_cache(maxsize=4)
def vocabulary(corpus: str) -> tuple[str, ...]:
    """The corpus's distinct lowercase words of 4 to 12 letters (common function words left out), sorted."""
    words = {w.lower() for w in re.findall(r"\b[A-Za-z][a-z]{3,11}\b", load_text(corpus))}
    return tuple(sorted(words - STOPWORDS))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe() -> Callable[[random.Random, str], Render]:
    """RULER's cwe: 10 common words (up to 30 times each) among rarer words (3 times each, the last possibly fewer).

    The common words' frequency is fixed per sample from the context's capacity (at most two thirds of the list, at
    most 30, at least 5),
    so short contexts still hold a list where the common words stand out; ``units`` counts rare-word items.
    """

    def prepare(rng: random.Random, corpus: str) -> Render:
        words = list(vocabulary(corpus))
        rng.shuffle(words)
        common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
        seed = rng.random()
        question = f"Question: What are the {CWE_COMMON} most common words in the above list?"
        prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"

        def render(units: int) -> Parts:
            needed = -(-units // CWE_RARE_FREQ)
            if needed > len(rare):
                raise SparseDecodeError(
                    f"cwe needs {needed} distinct rare words here, the vocabulary of {corpus} holds {len(rare)}: "
                    "use a shorter context or a bigger corpus"
                )
            items = [w for w in common for _ in range(render.frequency)]
            items += [rare[i // CWE_RARE_FREQ] for i in range(units)]
            random.Random(f"{seed}-{units}").shuffle(items)
            info = {"common_frequency": render.frequency, "rare_frequency": CWE_RARE_FREQ, "rare_words": needed}
            return Parts(CWE_INTRO + _numbered(items) + "\n", question, prefix, list(common), info)

        def probe(items: int) -> Parts:
            """``items`` list items of distinct words: how many items the context holds sizes the frequency."""
            return Parts(
                CWE_INTRO + _numbered([words[i % len(words)] for i in range(items)]) + "\n", question, prefix, []
            )

        render.frequency = CWE_COMMON_MAX_FREQ  # type: ignore[attr-defined]
        render.probe = probe  # type: ignore[attr-defined]
        return render

    return prepare


# --- frequent words -----------------------------------------------------------------------------------------------

FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
FWE_ALPHA = 2.0
FWE_DOTS = "...."


def _fwe() -> Callable[[random.Random, str], Render]:
    """RULER's fwe: word of rank r appears ``floor(units / r**2)`` times; rank 1 is the dots the question says to
    ignore, ranks 2-4 are the answer. Counts are exact (not sampled), so the three answers are always the top three."""

    def prepare(rng: random.Random, corpus: str) -> Render:
        del corpus
        coded: dict[str, None] = {}
        while len(coded) < 4096:
            coded.setdefault("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
        seed = rng.random()
        question = (
            f"Question: Do not provide any explanation. Please ignore the dots '{FWE_DOTS}'. "
            "What are the three most frequently appeared words in the above coded text?"
        )
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"

        def render(units: int) -> Parts:
            vocab = [FWE_DOTS, *coded]
            answers = vocab[1:4]
            counts = [int(units / (rank**FWE_ALPHA)) for rank in range(1, len(vocab) + 1)]
            if counts[3] <= counts[4]:
                raise SparseDecodeError(f"fwe needs a longer context: the top words' counts tie at {units} words")
            items = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(f"{seed}-{units}").shuffle(items)
            info = {"counts": counts[:5]}
            return Parts(FWE_INTRO + " ".join(items) + "\n", question, prefix, answers, info)

        return render

    return prepare


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("niah_single_noise", "one needle in filler", 24, _niah("noise", keys=1, values=1, queries=1)),
        Task("niah_single_prose", "one needle in corpus prose", 24, _niah("prose", keys=1, values=1, queries=1)),
        Task("niah_multikey", "four keys, one asked", 24, _niah("prose", keys=4, values=1, queries=1)),
        Task("niah_multivalue", "four values of one key", 64, _niah("prose", keys=1, values=4, queries=1)),
        Task("niah_multiquery", "four keys, all asked", 64, _niah("prose", keys=4, values=1, queries=4)),
        Task("vt", "variable tracking: a 4-hop chain in filler", 32, _vt()),
        Task("cwe", "the 10 most common words of a list", 96, _cwe()),
        Task("fwe", "the 3 most frequent coded words", 32, _fwe()),
    )
}
TASK_NAMES = tuple(TASKS)


def check_tasks(names) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise SparseDecodeError(f"unknown task(s) {', '.join(unknown) or '(none)'}; choose from: {', '.join(TASKS)}")
    if len(set(names)) != len(names):
        raise SparseDecodeError(f"tasks lists a task twice: {', '.join(names)}")
    return names


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
    starts. Chat: the user turn holds body and question, the reply starts with the answer prefix; plain: body,
    question, a newline and the answer prefix."""
    user = parts.body + parts.question
    if fmt == "plain":
        return user + "\n" + parts.answer_prefix, len(parts.body)
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
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
    rng = random.Random(f"sparsedecode-ruler-v{GENERATOR_VERSION}-{seed}-{task}-{context}-{index}")
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
