"""Text corpora and prompt extraction (prompts from a corpus, docs/experiments.md).

* ``python-docs``: the interpreter's own ``pydoc_data.topics`` (~65K words of English prose); always present,
  nothing to download; the offline default.
* ``wikitext2``: the WikiText-2 raw test split through ``datasets`` (needs that package and a hub).
* any local text file, or a folder of ``.txt``/``.md`` files (read in sorted order).

Prompts are non-overlapping prefixes of the tokenised corpus: prompt ``i`` starts at ``i * stride`` with
``stride = context + tokens + gap``, so the text a dense model continues never overlaps another prompt.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SparseDecodeError

if TYPE_CHECKING:  # torch is imported where tokens are made, so the task generators' module loads without it
    import torch

FILLER = (
    "The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)
"""The classic passkey haystack: filler sentences repeated (the retrieval probe's, and RULER's noise haystack)."""

CORPORA = ("python-docs", "wikitext2")
DEFAULT_CORPUS = "python-docs"
GAP = 256
"""Tokens left unused between two prompts of a corpus (see the module docstring)."""


def _python_docs() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def _wikitext2() -> str:
    try:
        import datasets
    except ImportError as error:
        raise SparseDecodeError(
            "corpus wikitext2 needs the 'datasets' package (pip install 'sparsedecode[hub]') and a reachable "
            "hub; use --corpus python-docs or a local text file offline"
        ) from error
    from ..models.catalog import hub_unreachable

    unreachable = hub_unreachable()  # one quick connection check instead of the hub client's retries
    offline = datasets.config.HF_HUB_OFFLINE
    try:
        datasets.config.HF_HUB_OFFLINE = offline or unreachable is not None  # then only the local cache is read
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as error:  # noqa: BLE001 - any hub failure becomes one actionable line
        where = f"the hub is not reachable ({unreachable}) and" if unreachable else "the hub did not provide it and"
        raise SparseDecodeError(
            f"cannot load corpus wikitext2: {where} it is not in the local datasets cache ({type(error).__name__}); "
            "use --corpus python-docs or a local text file offline"
        ) from error
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    return "".join(rows["text"])


def _read_text_file(path: Path) -> str:
    """The UTF-8 text of one corpus file; a binary file (NUL bytes, invalid UTF-8) or an unreadable one is refused."""
    if not path.is_file():
        raise SparseDecodeError(f"corpus {path} is not a regular file or folder")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SparseDecodeError(f"cannot read corpus file {path}: {error.strerror or error}") from error
    nul = data.find(b"\0")
    if nul >= 0:
        raise SparseDecodeError(f"corpus file {path} is binary (a NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SparseDecodeError(
            f"corpus file {path} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "convert it to UTF-8 (e.g. with iconv) or give another file"
        ) from error


def _local(path: Path) -> str:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".md"} and p.is_file())
        if not files:
            raise SparseDecodeError(f"corpus folder {path} holds no .txt or .md files")
        text = "\n\n".join(_read_text_file(p) for p in files)
    else:
        text = _read_text_file(path)
    if not text.strip():
        raise SparseDecodeError(f"corpus {path} holds no text; give a non-empty text file or folder")
    return text


@lru_cache(maxsize=4)
def load_text(name: str) -> str:
    """The raw text of a corpus: ``python-docs``, ``wikitext2`` or a path."""
    if name == "python-docs":
        return _python_docs()
    if name == "wikitext2":
        return _wikitext2()
    if not name.strip():
        raise SparseDecodeError("corpus name is empty: use python-docs, wikitext2, or a text file or folder")
    path = Path(name).expanduser()
    if path.exists():
        return _local(path)
    raise SparseDecodeError(f"unknown corpus {name!r}: use python-docs, wikitext2, or a text file or folder")


def check_corpus(name: str) -> None:
    """Read corpus ``name`` once (cached) so a missing, binary or empty corpus fails before a model is loaded.

    ``wikitext2`` is fetched here too (it is needed anyway); with the hub out of reach it comes from the local
    datasets cache or fails at once (see :func:`_wikitext2`).
    """
    load_text(name)


_TOKENS: dict[tuple[str, int], torch.Tensor] = {}


def corpus_ids(tokenizer, name: str) -> torch.Tensor:
    """The whole corpus tokenised (no special tokens), as a 1-D LongTensor; memoised per tokenizer."""
    import torch

    key = (name, id(tokenizer))
    if key not in _TOKENS:
        ids = tokenizer(load_text(name), add_special_tokens=False)["input_ids"]
        _TOKENS[key] = torch.tensor(ids, dtype=torch.long)
    return _TOKENS[key]


def prompt_count(tokenizer, name: str, context: int, tokens: int, gap: int = GAP) -> int:
    """How many non-overlapping prompts of ``context`` tokens the corpus holds."""
    total = len(corpus_ids(tokenizer, name))
    stride = context + tokens + gap
    return max(0, (total - context) // stride + 1) if total >= context else 0


def prompt_ids(tokenizer, name: str, context: int, index: int, tokens: int, gap: int = GAP) -> torch.Tensor:
    """Prompt ``index`` of ``context`` tokens, shape ``(1, context)``."""
    if context < 1:
        raise SparseDecodeError(f"context must be >= 1 (got {context})")
    if index < 0:
        raise SparseDecodeError(f"prompt index must be >= 0 (got {index})")
    ids = corpus_ids(tokenizer, name)
    available = prompt_count(tokenizer, name, context, tokens, gap)
    if index >= available:
        raise SparseDecodeError(
            f"corpus {name} has {len(ids)} tokens: room for {available} prompt(s) of {context} tokens "
            f"(stride {context + tokens + gap}), so prompt index {index} does not exist; use a shorter "
            "context, a lower index or a bigger corpus"
        )
    start = index * (context + tokens + gap)
    return ids[start : start + context].unsqueeze(0)


def check_context_fits(model, contexts, tokens: int) -> None:
    """Refuse contexts whose prompt plus ``tokens`` generated tokens exceed the model's maximum positions."""
    from ..validate import max_positions

    limit = max_positions(model)
    for context in contexts:
        if limit is not None and context + tokens > limit:
            raise SparseDecodeError(
                f"context {context} + {tokens} tokens exceeds the model's {limit} positions; "
                "use a shorter --context or fewer --tokens"
            )
