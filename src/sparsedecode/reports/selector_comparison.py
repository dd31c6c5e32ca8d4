"""``selectors.md`` and ``selectors.csv`` of a ``compare-selectors`` folder (``selectors.json``).

The summary is recomputed from the stored runs with today's code (see
:func:`sparsedecode.experiments.selector_comparison.rebuild`) and rendered as one table of every selector at every
context and support, with what each selector reads, the dense baseline of the passkey trials and what the table
does not establish. ``compare-selectors`` prints the same cells to the console.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..errors import SparseDecodeError
from ..experiments.comparison_file import COMPARISON_FILE
from ..files import write_json_atomic, write_text_atomic
from .tables import code, format_value, shell_word, spec_cell, table_cell

SELECTORS_FILE = COMPARISON_FILE

SELECTOR_HEADERS = (
    "context",
    "selector",
    "practical",
    "S",
    "survived",
    "median first div.",
    "median TF match %",
    "median ΔPPL %",
    "certified %",
    "captured / best",
    "passkey found",
    "op ms",
)


def selector_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    """The cells of the selector table (columns :data:`SELECTOR_HEADERS`), one tuple per summary row."""
    return [
        (
            str(r["context"]),
            r["selector"],
            "yes" if r["practical"] else "reference",
            str(r["support"]),
            f"{r['survived']}/{r['runs']}",
            f"{r['median_first_divergence']:g}",
            format_value(r["median_teacher_forced_match"], 1),
            format_value(r["median_delta_ppl_percent"], 2, "+"),  # NaN (two infinite perplexities): '-'
            f"{100 * r['certified_fraction']:.1f}",
            "-" if r["captured_mass_ratio"] is None else f"{r['captured_mass_ratio']:.3f}",
            "-" if r["retrieval_correct"] is None else f"{r['retrieval_correct']}/{r['retrieval_trials']}",
            "-" if r["op_ms"] is None else f"{r['op_ms']:.3f}",
        )
        for r in rows
    ]


def dense_retrieval_lines(rows: list[dict]) -> list[str]:
    """The dense baseline of the passkey trials, one sentence per context (nothing when retrieval was off)."""
    dense = {r["context"]: r for r in rows if r["retrieval_trials"]}
    if not dense:
        return []
    found = "; ".join(
        f"{r['dense_retrieval_correct']}/{r['retrieval_trials']} at context {context}" for context, r in dense.items()
    )
    return [f"Dense attention found the passkey in {found} (the same trials).", ""]


def _selectors_command(settings: dict) -> str:
    """The ``sparsedecode compare-selectors`` command line that reproduces ``settings`` (a dtype or corpus other than
    the default included)."""
    from ..experiments.corpus import DEFAULT_CORPUS
    from ..selectors import selector_names

    selectors = settings["selectors"]
    return (
        f"sparsedecode compare-selectors --model {shell_word(settings['model'])}"
        + (f" --dtype {settings['dtype']}" if settings.get("dtype", "float32") != "float32" else "")
        + (
            f" --corpus {shell_word(settings['corpus'])}"
            if settings.get("corpus", DEFAULT_CORPUS) != DEFAULT_CORPUS
            else ""
        )
        + " --context "
        f"{','.join(map(str, settings['context']))} --support {','.join(map(str, settings['support']))} --prompts "
        f"{settings['prompts']} --tokens {settings['tokens']}"
        + ("" if list(selectors) == list(selector_names()) else f" --selectors {shell_word(','.join(selectors))}")
        + (f" --dense-layers {','.join(map(str, settings['dense_layers']))}" if settings.get("dense_layers") else "")
        + (
            f" --layer-supports {','.join(f'{k}:{v}' for k, v in settings['layer_supports'].items())}"
            if settings.get("layer_supports")
            else ""
        )
        + (" --audit" if settings.get("audit") else "")
        + (f" --retrieval {settings['retrieval']}" if settings.get("retrieval") else "")
        + (f" --batch {settings['batch']}" if settings.get("batch", 1) > 1 else "")
    )


def _parts_lines(settings: dict) -> list[str]:
    """Where a merged comparison's selectors ran (``sparsedecode merge`` of comparison folders)."""
    parts = settings.get("parts")
    if not parts:
        return []
    described = "; ".join(
        f"{', '.join(code(name) for name in part['selectors'])} at revision "
        f"{(part.get('environment') or {}).get('revision')} (batch {part.get('batch', 1)}"
        + (", op ms re-measured" if part.get("op_ms_remeasured") else "")
        + ")"
        for part in parts
    )
    return [
        f"Merged by `sparsedecode merge` from {len(parts)} comparisons of these settings, the same prompts and dense "
        f"references: {described}.",
        "",
    ]


def _table_lines(rows: list[dict]) -> list[str]:
    """The selector table of ``rows`` as Markdown lines (columns :data:`SELECTOR_HEADERS`); a selector spec holding
    what Markdown reads as markup (``*``, ``_``, a backtick, a backslash, brackets) is a code span, so that it shows
    as written (the console prints the cells as they are)."""
    return [
        "| " + " | ".join(SELECTOR_HEADERS) + " |",
        "|" + "---|" * len(SELECTOR_HEADERS),
        *(
            "| " + " | ".join(map(table_cell, (cells[0], spec_cell(cells[1]), *cells[2:]))) + " |"
            for cells in selector_cells(rows)
        ),
    ]


def _covered(rows: list[dict], runs: list[dict]) -> bool:
    """Whether the runs of every summary row of ``rows`` (dense by construction) are so because their effective
    support covers every position, not because every layer was kept dense."""
    from ..experiments.summary import covers_every_position

    conditions = {(r["context"], r["selector"], r["support"]) for r in rows}
    return all(covers_every_position(r) for r in runs if (r["context"], r["selector"], r["support"]) in conditions)


def _kind(practical: bool | None) -> str:
    """A selector's kind as the table of what each selector reads prints it."""
    return "unknown" if practical is None else "practical" if practical else "reference"


def selector_markdown(data: dict) -> str:
    """``selectors.md`` of a comparison (the JSON document of ``compare-selectors``)."""
    from ..experiments.selector_comparison import ANSWER_TOKENS

    settings, rows = data["settings"], data["summary"]
    env = settings.get("environment") or {}
    sparse = [r for r in rows if not r.get("dense_by_construction")]
    dense = [r for r in rows if r.get("dense_by_construction")]
    out = [
        f"# Selectors under one budget: {settings['model']}",
        "",
        f"Produced by {code(_selectors_command(settings))} ({settings['dtype']}, {env.get('device', 'cpu')}, "
        f"{env.get('threads')} threads, corpus {settings['corpus']}, torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}).",
        "",
        *_parts_lines(settings),
        *(_table_lines(sparse) if sparse else ["No condition takes a sparse step."]),
        "",
    ]
    if dense:
        out += [
            f"Dense by construction (effective S >= context + T - 1, T = {settings['tokens']}): every step attends to "
            "the whole cache, so these rows equal dense decoding and compare nothing:"
            if _covered(dense, data["runs"])
            else f"Dense by construction (effective S >= context + T - 1, T = {settings['tokens']}, or no sparse step: "
            "every layer kept dense by --dense-layers or --layer-supports), so these rows equal dense decoding and "
            "compare nothing:",
            "",
            *_table_lines(dense),
            "",
        ]
    fewer = [r for r in sparse if r.get("support_read_mean") is not None and r["support_read_mean"] != r["support"]]
    if fewer:
        out += [
            "Positions read per KV head and sparse step, where not S on average (fewer: an adaptive budget, or a "
            "chosen short last block; more: a support per query head, a KV head reading the union of its query "
            "heads' positions): "
            + "; ".join(
                f"{code(r['selector'])} at "
                + (f"context {r['context']}, " if len(settings["context"]) > 1 else "")  # the same S at each
                + f"S = {r['support']}: mean {r['support_read_mean']:.1f}, min "
                f"{r['support_read_min']}, max {r['support_read_max']}"
                for r in fewer
            )
            + ".",
            "",
        ]
    remeasured = settings.get("op_ms_remeasured")
    if remeasured:
        renv = remeasured.get("environment") or {}
        out += [
            f"The op ms column was re-measured alone by `{remeasured.get('by')}` (torch {renv.get('torch')}, "
            f"{renv.get('threads')} threads, revision {renv.get('revision')}) with the kernel decoding uses "
            "(`kernel=auto`).",
            "",
        ]
    out += [
        *dense_retrieval_lines(rows),
        "What each selector reads per step:",
        "",
        "| selector | kind | reads |",
        "|---|---|---|",
        *(
            f"| {table_cell(code(name))} | {_kind(practical)} | {table_cell(what)} |"
            for name, (practical, what) in {r["selector"]: (r["practical"], r["reads"]) for r in rows}.items()
        ),
        "",
        "Medians over the prompts; first div. = the decode step t >= 1 whose sparse token first differs from dense "
        f"(token 0 comes from the shared dense prefill; {settings['tokens']} = never); ΔPPL is teacher-forced on the "
        "dense continuation; certified = share of teacher-forced steps whose dense margin exceeds twice the logit "
        "error; captured / best = true attention mass on the kept distant positions over the best mass at the same "
        "budget (needs --audit); passkey found = passkey retrieval trials answered correctly (needs --retrieval N: "
        "N passkeys per context at depths spread over the haystack, filler haystack, "
        f"{ANSWER_TOKENS} greedy answer tokens, exact match); op ms = one sparse decode-attention call on synthetic "
        "data of this model's shape (selection + attention), measured in the same process. Few prompts and one "
        "model: this ranks selectors on this setup, it does not establish a general ordering.",
        "",
    ]
    return "\n".join(out)


def write_selector_comparison(directory: Path, data: dict | None = None) -> Path:
    """Write ``selectors.json``, ``selectors.csv`` and ``selectors.md`` into ``directory``; returns the markdown's
    path. Without ``data`` the stored ``selectors.json`` is read and rebuilt with today's code (runs upgraded to
    today's ``first_divergence`` convention, summary recomputed; see
    :func:`~sparsedecode.experiments.selector_comparison.rebuild`)."""
    from ..experiments.comparison_file import read_comparison
    from ..experiments.selector_comparison import rebuild

    directory = Path(directory)
    if data is None:
        data = rebuild(read_comparison(directory))  # checked whole (one line naming what is wrong) first
    rows = data["summary"]
    if not rows:
        raise SparseDecodeError(f"the selector comparison in {directory} has no summary rows")
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(list(rows[0]))
    writer.writerows(list(row.values()) for row in rows)
    markdown = selector_markdown(data)  # everything is built before the first file is written
    write_json_atomic(directory / SELECTORS_FILE, data)
    write_text_atomic(directory / "selectors.csv", table.getvalue())
    path = directory / "selectors.md"
    write_text_atomic(path, markdown)
    return path
