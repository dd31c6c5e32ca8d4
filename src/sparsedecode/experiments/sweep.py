"""The survival sweep: the paired protocol of DESIGN.md section 3 over contexts, prompts, selectors, supports, reuse.

One dense reference per (context, prompt) group, then one paired sparse run (free-running and teacher-forced)
per (selector, support, reuse). A sweep directory holds

* ``sweep.json``: the :class:`SweepSpec` (every argument that defines the results), the sha256 of the corpus
  text, the shard, and one entry per session (start time and :func:`environment`). Written before any row; a
  later run into the same directory with another spec, corpus or shard is refused.
* ``runs.jsonl``: one JSON row per finished run (see :func:`make_row`), appended with a single ``os.write``
  of the whole line and an ``fsync``. A run killed mid-write leaves at most a torn last line, which is
  dropped on resume, so a rerun with the same arguments continues where it stopped and never repeats a row.

``--shard i/n`` runs every n-th (context, prompt) group (round-robin, 1-based ``i``), so a shard never
recomputes another shard's dense reference; :func:`merge_sweeps` combines shard directories into one.
Nothing is random: the rows of two runs with the same spec differ only in timing fields (names ending in
``_s``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..compare import CompareResult, Progress, compare, dense_reference
from ..config import SparseConfig
from ..errors import SparseDecodeError
from .corpus import DEFAULT_CORPUS, GAP, check_context_fits, load_text, prompt_count, prompt_ids
from .environment import environment

SPEC_FILE = "sweep.json"
RUNS_FILE = "runs.jsonl"
LOCK_FILE = ".lock"
KEY_FIELDS = ("context", "prompt_index", "support", "reuse", "selector")
"""The fields of a row that identify its run; a sweep never holds two rows with the same key."""

RunKey = tuple[int, int, int, int, str]
Group = tuple[int, int]
"""``(context, prompt_index)``: the runs that share one dense reference."""


@dataclass(frozen=True)
class SweepSpec:
    """Everything that defines a sweep's results (and nothing that does not, such as the output folder).

    ``prompts`` counts prompts per context (prompt indices ``0 .. prompts - 1``, non-overlapping corpus
    prefixes spaced ``context + tokens + gap`` tokens apart). ``reuse`` is a list of selection intervals R,
    ``selectors`` a list of selector names (every selector runs against the same dense references).
    """

    model: str
    dtype: str = "float32"
    corpus: str = DEFAULT_CORPUS
    contexts: tuple[int, ...] = (2048,)
    supports: tuple[int, ...] = (97, 193, 385, 769)
    reuse: tuple[int, ...] = (1,)
    selectors: tuple[str, ...] = ("mean-pooled",)
    prompts: int = 5
    tokens: int = 128
    window: int = 64
    block_size: int = 16
    audit: bool = False
    gap: int = GAP

    def __post_init__(self) -> None:
        for name in ("contexts", "supports", "reuse"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise SparseDecodeError(f"{name} must be a non-empty list of integers, got {values!r}")
            if len(set(values)) != len(values):
                raise SparseDecodeError(f"{name} lists a value twice: {', '.join(map(str, values))}")
        selectors = (self.selectors,) if isinstance(self.selectors, str) else tuple(self.selectors)
        object.__setattr__(self, "selectors", selectors)
        if not selectors or not all(isinstance(s, str) for s in selectors):
            raise SparseDecodeError(f"selectors must be a non-empty list of selector names, got {selectors!r}")
        if len(set(selectors)) != len(selectors):
            raise SparseDecodeError(f"selectors lists a selector twice: {', '.join(selectors)}")
        if any(c < 1 for c in self.contexts):
            raise SparseDecodeError("contexts must be >= 1")
        if not isinstance(self.prompts, int) or self.prompts < 1:
            raise SparseDecodeError(f"prompts must be an integer >= 1, got {self.prompts!r}")
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise SparseDecodeError(f"tokens must be an integer >= 2 (got {self.tokens!r}): step 1 is shared")
        if not isinstance(self.gap, int) or self.gap < 0:
            raise SparseDecodeError(f"gap must be an integer >= 0, got {self.gap!r}")
        self.configs()  # validates supports, window, block size, reuse and selectors

    def configs(self) -> list[SparseConfig]:
        """One :class:`SparseConfig` per (selector, support, reuse): selectors outer, then supports."""
        return [
            SparseConfig(
                support=s,
                window=self.window,
                block_size=self.block_size,
                reuse=r,
                selector=selector,
                audit=self.audit,
            )
            for selector in self.selectors
            for s in self.supports
            for r in self.reuse
        ]

    def groups(self) -> list[Group]:
        """All (context, prompt) groups in run order: prompts outer, so a partial sweep covers every context."""
        return [(c, p) for p in range(self.prompts) for c in self.contexts]

    def group_keys(self, group: Group) -> list[RunKey]:
        context, prompt = group
        return [(context, prompt, cfg.support, cfg.reuse, cfg.selector) for cfg in self.configs()]

    def keys(self) -> list[RunKey]:
        """Every run of the sweep, in the order an unsharded sweep runs them."""
        return [key for group in self.groups() for key in self.group_keys(group)]

    def to_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SweepSpec:
        """Inverse of :meth:`to_dict`; fields missing from older files take their defaults.

        Files written before several selectors per sweep hold one ``selector``: read as ``selectors = [it]``.
        """
        data = dict(data)
        if "selector" in data:
            if "selectors" in data:
                raise SparseDecodeError("sweep spec has both 'selector' and 'selectors'; keep one")
            data["selectors"] = [data.pop("selector")]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SparseDecodeError(f"sweep spec has unknown fields {', '.join(unknown)}: written by a newer version?")
        return cls(**data)

    def differences(self, other: SweepSpec) -> list[str]:
        """``"name: mine vs other"`` for every field that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{name}: {mine[name]!r} vs {theirs[name]!r}" for name in mine if mine[name] != theirs[name]]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based): every ``count``-th (context, prompt) group, starting at ``index``."""

    index: int = 1
    count: int = 1

    def __post_init__(self) -> None:
        if not (1 <= self.index <= self.count):
            raise SparseDecodeError(f"shard {self.index}/{self.count}: need 1 <= i <= n in --shard i/n")

    @classmethod
    def parse(cls, text: str) -> Shard:
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError as error:
            raise SparseDecodeError(f"--shard expects i/n such as 1/4, got {text!r}") from error
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def groups(self, spec: SweepSpec) -> list[Group]:
        return [g for number, g in enumerate(spec.groups()) if number % self.count == self.index - 1]


def key_of(row: dict) -> RunKey:
    return tuple(row[name] for name in KEY_FIELDS)  # type: ignore[return-value]


def timing_fields(row: dict) -> list[str]:
    """Names of a row's timing fields (they end in ``_s``; everything else is deterministic)."""
    return [name for name in row if name.endswith("_s")]


def without_timings(row: dict) -> dict:
    return {name: value for name, value in row.items() if not name.endswith("_s")}


# --- rows -------------------------------------------------------------------------------------------------

RESULT_FIELDS = (
    "first_divergence",
    "survives",
    "teacher_forced_match",
    "delta_ppl_percent",
    "dense_ppl",
    "sparse_ppl",
    "mean_unique_distant_positions_per_kv",
    "sparse_steps",
    "dense_fallback_steps",
    "centroid_cache_bytes",
    "certified_fraction",
    "flips",
    "certificate_violations",
    "margin_at_divergence",
    "warning_regime",
)
CERTIFICATE_FIELDS = ("uncertified_flips", "delta_at_divergence", "median_margin", "median_delta")
AUDIT_FIELDS = (
    "identity_residual_max",
    "bound_violations",
    "omitted_mass_mean",
    "selector_recall_mean",
    "captured_mass_ratio_mean",
)
TOKEN_FIELDS = ("dense_tokens", "sparse_tokens", "teacher_forced_tokens")
TIMING_FIELDS = ("prefill_s", "dense_decode_s", "sparse_decode_s", "teacher_forced_s")


def make_row(key: RunKey, result: CompareResult, *, run_s: float, audit: bool = False) -> dict:
    """One ``runs.jsonl`` row: the key, the settings, the scalar results, the token ids and the timings.

    The long per-step lists of :class:`CompareResult` (NLL, margins, logit errors) are left out to keep
    rows small; the token id lists are kept, so continuations can be decoded and compared later.
    """
    context, prompt_index, support, reuse, selector = key
    settings = result.settings
    row: dict = {
        "context": context,
        "prompt_index": prompt_index,
        "support": support,
        "reuse": reuse,
        "selector": selector,
        "effective_support": settings["effective_support"],
        "blocks": settings["blocks"],
        "window": settings["window"],
        "block_size": settings["block_size"],
        "tokens": result.tokens,
    }
    row.update({name: getattr(result, name) for name in RESULT_FIELDS})
    row.update({name: result.certificate.get(name) for name in CERTIFICATE_FIELDS})
    if audit:
        row.update({name: getattr(result, name) for name in AUDIT_FIELDS})
    row.update({name: list(getattr(result, name)) for name in TOKEN_FIELDS})
    row.update({name: getattr(result, name) for name in TIMING_FIELDS})
    row["run_s"] = run_s
    return row


def read_rows(path: Path, *, repair: bool = False) -> list[dict]:
    """The rows of a ``runs.jsonl``; a torn last line (no final newline: a killed write) is ignored.

    With ``repair`` the torn tail is also cut from the file, so the next append starts on a fresh line.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    complete, _, torn = data.rpartition(b"\n")
    if torn and repair:
        with open(path, "r+b") as handle:
            handle.truncate(len(data) - len(torn))
            handle.flush()
            os.fsync(handle.fileno())
    rows = []
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise SparseDecodeError(
                f"{path} line {number} is not valid JSON ({error.msg}); fix or remove it"
            ) from error
    return rows


def append_row(path: Path, row: dict) -> None:
    """Append one row as a single ``os.write`` of the whole line, then ``fsync``; undone on failure."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Replace ``runs.jsonl`` with ``rows`` (one JSON line each) through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row, separators=(",", ":")) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the sweep directory ------------------------------------------------------------------------------------


def corpus_sha256(name: str) -> str:
    """sha256 of the corpus text, so a sweep notices when its prompts would change (another Python, a new file)."""
    return hashlib.sha256(load_text(name).encode("utf-8")).hexdigest()


def read_meta(directory: Path) -> dict | None:
    """The parsed ``sweep.json`` of ``directory``, or ``None`` when there is none."""
    path = directory / SPEC_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
        SweepSpec.from_dict(meta["spec"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise SparseDecodeError(f"{path} is not a sweep description ({type(error).__name__}); remove it") from error
    return meta


def check_meta(directory: Path, meta: dict, spec: SweepSpec, corpus: str | None, shard: Shard | None) -> None:
    """Refuse to add runs of ``spec`` (corpus hash ``corpus``, ``shard``) to a directory holding another sweep."""
    stored = SweepSpec.from_dict(meta["spec"])
    differences = stored.differences(spec)
    if differences:
        raise SparseDecodeError(
            f"{directory} holds a sweep with other settings ({'; '.join(differences)}, stored vs requested): "
            "rerun with the stored settings to resume, or use another --out"
        )
    if corpus is not None and meta.get("corpus_sha256") not in (None, corpus):
        raise SparseDecodeError(
            f"{directory} was swept over another text of corpus {spec.corpus!r} (sha256 differs), so its prompts "
            "would differ: use another --out"
        )
    stored_shard = meta.get("shard")
    if shard is not None and stored_shard is not None and stored_shard != str(shard):
        raise SparseDecodeError(
            f"{directory} holds shard {stored_shard} of this sweep, not {shard}: give each shard its own --out and "
            "combine them with `sparsedecode merge`"
        )


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (released by the OS if the process dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise SparseDecodeError(
                f"another process is writing into {directory}; wait for it or use another --out"
            ) from error
        yield
    finally:
        os.close(fd)


def _session(shard: Shard | None, env: dict) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"started": started, "shard": str(shard) if shard else None, "environment": env}


# --- running ------------------------------------------------------------------------------------------------

RowHook = Callable[[dict, int, int], None]
"""``on_row(row, done, total)``: called after each row is safely on disk (``done`` counts this shard's runs)."""


@dataclass
class SweepOutcome:
    directory: Path
    total: int
    done_before: int
    ran: int
    rows: list[dict] = field(default_factory=list, repr=False)

    @property
    def complete(self) -> bool:
        return self.done_before + self.ran == self.total


def run_sweep(
    spec: SweepSpec,
    directory: Path,
    *,
    shard: Shard | None = None,
    loaded: tuple | None = None,
    progress: Progress | None = None,
    on_row: RowHook | None = None,
    on_start: Callable[[int, int], None] | None = None,
) -> SweepOutcome:
    """Run (or resume) ``spec`` into ``directory``; returns what was there and what ran.

    ``loaded`` is an already loaded ``(model, tokenizer)`` for ``spec.model`` (otherwise it is loaded here).
    ``on_start(done, total)`` is called once the work is known, before the first run.
    """
    directory = Path(directory)
    shard = shard or Shard()
    meta = read_meta(directory)
    corpus = corpus_sha256(spec.corpus)
    if meta is not None:
        check_meta(directory, meta, spec, corpus, shard)
    if loaded is None:
        from ..models import load_model

        loaded = load_model(spec.model, dtype=spec.dtype)
    model, tokenizer = loaded
    check_context_fits(model, spec.contexts, spec.tokens)
    for context in spec.contexts:
        available = prompt_count(tokenizer, spec.corpus, context, spec.tokens, spec.gap)
        if available < spec.prompts:
            raise SparseDecodeError(
                f"corpus {spec.corpus} holds {available} non-overlapping prompt(s) of {context} tokens, "
                f"fewer than --prompts {spec.prompts}: use fewer prompts, a shorter context or a bigger corpus"
            )

    runs = directory / RUNS_FILE
    with locked(directory):
        meta = read_meta(directory)  # again, under the lock
        if meta is None:
            meta = {"spec": spec.to_dict(), "corpus_sha256": corpus, "shard": str(shard), "sessions": []}
        else:
            check_meta(directory, meta, spec, corpus, shard)
        meta["sessions"] = [*meta.get("sessions", []), _session(shard, environment(model))]
        write_json_atomic(directory / SPEC_FILE, meta)

        rows = read_rows(runs, repair=True)
        done = {key_of(row) for row in rows}
        groups = shard.groups(spec)
        total = sum(len(spec.group_keys(g)) for g in groups)
        done_before = sum(key in done for g in groups for key in spec.group_keys(g))
        outcome = SweepOutcome(directory, total, done_before, 0, rows)
        if on_start:
            on_start(done_before, total)
        configs = {(cfg.support, cfg.reuse, cfg.selector): cfg for cfg in spec.configs()}
        for group in groups:
            pending = [key for key in spec.group_keys(group) if key not in done]
            if not pending:
                continue  # no dense reference for a finished group
            context, prompt_index = group
            ids = prompt_ids(tokenizer, spec.corpus, context, prompt_index, spec.tokens, spec.gap)
            reference = dense_reference(model, ids, tokens=spec.tokens, progress=progress)
            _check_reference(
                directory, group, reference.tokens, [r for r in rows if (r["context"], r["prompt_index"]) == group]
            )
            for key in pending:
                started = time.perf_counter()
                result = compare(
                    model, tokenizer, ids, configs[key[2:]], spec.tokens, reference=reference, progress=progress
                )
                row = make_row(key, result, run_s=time.perf_counter() - started, audit=spec.audit)
                append_row(runs, row)
                done.add(key)
                rows.append(row)
                outcome.ran += 1
                if on_row:
                    on_row(row, outcome.done_before + outcome.ran, total)
    return outcome


def _check_reference(directory: Path, group: Group, tokens: list[int], stored: list[dict]) -> None:
    """Refuse to pair new runs with a dense reference that differs from the one the group's stored rows used."""
    for row in stored:
        if row["dense_tokens"] != tokens[: len(row["dense_tokens"])]:
            context, prompt_index = group
            raise SparseDecodeError(
                f"the dense reference of context {context}, prompt {prompt_index} differs from the one the rows in "
                f"{directory} were paired with (another thread count, library version or machine?): rerun where "
                "they were made, or remove that group's rows from runs.jsonl to redo the whole group"
            )


def load_sweep(directory: Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of a sweep directory (read-only: a torn last line is ignored, not cut)."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise SparseDecodeError(f"{directory} is not a sweep directory (no {SPEC_FILE})")
    return meta, read_rows(directory / RUNS_FILE)


@dataclass
class MergeOutcome:
    directory: Path
    rows: int
    duplicates: int
    missing: int


def merge_sweeps(sources: list[Path], directory: Path) -> MergeOutcome:
    """Combine the rows of sweep directories with the same spec into ``directory`` (which may be one of them).

    Rows are de-duplicated by key (the first source listing a key wins; ``directory``'s own rows come first) and
    written in the order of an unsharded sweep. Sources with another spec or corpus text are refused.
    """
    directory = Path(directory)
    if not sources:
        raise SparseDecodeError("merge needs at least one sweep directory")
    metas = [(Path(s), read_meta(Path(s))) for s in sources]
    for source, meta in metas:
        if meta is None:
            raise SparseDecodeError(f"{source} is not a sweep directory (no {SPEC_FILE})")
    first_dir, first = metas[0]
    spec = SweepSpec.from_dict(first["spec"])
    corpus = first.get("corpus_sha256")
    with locked(directory):
        own = read_meta(directory)
        if own is not None:
            metas.insert(0, (directory, own))
        for source, meta in metas:
            differences = spec.differences(SweepSpec.from_dict(meta["spec"]))
            if differences:
                raise SparseDecodeError(
                    f"cannot merge {source} with {first_dir}: their settings differ ({'; '.join(differences)}, "
                    f"{first_dir.name} vs {source.name})"
                )
            if corpus is not None and meta.get("corpus_sha256") not in (None, corpus):
                raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their corpus texts differ")
        order = {key: i for i, key in enumerate(spec.keys())}
        merged: dict[RunKey, dict] = {}
        duplicates = 0
        seen_dirs: set[Path] = set()
        for source, _ in metas:
            if source.resolve() in seen_dirs:
                continue
            seen_dirs.add(source.resolve())
            for row in read_rows(source / RUNS_FILE):
                key = key_of(row)
                if key not in order:
                    raise SparseDecodeError(f"{source} holds a run {key} that is not part of its sweep spec")
                if key in merged:
                    duplicates += 1
                else:
                    merged[key] = row
        sessions = [s for _, meta in metas for s in meta.get("sessions", [])]
        unique_sessions = [s for i, s in enumerate(sessions) if s not in sessions[:i]]
        meta = {
            "spec": spec.to_dict(),
            "corpus_sha256": corpus,
            "shard": None,
            "sessions": unique_sessions,
            "merged_from": sorted({str(source) for source, _ in metas if source.resolve() != directory.resolve()}),
        }
        rows = sorted(merged.values(), key=lambda row: order[key_of(row)])
        write_json_atomic(directory / SPEC_FILE, meta)
        write_rows(directory / RUNS_FILE, rows)
    return MergeOutcome(directory, len(rows), duplicates, len(order) - len(rows))
