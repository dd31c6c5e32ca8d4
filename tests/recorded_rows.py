"""The rows every built-in selector gave before the selector protocol (issue #24, item 5), and how to recompute them.

``python tests/recorded_rows.py`` (from the repository root) records ``tests/data/recorded_rows.json``: on tiny
random Llama and Qwen2 models, for each of the seven built-in selectors, the paired comparison (``compare``: the
row of ``run``), a batch of two prompts through ``compare``, sparse and lossless generation (``generate``), and one
row each of ``sweep``, ``eval`` and ``compare-selectors`` (through their library functions); on SmolLM2, one paired
comparison per selector (``--real``, which needs the cached default model). tests/test_recorded_rows.py recomputes
every row with today's code and compares: tokens, counts and flags exactly, floats to float32 round-off.

The file was written once, before the refactor, by the code it describes; rerunning this script overwrites it, so
only do that for a change meant to alter what is measured (and say so in the commit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
FIXTURE = HERE / "data" / "recorded_rows.json"

SELECTORS = ("mean-pooled", "quest", "oracle-blocks", "random-blocks", "oracle-tokens", "h2o", "streaming")
NOW = {"quest": "quest:grouping=mean-query"}
"""What each recorded selector is called today (issue #39: ``quest`` now selects per query head, as its official code;
the variant recorded here is ``quest:grouping=mean-query``). Stored rows are renamed so when read
(:func:`sparsedecode.protocol.results.upgrade_selector`)."""


def now(selector: str) -> str:
    return NOW.get(selector, selector)


TIMING_SUFFIXES = ("_s", "_tokens_per_s")
DROPPED = {"centroid_bytes", "run", "machine", "started", "kernel"}


def _clean(value):
    """A result as plain JSON, timings and machine facts dropped."""
    if isinstance(value, dict):
        return {
            k: _clean(v)
            for k, v in value.items()
            if not k.endswith(TIMING_SUFFIXES) and k not in DROPPED and "time" not in k
        }
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _clean(value.tolist())
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def _result(result) -> dict:
    data = result.to_dict() if hasattr(result, "to_dict") else dict(vars(result))
    return _clean(data)


def tiny_cases():
    """(name, callable returning a JSON-able result) for every recorded tiny-model case."""
    from conftest import char_tokenizer, prompt, tiny_model

    import sparsedecode as sd
    from sparsedecode import SparseConfig

    cases = []
    for arch in ("llama", "qwen2"):
        for selector in SELECTORS:
            for support, reuse in ((97, 1), (113, 4)):
                cfg = SparseConfig(support=support, reuse=reuse, selector=now(selector))

                def paired(arch=arch, cfg=cfg):
                    model = tiny_model(arch)
                    return _result(sd.compare(model, None, prompt(300, seed=3), cfg, tokens=24))

                cases.append((f"compare/{arch}/{selector}/S{support}/R{reuse}", paired))

            def batch(arch=arch, selector=selector):
                model = tiny_model(arch)
                cfg = SparseConfig(support=97, reuse=2, selector=now(selector))
                prompts = [prompt(260, seed=5), prompt(180, seed=6)]
                return [_result(r) for r in sd.compare(model, None, prompts, cfg, tokens=16)]

            def generated(arch=arch, selector=selector):
                model = tiny_model(arch)
                cfg = SparseConfig(support=97, reuse=1, selector=now(selector))
                ids = prompt(280, seed=7)
                out = {}
                for mode in ("sparse", "lossless"):
                    g = sd.generate(model, ids, cfg, 20, mode=mode, draft_tokens=4 if mode == "lossless" else None)
                    out[mode] = {"tokens": list(g.tokens), **_clean({k: v for k, v in g.to_dict().items()})}
                return out

            cases.append((f"compare_batch/{arch}/{selector}", batch))
            cases.append((f"generate/{arch}/{selector}", generated))

    def sweep_rows():
        import tempfile

        from sparsedecode.experiments.sweep import RUNS_FILE, SweepSpec, read_rows, run_sweep

        spec = SweepSpec(
            model="tiny", contexts=(220,), supports=(97,), prompts=1, tokens=10, selectors=tuple(map(now, SELECTORS))
        )
        with tempfile.TemporaryDirectory() as folder:
            run_sweep(spec, Path(folder) / "s", loaded=(tiny_model("llama"), char_tokenizer()))
            return [_clean(r) for r in read_rows(Path(folder) / "s" / RUNS_FILE)]

    def eval_rows():
        import tempfile

        from sparsedecode.experiments.evaluate import RUNS_FILE, EvalSpec, parse_rows, run_eval

        spec = EvalSpec(
            model="tiny",
            tasks=("niah_single_noise",),
            contexts=(600,),
            samples=1,
            selectors=tuple(now(s) for s in SELECTORS if s != "h2o"),  # eval with h2o failed before the protocol
            supports=(97,),
            answer_tokens=4,
        )
        with tempfile.TemporaryDirectory() as folder:
            run_eval(spec, Path(folder) / "e", loaded=(tiny_model("llama", layers=1), char_tokenizer()))
            return [_clean(r) for r in parse_rows(Path(folder) / "e" / RUNS_FILE)]

    def selector_rows():
        from sparsedecode.experiments.selector_comparison import compare_selectors

        rows, runs, trials = compare_selectors(
            tiny_model("llama"),
            char_tokenizer(),
            corpus="python-docs",
            contexts=(300,),
            supports=(97,),
            prompts=1,
            tokens=6,
            selectors=tuple(map(now, SELECTORS)),
            retrieval=1,
        )
        return {"rows": [_result(r) for r in rows], "runs": _clean(runs), "trials": _clean(trials)}

    cases += [("sweep", sweep_rows), ("eval", eval_rows), ("compare_selectors", selector_rows)]
    return cases


def real_cases():
    """One paired comparison per selector on SmolLM2 (python-docs prompt 0, context 1024, 24 tokens, S = 97)."""
    import sparsedecode as sd
    from sparsedecode import SparseConfig
    from sparsedecode.experiments.corpus import prompt_ids

    cases = []
    for selector in SELECTORS:

        def paired(selector=selector):
            model, tokenizer = sd.load_model("smollm2-135m")
            ids = prompt_ids(tokenizer, "python-docs", 1024, 0, 24)
            cfg = SparseConfig(support=97, reuse=2, selector=now(selector))
            return _result(sd.compare(model, None, ids, cfg, tokens=24))

        cases.append((f"real/compare/{selector}", paired))
    return cases


def record(real: bool) -> None:
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    for name, case in real_cases() if real else tiny_cases():
        print(name, flush=True)
        data[name] = case()
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    record("--real" in sys.argv)
