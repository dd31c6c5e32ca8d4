"""Cheaper guards for the compiled decode step: dynamo's checks on the model's modules once per install, not per step.

Before each call of a compiled function dynamo checks every guard it recorded while tracing. For a decoder those
are thousands (SmolLM2: every module's class, hooks, attributes and constants, besides the tensors), about 1.3 ms
of a 21 ms step at 8K here. :func:`drop_module_guards` keeps every tensor guard (parameters, buffers, the cache and
the sparse state: dtype, device, shape, strides), every guard that reads no module, and the guards on hooks, and drops
the guards reached through the modules' Python attributes; :func:`model_fingerprint` records those attributes in
one value (plain values as they are, other objects by identity: one changed in place is not seen), which
:class:`~sparsedecode.compiled.decoder.CompiledDecoder` compares at each install and recompiles on any difference. So a
model changed between two installs (a module replaced, a hook added, ``train()``, a config value) still gets a step
compiled for it; a change inside an install, between two steps, is not seen (the library's loops make none).
Where the step was compiled with the weights frozen into it, :func:`weight_versions` is compared at each install as
well.
"""

from __future__ import annotations

import torch

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks")
_TORCH_OWN = {"_parameters", "_buffers", "_modules", *_HOOKS}  # fingerprinted apart (names, hooks)
_SCALARS = (bool, int, float, str, type(None))


def drop_module_guards(entries) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep a guard unless it reads a module's Python attributes. A guard on a
    hook (what a module's hook dict holds: a hook object's attributes, a function's closure) is on what is not a module:
    kept, so a steering hook whose strength changes between two installs gets a step compiled again."""
    on_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)  # False: the guard reads a module
    return [
        keep or entry.guard_type == "TENSOR_MATCH" or "_hooks[" in entry.name
        for entry, keep in zip(entries, on_modules)
    ]


def _value(value):
    """A plain value by its text, a config by its attributes, any other object by its identity."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return repr(value)
    if isinstance(value, dict) and all(isinstance(v, _SCALARS) for v in (*value, *value.values())):
        return repr(value)
    if type(value).__name__.endswith("Config") and hasattr(value, "to_dict"):  # a nested transformers config
        return _attributes(value)
    return id(value)


class _Same:
    """An object compared by identity and held, so that no later object takes its id while a fingerprint names it (a
    hook removed and another registered in its place: a count, or an id, could not tell them apart)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _attributes(obj) -> tuple:
    return tuple((name, _value(value)) for name, value in sorted(vars(obj).items()) if name not in _TORCH_OWN)


def model_fingerprint(model: torch.nn.Module) -> tuple:
    """What the dropped guards read: per module its name, class (and the class's ``forward``), training flag, hooks
    (each by identity), own attributes (plain values, other objects' identities: an instance ``forward``, a state,
    the config) and the names of its parameters, buffers and children; the config's attributes."""
    parts = [_attributes(model.config)]
    for name, module in model.named_modules():
        cls = type(module)
        hooks = tuple(tuple(map(_Same, getattr(module, hook, {}).values())) for hook in _HOOKS)
        children = (tuple(module._parameters), tuple(module._buffers), tuple(module._modules))
        parts.append((name, cls, id(cls.forward), module.training, hooks, children, _attributes(module)))
    return tuple(parts)


def weight_versions(model: torch.nn.Module) -> tuple:
    """What a step compiled with the weights frozen into it (constants, see
    :data:`sparsedecode.compiled.cpu.FREEZE`) read from them: each parameter's and buffer's storage and version counter,
    which every in-place change bumps (``copy_``, ``load_state_dict``; not a write through ``.data``)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return tuple((name, t.data_ptr(), t._version) for name, t in tensors)
