"""The findings of a survival sweep set against the reference study's three (docs/definitions.md, section 3):
whether any run survives, how many conditions keep ΔPPL within 5%, and whether the runs with teacher-forced match
below 70% are the ones with ΔPPL above 100%. Kept apart from the tables so the claim the report checks is read in
one place."""

from __future__ import annotations

from ..experiments import summary
from ..experiments.sweep import SweepSpec
from .tables import format_value

REFERENCE = (
    "Qwen2-0.5B, fp16 GPU, WikiText-2 test prefixes; contexts 2K/8K/16K; S in 97..769; 5 prefixes; T = 128; 60 runs"
)
"""The reference study's conditions, as the report names them."""


def findings_lines(spec: SweepSpec, rows: list[dict], dense: list[dict]) -> list[str]:
    """The findings section of the sweep ``spec``'s ``rows``; ``dense`` are the conditions that are dense by
    construction, left out of every number (and said so first)."""
    tolerance = summary.within_tolerance(rows)
    overview = summary.overview(rows)
    apart = (
        [
            f"{overview['dense_by_construction_runs']} run(s) in {len(dense)} condition(s) "
            + _dense_reason([r for r in rows if summary.dense_by_construction(r)])
            + ", so they equal dense decoding by construction. They are left out of every number, table and plot "
            "below except the table of their own.",
            "",
        ]
        if dense
        else []
    )
    return [
        "## Findings, in the reference study's terms",
        "",
        f"The reference study (docs/definitions.md, section 3): {REFERENCE}.",
        "",
        *apart,
        f"- **Survival**: {overview['survived']} of {overview['runs']} runs stayed identical to dense greedy "
        f"decoding for all {spec.tokens} tokens (reference: 0 of 60); median first divergence "
        f"{format_value(overview['first_divergence_median'])} (runs that never diverge count as {spec.tokens}).",
        f"- **Perplexity**: {tolerance['within']} of the {tolerance['conditions']} conditions with S >= 193 have a "
        f"median ΔPPL within ±5% (reference: 7 of 9); largest ΔPPL of any run " + _largest(overview) + ".",
        f"- **Warning regime**: {overview['warning_runs']} run(s) have teacher-forced match below 70%, from "
        f"{len(overview['warning_runs_prompts'])} (context, prompt) pair(s); "
        f"{overview['warning_runs_above_100_percent']} of them have ΔPPL above 100% (reference: all 7, from two "
        f"prefixes). {overview['runs_above_100_percent']} run(s) in all have ΔPPL above 100%.",
        "",
    ]


def _dense_reason(runs: list[dict]) -> str:
    """Why ``runs`` (dense by construction) equal dense decoding: their support covers every position, or they took
    no sparse step at all (every layer kept dense by per-layer settings, whatever the support), or some of each."""
    covered = sum(summary.covers_every_position(r) for r in runs)
    wide = "have an effective support S >= context + T - 1: every step attends to the whole cache"
    kept = "took no sparse step: every layer was kept dense (--dense-layers, --layer-supports) with S < context + T - 1"
    if covered in (0, len(runs)):
        return wide if covered else kept
    return f"are of two kinds ({covered} {wide}; {len(runs) - covered} {kept})"


def _largest(overview: dict) -> str:
    """The largest ΔPPL of any run, in percent; why there is none where no run counts or one's ΔPPL is NaN (two
    infinite perplexities, or a NaN NLL: a maximum over it has no value)."""
    value = overview["max_delta_ppl_percent"]
    if not overview["runs"]:
        return "- (no run)"
    return "- (a run's ΔPPL is NaN)" if value != value else f"{format_value(value, 2)}%"
