"""The task samples a calibration measures ``task-accuracy`` and ``length-ratio`` on: RULER-style samples of
``eval`` (:mod:`.ruler`), each prefilled densely once and answered densely once, then answered under each trial's
configuration from that prefilled cache, as ``eval`` runs a sample (:func:`.eval_sample.answer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SparseConfig
from ..decoding.loop import prefill
from ..errors import SparseDecodeError
from ..session import prefill_history
from .eval_sample import answer, eos_ids
from .ruler import Sample, build_sample


@dataclass
class TaskSet:
    """Samples with their dense prefills (caches holding ``ids[:question_start]``) and dense answers (``score``,
    ``output_tokens``); ``stop`` the end tokens an answer stops at."""

    samples: list[Sample]
    caches: list = field(repr=False)
    dense: list[dict]
    stop: set[int]
    histories: dict = field(default_factory=dict, repr=False)  # H2O's prefill history, made when a selector needs it

    def __len__(self) -> int:
        return len(self.samples)


def task_samples(tokenizer, tasks: tuple[str, ...], context: int, indices: range, **options) -> list[Sample]:
    """Sample ``i`` of every task for each ``i`` of ``indices`` (samples outer), at ``context`` tokens; ``options``
    are :func:`.ruler.build_sample`'s (``seed``, ``corpus``, ``template``, ``max_new_tokens``). A sample that cannot
    be built is refused naming it."""
    samples = []
    for index in indices:
        for task in tasks:
            try:
                samples.append(build_sample(tokenizer, task, context, index, **options))
            except SparseDecodeError as error:
                raise SparseDecodeError(f"{task}, context {context}, sample {index}: {error}") from None
    return samples


def check_end(model, tokenizer) -> set[int]:
    """The end tokens an answer stops at; refused in one line where the model and tokenizer name none (the
    ``length-ratio`` target compares lengths up to one)."""
    stop = eos_ids(model, tokenizer)
    if not stop:
        raise SparseDecodeError(
            "length-ratio compares answer lengths up to an end token, and this model and tokenizer name none: every "
            "answer runs to its budget"
        )
    return stop


@torch.no_grad()
def prepare_tasks(model, tokenizer, samples: list[Sample], *, need_end: bool = False, progress=None) -> TaskSet:
    """Prefill each sample up to its question and answer it densely. ``need_end``: refuse a model without an end
    token (every answer would run to its budget, so lengths could not differ)."""
    stop = check_end(model, tokenizer) if need_end else eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    caches, dense = [], []
    for number, sample in enumerate(samples):
        cache, _ = prefill(model, torch.tensor([sample.ids[: sample.question_start]], device=device))
        result = answer(model, tokenizer, sample, cache, None, stop=stop)
        caches.append(cache)
        dense.append({"score": result["score"], "output_tokens": len(result["output_ids"])})
        if progress is not None:
            progress(number + 1, len(samples))
    return TaskSet(samples, caches, dense, stop)


def measure_tasks(
    model, tokenizer, tasks: TaskSet, cfg: SparseConfig, *, on_sample: Callable[[list[dict]], None] | None = None
) -> list[dict]:
    """Every sample answered under ``cfg``: one row per sample (its score and generated tokens beside dense's).
    ``on_sample(rows so far)`` is called after each and may raise to stop."""
    rows = []
    for number, (sample, cache, dense) in enumerate(zip(tasks.samples, tasks.caches, tasks.dense)):
        history = None
        if cfg.selector.uses_history:
            if number not in tasks.histories:
                ids = torch.tensor([sample.ids[: sample.question_start]], device=next(model.parameters()).device)
                tasks.histories[number] = prefill_history(model, ids)
            history = tasks.histories[number]
        result = answer(model, tokenizer, sample, cache, cfg, stop=tasks.stop, history=history)
        rows.append(
            {
                "task": sample.task,
                "sample": sample.index,
                "score": result["score"],
                "dense_score": dense["score"],
                "output_tokens": len(result["output_ids"]),
                "dense_tokens": dense["output_tokens"],
            }
        )
        if on_sample is not None:
            on_sample(rows)
    return rows
