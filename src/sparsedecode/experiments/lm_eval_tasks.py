"""Export the generated RULER-style samples as local lm-evaluation-harness tasks (``lm_eval --include_path DIR``).

For each (task, context) of an :class:`~.evaluate.EvalSpec`, ``DIR`` receives ``sparsedecode_TASK_CONTEXT.jsonl``
(one document per sample: ``input`` is the whole prompt exactly as :mod:`.evaluate` feeds it, chat template and
answer prefix included; ``outputs`` the expected answers) and ``sparsedecode_TASK_CONTEXT.yaml`` (a
``generate_until`` task: greedy, at most the task's answer budget, stopping at end-of-sequence, scored by
``string_match_all`` as :func:`.ruler.score` scores). Every task carries the tag ``sparsedecode_ruler``, so
``--tasks sparsedecode_ruler`` runs them all. ``sparsedecode_ruler_utils.py`` holds the scoring function the YAML
files name; ``export.json`` records the spec and the model the samples were sized for. Exporting again into the
folder replaces the export: the tasks of an earlier one that this one does not hold are removed (else
``--tasks sparsedecode_ruler`` would still run them).

The samples are sized in one model's tokens and already hold its chat template: run them with that model and
without ``--apply_chat_template``. Dense answers are the same by both routes (lm-eval's ``hf`` model and
``sparsedecode eval`` run the same token ids, greedily, to the same budget). Sparse answers differ by protocol:
``sparsedecode eval`` feeds the whole question tail under sparse attention, the lm-eval ``sparsedecode`` model its
last ``sparse_tail`` context tokens (1 by default; see :mod:`sparsedecode.integrations.lm_eval`). The YAML files name
the data files by absolute path; export again after moving the folder. This module does not import lm-eval.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SparseDecodeError
from ..files import write_json_atomic, write_text_atomic
from .eval_sample import sample_of
from .eval_spec import EvalSpec
from .ruler import GENERATOR_VERSION

TAG = "sparsedecode_ruler"
UTILS = "sparsedecode_ruler_utils"
METRIC = "string_match_all"

_UTILS_SOURCE = '''"""Scoring for the tasks sparsedecode exported here (RULER's string_match_all)."""


def process_results(doc, results):
    """The share of expected answers found in the output (case-insensitive substrings)."""
    output = results[0].lower()
    answers = doc["outputs"]
    return {"string_match_all": sum(answer.lower() in output for answer in answers) / len(answers)}
'''


def task_name(task: str, context: int) -> str:
    return f"sparsedecode_{task}_{context}"


def _yaml(task: str, context: int, data: Path, max_new_tokens: int) -> str:
    q = json.dumps
    return "\n".join(
        [
            f"task: {task_name(task, context)}",
            f"tag: {TAG}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {q(str(data))}",
            "test_split: test",
            "output_type: generate_until",
            "doc_to_text: input",
            "doc_to_target: outputs",
            "generation_kwargs:",
            "  until: []",
            f"  max_gen_toks: {max_new_tokens}",
            "  do_sample: false",
            f"process_results: !function {UTILS}.process_results",
            "metric_list:",
            f"  - metric: {METRIC}",
            "    aggregation: mean",
            "    higher_is_better: true",
            "metadata:",
            f"  version: {GENERATOR_VERSION}",
            "",
        ]
    )


@dataclass
class ExportOutcome:
    directory: Path
    tasks: list[str]
    documents: int
    removed: list[str] = field(default_factory=list)
    """Tasks of an earlier export into the folder that this one does not hold, removed."""


EXPORT_FILE = "export.json"
TASK_FILE = re.compile(r"sparsedecode_\w+")
"""What an exported task's name (and so its files' stem) looks like: no other file is ever removed."""


def exported_tasks(directory: Path) -> list[str]:
    """The tasks an earlier export wrote into ``directory``: those its ``export.json`` lists, and any task file of
    ours (``sparsedecode_*.yaml`` tagged :data:`TAG`) it may have lost track of. An ``export.json`` that is not one
    is refused."""
    path = directory / EXPORT_FILE
    names: list[str] = []
    if path.exists():
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise SparseDecodeError(f"{path} is not an export description ({error}); fix or remove it") from None
        listed = meta.get("tasks") if isinstance(meta, dict) else None
        ours = isinstance(listed, list) and all(
            isinstance(n, str) and re.fullmatch(r"sparsedecode_\w+", n) for n in listed
        )
        if not ours:
            raise SparseDecodeError(f"{path} is not an export description (no list of tasks); fix or remove it")
        names += listed
    for yaml in sorted(directory.glob("sparsedecode_*.yaml")):
        try:
            tagged = f"\ntag: {TAG}\n" in yaml.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue
        if tagged and yaml.stem not in names:
            names.append(yaml.stem)
    return names


def export_tasks(spec: EvalSpec, tokenizer, directory: Path) -> ExportOutcome:
    """Write every (task, context) of ``spec`` (samples ``0 .. spec.samples - 1``) as an lm-eval task in
    ``directory``, sized for ``tokenizer`` (the tokenizer of ``spec.model``)."""
    directory = Path(directory).resolve()
    if directory.exists() and not directory.is_dir():
        raise SparseDecodeError(f"{directory} exists and is not a folder: choose another export folder")
    earlier = exported_tasks(directory) if directory.is_dir() else []
    names, documents = [], 0
    cells = {  # every sample built before a file is written: one that cannot be fitted leaves an earlier export whole
        (task, context): [sample_of(spec, tokenizer, (task, context, index)) for index in range(spec.samples)]
        for task in spec.tasks
        for context in spec.contexts
    }
    directory.mkdir(parents=True, exist_ok=True)
    for (task, context), samples in cells.items():
        data = directory / f"{task_name(task, context)}.jsonl"
        lines = [
            json.dumps(
                {
                    "input": s.text,
                    "outputs": s.answers,
                    "task": task,
                    "context": context,
                    "sample": s.index,
                    "prompt_tokens": s.tokens,
                    "question_start": s.question_start,
                    "prompt_format": s.prompt_format,
                }
            )
            for s in samples
        ]
        write_text_atomic(data, "\n".join(lines) + "\n")
        write_text_atomic(
            directory / f"{task_name(task, context)}.yaml", _yaml(task, context, data, samples[0].max_new_tokens)
        )
        names.append(task_name(task, context))
        documents += len(samples)
    write_text_atomic(directory / f"{UTILS}.py", _UTILS_SOURCE)
    write_json_atomic(
        directory / EXPORT_FILE,
        {"spec": spec.to_dict(), "generator_version": GENERATOR_VERSION, "tasks": names, "tag": TAG},
    )
    removed = [name for name in earlier if name not in names]
    for name in removed:  # after the new export is complete: a failure before leaves the earlier one whole
        for suffix in (".yaml", ".jsonl"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
    return ExportOutcome(directory, names, documents, removed)
