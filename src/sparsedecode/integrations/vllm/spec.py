"""The sparsedecode configuration a vLLM engine decodes with, from vLLM's own configuration or the environment.

Two places, the first found wins:

* ``--additional-config '{"sparsedecode": {"support": 193, "selector": "quest"}}'`` (``vllm.LLM(...,
  additional_config={"sparsedecode": {...}})``): vLLM hands it to every worker;
* the environment variable :data:`ENV`, the same JSON object (``SPARSEDECODE_VLLM='{"support": 193}'``).

The object's fields are :class:`~sparsedecode.config.SparseConfig`'s (``support``, ``window``, ``block_size``,
``reuse``, ``selector`` (a registered name, a spec string, ``path.py:Class``), ``seed``, ``dense_layers``,
``layer_supports``) and ``budget``: a budget file's path (``sparsedecode calibrate``'s ``budget.json``), whose
``dense_layers`` and ``layer_supports`` it sets, and its ``reuse`` and ``selector`` where it names them (the spec
naming another is refused). Neither present: the engine decodes dense, as without the plug-in.
"""

from __future__ import annotations

import json
import os

from ...config import SparseConfig, config_from_overrides, read_budget_file
from ...errors import SparseDecodeError
from .step import check_servable

ENV = "SPARSEDECODE_VLLM"
KEY = "sparsedecode"


def spec_text(additional_config, environ=None) -> object:
    """The spec as given (a dict from vLLM's additional config, or the environment's JSON text), ``None`` if none."""
    if isinstance(additional_config, dict) and KEY in additional_config:
        if additional_config[KEY] is None:
            raise SparseDecodeError(
                f"additional_config's {KEY!r} is null: give a spec object, or leave the key out to decode dense"
            )
        return additional_config[KEY]
    environ = os.environ if environ is None else environ
    return environ.get(ENV) or None


def config_from_spec(spec: object, layers: int | None = None) -> SparseConfig:
    """The :class:`SparseConfig` of a spec (a dict, or JSON text of one), checked as the vLLM step needs it; one line
    naming what is wrong otherwise (:class:`SparseDecodeError`). With the model's number of ``layers``, a budget file
    made for a model of another number is refused, as ``--budget`` is on the command line."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as error:
            raise SparseDecodeError(f"the sparsedecode spec is not valid JSON ({error}): give an object such as "
                                    '{"support": 193, "selector": "mean-pooled"}') from None  # fmt: skip
    if not isinstance(spec, dict):
        raise SparseDecodeError(f"the sparsedecode spec must be a JSON object of SparseConfig fields, got {spec!r}")
    fields = dict(spec)
    given, budget = "budget" in fields, fields.pop("budget", None)
    if given and not (isinstance(budget, str) and budget):  # null or "" too: without a budget, leave the field out
        raise SparseDecodeError(f"spec field 'budget' is a budget file's path, got {budget!r}")
    if given:
        if "dense_layers" in fields or "layer_supports" in fields:
            raise SparseDecodeError("give the spec a budget file or dense_layers / layer_supports, not both")
        read = read_budget_file(budget)
        made_for = read.pop("layers", None)
        if layers is not None and made_for is not None and made_for != layers:
            raise SparseDecodeError(f"budget file {budget} was made for a model of {made_for} attention layers; this "
                                    f"model has {layers}")  # fmt: skip
        for name, value in read.items():
            if name in fields and _differs(name, fields[name], value):  # reuse or selector: the others were refused
                raise SparseDecodeError(f"spec field {name!r} ({fields[name]!r}) differs from budget file {budget}'s "
                                        f"{name} {value!r}: give one of the two")  # fmt: skip
            fields[name] = value
    for name, refused in (("audit", "the audit reads dense attention at every step"),
                          ("kernel", "vLLM's pages are gathered in torch")):  # fmt: skip
        if name in fields and fields.pop(name) != getattr(SparseConfig, name):  # the default asks nothing
            raise SparseDecodeError(f"spec field {name!r} is not taken by the vLLM backend: {refused}")
    config = config_from_overrides(fields)
    check_servable(config)
    return config


def _differs(name: str, given: object, budget: object) -> bool:
    if name == "selector":
        from ...selectors import resolve_selector

        return resolve_selector(given).spec() != budget
    return given != budget


def configured(additional_config, environ=None, layers: int | None = None) -> SparseConfig | None:
    """The configuration vLLM's workers decode with, ``None`` for dense (no spec); ``layers``: the model's, where
    known (:func:`config_from_spec`)."""
    spec = spec_text(additional_config, environ)
    return None if spec is None else config_from_spec(spec, layers)
