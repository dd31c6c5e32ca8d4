"""Sparse decoding settings (docs/definitions.md, section 1)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .errors import SparseDecodeError
from .layout import budget_blocks, check_budget, check_seed
from .selectors.base import Selector
from .selectors.registry import resolve_selector

KERNELS = ("auto", "torch", "c", "triton")
"""How a block selector's step runs: ``torch`` (torch operations: scores, top-k, gather + SDPA; any device, dtype
and head dims), ``c`` (the CPU kernel of :mod:`sparsedecode.kernels.cpu`: selection and attention in one call each,
float32, bfloat16 or float16), ``triton`` (:mod:`sparsedecode.kernels.triton.attention`; CUDA, or Triton's
interpreter on CPU), ``auto`` (Triton on CUDA, the C kernel on the CPU, each only where every assumption of its code
holds, torch otherwise). ``c`` and ``triton`` raise where they cannot serve (token-level and adaptive selectors: at
once, in :class:`SparseConfig`);
:mod:`sparsedecode.kernels.dispatch` decides."""


@dataclass(frozen=True)
class SparseConfig:
    """What every attention head reads at a decode step.

    The support is the anchor (position 0), the last ``window`` positions and the top-``b`` distant blocks of
    ``block_size`` keys, with ``b = (support - 1 - window) // block_size``. A ``support`` that is not of the
    form ``1 + window + b * block_size`` is floored to whole blocks: :attr:`effective_support` says what is
    actually read. ``reuse`` is the selection interval R (1 = fresh selection at every step).
    ``selector`` is a registered name, a spec string (``"block-top-p:p=0.8"``, ``"path/to/file.py:Class"``) or a
    selector instance (:mod:`sparsedecode.selectors`); it is held as an instance. Token-level selectors read exactly
    ``support`` positions; an adaptive one reads at most the support. ``seed`` is the session's seed (random-blocks
    draws with it). ``audit`` turns on the omitted-mass audit of :mod:`sparsedecode.protocol.diagnostics`, which
    costs one dense attention pass per sparse step; off, nothing beyond the support is ever read. ``kernel``
    picks the attention implementation (:data:`KERNELS`); it changes speed, not what is read. ``dense_layers``
    names layers (by index, from 0) that decode dense at every step, as Quest's and Twilight's evaluations keep the
    first two (``(0, 1)`` or ``"0,1"``); their steps count as dense steps. ``layer_supports`` gives layers a support
    of their own (``{2: 385}`` or ``"2:385"``; the others read ``support``): :meth:`for_layer` is a layer's
    configuration.

    Reference: "Attention-Mass Condensation for Sparse Decoding", arXiv 2602.06317.
    """

    support: int = 193
    window: int = 64
    block_size: int = 16
    reuse: int = 1
    selector: str | Selector = "mean-pooled"
    audit: bool = False
    seed: int = 0
    kernel: str = "auto"
    dense_layers: tuple[int, ...] | str = ()
    layer_supports: tuple[tuple[int, int], ...] | dict | str = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        object.__setattr__(self, "layer_supports", parse_layer_supports(self.layer_supports))
        check_budget(self.support, self.window, self.block_size)
        for layer, support in self.layer_supports:
            try:
                check_budget(support, self.window, self.block_size)
            except SparseDecodeError as error:  # which of the layers' supports it is
                raise SparseDecodeError(f"layer_supports, layer {layer}: {error}") from None
            if layer in self.dense_layers:
                raise SparseDecodeError(f"layer {layer} is in dense_layers and has a support in layer_supports")
        object.__setattr__(self, "_layers", {})  # for_layer's configurations, made once
        if not isinstance(self.reuse, int) or isinstance(self.reuse, bool):
            raise SparseDecodeError(f"reuse must be an integer, got {self.reuse!r}")
        if self.reuse < 1:
            raise SparseDecodeError(f"reuse must be >= 1, got {self.reuse}")
        object.__setattr__(self, "selector", resolve_selector(self.selector))
        if not isinstance(self.audit, bool):
            raise SparseDecodeError(f"audit must be True or False, got {self.audit!r}")
        check_seed(self.seed)
        if self.kernel not in KERNELS:
            raise SparseDecodeError(f"unknown kernel {self.kernel!r}; choose one of: {', '.join(KERNELS)}")
        if self.kernel in ("c", "triton") and not self.kernels_serve:
            raise SparseDecodeError(
                f"kernel {self.kernel!r} serves block selectors only; {self.selector_name} steps run as torch "
                "operations (token-level or adaptive budget): use kernel='auto' or 'torch'"
            )

    @property
    def token_level(self) -> bool:
        return self.selector.token_level

    def for_layer(self, layer: int) -> SparseConfig:
        """The configuration layer ``layer`` decodes with: ``support`` replaced by the layer's own in
        ``layer_supports`` (this configuration itself where it has none)."""
        own = dict(self.layer_supports).get(layer)
        if own is None or own == self.support:
            return self
        made = self._layers.get(layer)
        if made is None:
            made = self._layers[layer] = replace(self, support=own, layer_supports=())
        return made

    def supports_by_layer(self, layers: int) -> list[int | None]:
        """Each of ``layers`` layers' effective support, ``None`` for a dense layer."""
        return [
            None if layer in self.dense_layers else self.for_layer(layer).effective_support for layer in range(layers)
        ]

    @property
    def kernels_serve(self) -> bool:
        """Whether the C and Triton kernels can run this selector's step: a block selector with a fixed budget
        (token-level selectors and adaptive budgets gather by position in torch). A block selector with a support
        per query head is scored in torch and attended by the kernel once per member of a KV group."""
        return not (self.token_level or self.selector.adaptive)

    @property
    def selector_name(self) -> str:
        """The selector's spec string (name and changed parameters), as rows store it."""
        return self.selector.spec()

    @property
    def blocks(self) -> int:
        """Number of distant blocks kept, b (0 for token-level selectors)."""
        return 0 if self.token_level else budget_blocks(self.support, self.window, self.block_size)

    @property
    def distant_positions(self) -> int:
        """Distant positions kept per KV head: ``b * B`` for block selectors, ``S - 1 - W`` for token ones."""
        return self.support - 1 - self.window if self.token_level else self.blocks * self.block_size

    @property
    def effective_support(self) -> int:
        """Positions actually read when the context is longer than the support (``1 + W + b*B`` for blocks)."""
        return self.support if self.token_level else 1 + self.window + self.blocks * self.block_size

    def identity(self) -> tuple:
        """What this configuration is, for keying caches: the fields, the selector as its
        :meth:`~sparsedecode.selectors.base.Selector.identity` (two selectors that print alike differ here)."""
        return tuple(
            (f.name, self.selector.identity() if f.name == "selector" else getattr(self, f.name)) for f in fields(self)
        )

    def to_dict(self) -> dict:
        """Plain JSON: the fields (the selector as its spec string), its parameters (and a file's sha256), ``b`` and
        the effective support."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            **plain,
            **self.selector.record(),
            "blocks": self.blocks,
            "effective_support": self.effective_support,
        }

    @classmethod
    def from_dict(cls, settings: dict) -> SparseConfig:
        """The configuration :meth:`to_dict` wrote (a result's ``settings``, read back from JSON): its fields, the
        selector from its spec string; what follows from them (the selector's parameters and file digest, ``blocks``,
        the effective support) is left out. An unknown key is named in one line."""
        if not isinstance(settings, dict):
            raise SparseDecodeError(f"SparseConfig.from_dict takes a dict, got {type(settings).__name__}")
        derived = ("selector_params", "selector_sha256", "blocks", "effective_support")
        return config_from_overrides({key: value for key, value in settings.items() if key not in derived})


def check_config(config: object, where: str) -> None:
    """``config`` is a :class:`SparseConfig` (not a dict of its fields, not ``None``)."""
    if not isinstance(config, SparseConfig):
        hint = (
            "; build one with SparseConfig(**settings) (or SparseConfig.from_dict, from a result's recorded settings)"
            if isinstance(config, dict)
            else ""
        )
        name = "None" if config is None else type(config).__name__
        raise SparseDecodeError(f"{where}: config must be a SparseConfig, got {name}{hint}")


def _digits(text: str) -> bool:
    """Whether ``text`` is a decimal number ``int()`` reads: ASCII digits (``"²".isdigit()`` is true too)."""
    return text.isascii() and text.isdigit()


def parse_layers(layers) -> tuple[int, ...]:
    """Layer indices as a sorted tuple of distinct non-negative integers, from a sequence of integers or a text
    ``"0,1"`` (an empty text or sequence: none)."""
    if isinstance(layers, (bytes, bytearray)):  # iterated, bytes are their byte values: b"0" would be layer 48
        raise SparseDecodeError(f"dense_layers: give layer indices or a text such as '0,1', got {layers!r}")
    if isinstance(layers, str):
        items = [item.strip() for item in layers.split(",") if item.strip()]
        if not all(_digits(item) for item in items):
            raise SparseDecodeError(f"dense_layers is a comma-separated list of layer indices, got {layers!r}")
        layers = [int(item) for item in items]
    try:
        values = list(layers)
    except TypeError:
        raise SparseDecodeError(f"dense_layers is a list of layer indices, got {layers!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise SparseDecodeError(f"dense_layers holds layer indices (integers >= 0), got {layers!r}")
    if len(set(values)) != len(values):
        raise SparseDecodeError(f"dense_layers names a layer twice: {layers!r}")
    return tuple(sorted(values))


def check_named_layers(config: SparseConfig, modules) -> None:
    """Every layer ``config.dense_layers`` and ``config.layer_supports`` name is one of the model's attention
    ``modules`` (numbered by their ``layer_idx``)."""
    check_layer_indices(config, 1 + max((int(module.layer_idx) for module in modules), default=-1))


def check_layer_indices(config: SparseConfig, layers: int) -> None:
    """Every layer ``config.dense_layers`` and ``config.layer_supports`` name is below ``layers``."""
    for field, named in (("dense_layers", config.dense_layers), ("layer_supports", dict(config.layer_supports))):
        outside = [layer for layer in named if layer >= layers]
        if outside:
            raise SparseDecodeError(
                f"{field} names layer{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))}; the model "
                f"has {layers} attention layers (0 to {layers - 1})"
            )


def parse_layer_supports(supports) -> tuple[tuple[int, int], ...]:
    """Per-layer supports as sorted ``(layer, support)`` pairs, from a mapping ``{layer: support}`` (keys may be
    digit strings, as JSON writes them), a sequence of pairs, or a text ``"2:385,3:385"``."""
    if isinstance(supports, str):
        pairs = []
        for item in (item.strip() for item in supports.split(",") if item.strip()):
            layer, colon, support = item.partition(":")
            if not colon or not _digits(layer.strip()) or not _digits(support.strip()):
                raise SparseDecodeError(f"layer_supports is LAYER:SUPPORT,... (for example 2:385,3:385), got {item!r}")
            pairs.append((int(layer), int(support)))
    elif isinstance(supports, dict):
        pairs = list(supports.items())
    else:
        try:
            pairs = [tuple(pair) if not isinstance(pair, (str, bytes)) else (pair,) for pair in supports]
        except TypeError:  # a string '12' is no pair: read as ('1', '2') it named layer 1 with support '2'
            raise SparseDecodeError(f"layer_supports maps layers to supports, got {supports!r}") from None
    checked = []
    for pair in pairs:
        if len(pair) != 2:
            raise SparseDecodeError(f"layer_supports holds (layer, support) pairs, got {pair!r}")
        layer, support = pair
        layer = int(layer) if isinstance(layer, str) and _digits(layer) else layer
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise SparseDecodeError(f"layer_supports: a layer is an integer >= 0, got {layer!r}")
        checked.append((layer, support))
    if len({layer for layer, _ in checked}) != len(checked):
        raise SparseDecodeError(f"layer_supports names a layer twice: {supports!r}")
    return tuple(sorted(checked))


BUDGET_FIELDS = ("dense_layers", "layer_supports", "reuse", "selector", "window", "block_size", "layers")
"""What a budget file (``--budget FILE``) holds: the per-layer part of a configuration (``dense_layers``,
``layer_supports``) and, where a calibration chose them, the reuse interval ``reuse`` and the ``selector`` (a spec
string, its parameters included); what its supports are for: the ``window`` and ``block_size`` (a support is
``1 + W + b*B``) and the model's attention ``layers`` (every one named: a model of another count is refused)."""


def read_budget(path) -> dict:
    """A budget file's configuration fields (:data:`BUDGET_FIELDS` but ``layers``, which
    :func:`read_budget_file` gives too): ``{"dense_layers": [0, 1], "layer_supports": {"5": 385}, "reuse": 2,
    "selector": "block-top-p:p=0.9", "window": 64, "block_size": 16}``, each checked as :class:`SparseConfig` checks
    it, so ``SparseConfig(**read_budget(path))`` is the configuration it names. ``dense_layers`` and
    ``layer_supports`` are always in the result; the others only where the file holds them (``selector`` as its
    canonical spec string)."""
    fields_ = read_budget_file(path)
    fields_.pop("layers", None)
    return fields_


def read_budget_file(path) -> dict:
    """Every field of a budget file, checked: :func:`read_budget`'s and, where the file says it, ``layers``, the
    number of attention layers it was made for."""
    import json
    from pathlib import Path

    if Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():  # /dev/zero, a pipe: read forever
        raise SparseDecodeError(f"budget file {path} is not a regular file: give the JSON file calibrate wrote")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SparseDecodeError(f"budget file {path}: no such file") from None
    except OSError as error:
        raise SparseDecodeError(f"budget file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise SparseDecodeError(f"budget file {path}: not UTF-8 text (a budget file is JSON)") from None
    try:
        data = json.loads(text)
    except ValueError as error:
        raise SparseDecodeError(f"budget file {path} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise SparseDecodeError(f"budget file {path} must hold a JSON object of {', '.join(BUDGET_FIELDS)}")
    unknown = sorted(set(data) - set(BUDGET_FIELDS))
    if unknown:
        raise SparseDecodeError(
            f"budget file {path}: unknown field(s) {', '.join(unknown)}; it holds {', '.join(BUDGET_FIELDS)}"
        )
    fields_ = {"dense_layers": parse_layers(data.get("dense_layers", ())),
               "layer_supports": parse_layer_supports(data.get("layer_supports", ()))}  # fmt: skip
    if "reuse" in data:
        reuse = data["reuse"]
        if not isinstance(reuse, int) or isinstance(reuse, bool) or reuse < 1:
            raise SparseDecodeError(f"budget file {path}: reuse is an integer R >= 1, got {reuse!r}")
        fields_["reuse"] = reuse
    if "selector" in data:
        if not isinstance(data["selector"], str):
            raise SparseDecodeError(f"budget file {path}: selector is a spec string, got {data['selector']!r}")
        fields_["selector"] = resolve_selector(data["selector"]).spec()
    for name in ("window", "block_size", "layers"):
        if name in data:
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SparseDecodeError(f"budget file {path}: {name} is an integer >= 1, got {value!r}")
            fields_[name] = value
    named = [*fields_["dense_layers"], *(layer for layer, _ in fields_["layer_supports"])]
    if "layers" in fields_ and any(layer >= fields_["layers"] for layer in named):
        raise SparseDecodeError(f"budget file {path} names layers past its own {fields_['layers']} layers")
    return fields_


def config_from_overrides(overrides: dict) -> SparseConfig:
    """``SparseConfig(**overrides)``, with an unknown field named in one line instead of a ``TypeError``."""
    fields_ = SparseConfig.__dataclass_fields__
    unknown = sorted(set(overrides) - set(fields_))
    if unknown:
        raise SparseDecodeError(
            f"unknown SparseConfig field(s) {', '.join(unknown)}; choose among: {', '.join(fields_)}"
        )
    return SparseConfig(**overrides)
