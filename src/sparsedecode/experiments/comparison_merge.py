"""Merging selector comparisons: ``compare-selectors`` folders of the same settings (model, dtype, corpus, contexts,
supports, prompts, tokens, audit, retrieval, dense layers) and different selectors become one comparison, as if
every selector had run in one command. This is how a selector added later joins a committed comparison without
rerunning the others.

The folders must have decoded the same prompts to the same dense continuations and answered the same passkey
trials densely alike (checked run by run): a selector's row is only comparable against the dense reference the
others had. Each folder's selectors and environment are kept in ``settings["parts"]`` (a merged folder's own parts, as
they were); the operator times are each folder's own (measured in its process) until
``scripts/retime_selector_ops.py`` measures them together.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SparseDecodeError
from .comparison_file import COMPARISON_FILE, read_comparison
from .selector_comparison import named_as_today, rebuild

SAME_SETTINGS = (
    "model",
    "dtype",
    "corpus",
    "context",
    "support",
    "prompts",
    "tokens",
    "audit",
    "retrieval",
    "dense_layers",
    "layer_supports",
)
"""The settings two comparisons must share to merge."""


def is_comparison_folder(folder: Path) -> bool:
    return (Path(folder) / COMPARISON_FILE).is_file()


def _agree(seen: dict, key: tuple, value, folder: Path, first: Path, what: str) -> None:
    if seen.setdefault(key, value) != value:
        raise SparseDecodeError(
            f"{folder}: {what} differs from {first}'s: not the same prompts, model or code; comparisons merge only "
            "against the same dense reference"
        )


def _parts_of(settings: dict) -> list[dict]:
    """What a folder of these ``settings`` adds to a merged comparison's ``parts``: one part (its selectors, batch,
    environment), or a merged folder's own parts, so that merging it again keeps where each of its selectors ran
    (each part marked re-measured where the folder's op times were re-measured after its merge)."""
    if isinstance(settings.get("parts"), list) and settings["parts"]:
        remeasured = settings.get("op_ms_remeasured")
        return [{**part, "op_ms_remeasured": remeasured} if remeasured else part for part in settings["parts"]]
    part = {"selectors": settings["selectors"], "batch": settings.get("batch", 1)}
    part["environment"] = settings.get("environment")
    if settings.get("op_ms_remeasured"):
        part["op_ms_remeasured"] = settings["op_ms_remeasured"]
    return [part]


def merge_comparisons(folders: list[Path], *, out: Path | None = None) -> dict:
    """One comparison document (``selectors.json``'s content, summary rebuilt) of ``folders``' runs and trials;
    ``out``: the first folder when it is the merge's ``--out``, kept rather than replaced (named so in a refusal)."""
    if len(folders) < 2:
        raise SparseDecodeError("give at least two selector comparison folders to merge")
    docs = [(Path(folder), named_as_today(read_comparison(folder))) for folder in folders]  # each checked whole first
    first, settings = docs[0][0], docs[0][1]["settings"]
    selectors: list[str] = []
    runs, trials, summary, parts = [], [], [], []
    dense: dict[tuple, object] = {}
    for folder, data in docs:
        these = data["settings"]
        differ = [name for name in SAME_SETTINGS if these.get(name) != settings.get(name)]
        if differ:
            raise SparseDecodeError(
                f"{folder}: its {', '.join(differ)} differ from {first}'s; only comparisons of the same settings merge"
            )
        again = [name for name in these["selectors"] if name in selectors]
        if again:
            held = out is not None and any(name in docs[0][1]["settings"]["selectors"] for name in again)
            where = (
                f"--out {out}, which a merge keeps (give another --out, or remove it)" if held else "an earlier folder"
            )
            raise SparseDecodeError(
                f"{folder}: selector(s) {', '.join(again)} are already in {where}; merge comparisons of different "
                "selectors"
            )
        selectors += these["selectors"]
        for run in data["runs"]:
            where = f"the dense continuation of prompt {run['prompt_index']} at context {run['context']}"
            _agree(dense, ("run", run["context"], run["prompt_index"]), run["dense_tokens"], folder, first, where)
        for trial in data.get("retrieval", []):
            if trial.get("selector") is None:
                where = f"the dense answer of passkey trial {trial['trial']} at context {trial['context']}"
                key = ("trial", trial["context"], trial["trial"])
                _agree(dense, key, (trial["passkey"], trial["answer_ids"]), folder, first, where)
                if data is not docs[0][1]:
                    continue  # one dense row per trial, the first folder's
            trials.append(trial)
        runs += data["runs"]
        summary += data["summary"]
        parts += _parts_of(these)
    contexts = list(settings["context"])
    runs.sort(key=lambda r: (contexts.index(r["context"]), r["prompt_index"]))  # stable: selectors in folder order
    trials.sort(key=lambda t: (contexts.index(t["context"]), t["trial"]))
    merged = {key: value for key, value in settings.items() if key != "op_ms_remeasured"}
    merged.update(selectors=selectors, parts=parts)
    return rebuild({"settings": merged, "summary": summary, "runs": runs, "retrieval": trials})
