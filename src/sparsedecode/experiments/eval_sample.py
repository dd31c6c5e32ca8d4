"""One sample of an evaluation (:mod:`.evaluate`): one dense prefill of the prompt up to its question, then the
question tail fed one token at a time and the answer decoded greedily, densely and under every sparse setting from that
one cache; each answer scored as RULER scores it and made into a ``runs.jsonl`` row."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable

import torch

from ..config import SparseConfig
from ..decoding.loop import decode_tokens, prefill
from ..errors import SparseDecodeError
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache
from .eval_spec import DENSE, EvalSpec, Group, RunKey
from .ruler import Sample, build_sample, score


def sample_of(spec: EvalSpec, tokenizer, group: Group) -> Sample:
    task, context, index = group
    return build_sample(
        tokenizer,
        task,
        context,
        index,
        seed=spec.seed,
        corpus=spec.corpus,
        template=spec.template,
        max_new_tokens=spec.answer_budget(task),
    )


def prompt_sha256(sample: Sample) -> str:
    return hashlib.sha256(json.dumps(sample.ids).encode()).hexdigest()


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the generation config's end-of-sequence ids and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


@torch.no_grad()
def answer(model, tokenizer, sample: Sample, cache, cfg: SparseConfig | None, *, stop: set[int], history=None) -> dict:
    """Feed the question tail token by token and decode the answer greedily, densely (``cfg=None``) or sparsely.

    ``cache`` holds exactly ``sample.ids[:question_start]`` and is cropped back to it afterwards; ``history`` is the
    attention history of that prefill (:func:`~sparsedecode.session.prefill_history`), which a selector with
    ``uses_history`` (H2O) needs.
    """
    question = list(sample.ids[sample.question_start :])
    started = time.perf_counter()
    with sparse_decoding(model, cfg) if cfg is not None else contextlib.nullcontext() as session:
        if cfg is not None and cfg.selector.uses_history:
            session.adopt_history(cache, history)
        steps = len(question) - 1 + sample.max_new_tokens  # feed the question, then decode the answer
        (out,), _ = decode_tokens(model, cache, question[:1], steps, teacher=[question], stop=stop, nll=False)
    generated = out[len(question) - 1 :]
    reason = "eos" if generated and generated[-1] in stop else "length"
    if reason == "eos":
        generated = generated[:-1]
    decode_s = time.perf_counter() - started
    crop_cache(cache, sample.question_start)
    output = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "output": output,
        "output_ids": generated,
        "stop": reason,
        "score": score(output, sample.answers),
        "sparse_steps": 0 if session is None else session.sparse_steps,
        "dense_fallback_steps": 0 if session is None else session.dense_steps,
        "decode_s": decode_s,
    }


def make_row(key: RunKey, sample: Sample, cfg: SparseConfig | None, result: dict, **extra) -> dict:
    """One ``runs.jsonl`` row: the key, the settings, the sample's shape and answers, the output and its score."""
    task, context, index, selector, support = key
    return {
        "task": task,
        "context": context,
        "sample": index,
        "selector": selector,
        "support": support,
        "effective_support": None if cfg is None else cfg.effective_support,
        "window": None if cfg is None else cfg.window,
        "block_size": None if cfg is None else cfg.block_size,
        "reuse": None if cfg is None else cfg.reuse,
        **({} if cfg is None else {k: v for k, v in cfg.selector.record().items() if k != "selector"}),
        **({"dense_layers": list(cfg.dense_layers)} if cfg is not None and cfg.dense_layers else {}),
        **({"layer_supports": [list(p) for p in cfg.layer_supports]} if cfg is not None and cfg.layer_supports else {}),
        "prompt_tokens": sample.tokens,
        "prefill_tokens": sample.question_start,
        "question_tokens": sample.question_tokens,
        "prompt_format": sample.prompt_format,
        "prompt_sha256": prompt_sha256(sample),
        "answers": list(sample.answers),
        **{name: result[name] for name in ("output", "output_ids", "stop", "score")},
        "output_tokens": len(result["output_ids"]),  # the answer's generated length (sparse may answer longer)
        "correct": result["score"] == 1.0,
        **extra,
        "sparse_steps": result["sparse_steps"],
        "dense_fallback_steps": result["dense_fallback_steps"],
        "decode_s": result["decode_s"],
    }


def run_sample(
    model,
    tokenizer,
    sample: Sample,
    keys: list[RunKey],
    configs: dict[tuple[str, int], SparseConfig],
    *,
    stored_dense: dict | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One dense prefill of ``sample``, then dense and every sparse key of ``keys`` from that cache.

    Dense always runs (the sparse rows are paired with it); its row is returned only if ``keys`` holds it.
    ``stored_dense`` is a dense row written earlier for this sample: its output must match today's.
    """
    started = time.perf_counter()
    cache_device = next(model.parameters()).device
    cache, _ = prefill(model, torch.tensor([sample.ids[: sample.question_start]], device=cache_device))
    prefill_s = time.perf_counter() - started
    stop = eos_ids(model, tokenizer)
    dense = answer(model, tokenizer, sample, cache, None, stop=stop)
    if stored_dense is not None and (
        stored_dense["output_ids"] != dense["output_ids"] or stored_dense["prompt_sha256"] != prompt_sha256(sample)
    ):
        raise SparseDecodeError(
            f"the dense answer of {sample.task}, context {sample.context}, sample {sample.index} differs from the one "
            "stored (another tokenizer, thread count, library version or machine?): rerun where the rows were made, "
            "or remove that sample's rows from runs.jsonl to redo it"
        )
    rows, history = [], None
    for key in keys:
        cfg = None if key[3] == DENSE else configs[(key[3], key[4])]
        if cfg is not None and cfg.selector.uses_history and history is None:
            history = prefill_history(model, torch.tensor([sample.ids[: sample.question_start]], device=cache_device))
        result = dense if cfg is None else answer(model, tokenizer, sample, cache, cfg, stop=stop, history=history)
        extra = (
            {}
            if cfg is None
            else {"dense_score": dense["score"], "same_as_dense": result["output_ids"] == dense["output_ids"]}
        )
        row = make_row(key, sample, cfg, result, **extra, prefill_s=prefill_s)
        row["run_s"] = row["decode_s"] + (prefill_s if not rows else 0.0)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows
