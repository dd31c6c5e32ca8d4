"""The RULER-style tasks (:mod:`.ruler`): how each draws its needles, chains or word lists and renders its prompt at
a given haystack size, before templating and tokenizing.

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
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import SparseDecodeError
from .corpus import FILLER, load_text

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


@lru_cache(maxsize=4)
def _answerable(corpus: str, text: str) -> frozenset[str]:
    """The words of :func:`vocabulary` that can be common words: scoring finds an answer as a substring of the output,
    so none may lie inside another vocabulary word (an output listing the rare ``selects`` would find the common
    ``select``) or inside the task's own ``text`` (an answer echoing "in the list" would find ``list``)."""
    words = vocabulary(corpus)
    inside = {w[i:j] for w in words for i in range(len(w)) for j in range(i + 4, len(w) + 1) if j - i < len(w)}
    return frozenset(w for w in words if w not in inside and w not in text)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe() -> Callable[[random.Random, str], Render]:
    """RULER's cwe: 10 common words (up to 30 times each) among rarer words (3 times each, the last possibly fewer).
    No common word lies inside another word of the vocabulary or of the task's text (:func:`_answerable`).

    The common words' frequency is fixed per sample from the context's capacity (at most two thirds of the list, at
    most 30, at least 5),
    so short contexts still hold a list where the common words stand out; ``units`` counts rare-word items.
    """

    def prepare(rng: random.Random, corpus: str) -> Render:
        words = list(vocabulary(corpus))
        rng.shuffle(words)
        question = f"Question: What are the {CWE_COMMON} most common words in the above list?"
        prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
        answerable = _answerable(corpus, " ".join((CWE_INTRO, question, prefix)).lower())
        common = [w for w in words if w in answerable][:CWE_COMMON]
        if len(common) < CWE_COMMON:
            raise SparseDecodeError(f"corpus {corpus} has too few distinct words for cwe; use a bigger corpus")
        rare = [w for w in words if w not in common]
        seed = rng.random()

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
