"""Where modules moved when the package was folded into folders by layer: an old import path keeps working (with a
``DeprecationWarning`` naming the new one), so code holding ``sparsedecode.speculative.generate`` or
``sparsedecode.paired.compare`` still runs. The public names themselves live on ``sparsedecode`` (``sd.generate``,
``sd.compare``, ...) and did not move. Nothing in the package imports an old path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "sparsedecode.attention": "sparsedecode.session",
    "sparsedecode.attention.attend": "sparsedecode.kernels.reference",
    "sparsedecode.attention.forward": "sparsedecode.session.forward",
    "sparsedecode.attention.hf": "sparsedecode.session.hf",
    "sparsedecode.attention.prepared": "sparsedecode.compiled.prepared",
    "sparsedecode.attention.session": "sparsedecode.session.session",
    "sparsedecode.attention.state": "sparsedecode.session.state",
    "sparsedecode.attention.static": "sparsedecode.compiled.op",
    "sparsedecode.attention.static_device": "sparsedecode.step.device",
    "sparsedecode.attention.step": "sparsedecode.session.rows",
    "sparsedecode.cache": "sparsedecode.session.kv_cache",
    "sparsedecode.centroids": "sparsedecode.selectors.statistics",
    "sparsedecode.compile_cpu": "sparsedecode.compiled.cpu",
    "sparsedecode.compile_guards": "sparsedecode.compiled.guards",
    "sparsedecode.decode": "sparsedecode.decoding.loop",
    "sparsedecode.diagnostics": "sparsedecode.protocol.diagnostics",
    "sparsedecode.eval_report": "sparsedecode.reports.evaluation",
    "sparsedecode.kernels.cpu_batch": "sparsedecode.kernels.cpu.batch",
    "sparsedecode.kernels.triton_attention": "sparsedecode.kernels.triton.attention",
    "sparsedecode.lm_eval_model": "sparsedecode.integrations.lm_eval",
    "sparsedecode.lossless": "sparsedecode.decoding.lossless",
    "sparsedecode.model_cache": "sparsedecode.models.store",
    "sparsedecode.paired": "sparsedecode.protocol.paired",
    "sparsedecode.plots": "sparsedecode.reports.plots",
    "sparsedecode.report": "sparsedecode.reports.sweep",
    "sparsedecode.results": "sparsedecode.protocol.results",
    "sparsedecode.selectors.builtin": "sparsedecode.selectors.methods",
    "sparsedecode.speculative": "sparsedecode.decoding.generate",
    **{
        f"sparsedecode.selectors.{name}": f"sparsedecode.selectors.methods.{name}"
        for name in (
            "h2o",
            "mean_pooled",
            "oracle",
            "quest",
            "random_blocks",
            "sink_streaming",
            "sparq",
            "streaming",
            "top_p",
        )  # fmt: skip
    },
}
"""Old module path -> where it lives now. ``sparsedecode.compiled`` and ``sparsedecode.models`` became packages that
still give their public names (``CompiledDecoder``, ``load_model``, ...)."""


class _Alias(importlib.abc.Loader):
    """Hands back the module at the new path; for an old package whose children moved elsewhere
    (``sparsedecode.attention``), a module of the old name that finds its old children here and everything else on
    the new package, so ``from sparsedecode.attention import static`` still works."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec):
        target = importlib.import_module(self.new)
        if not any(name.startswith(self.old + ".") for name in MOVED):
            return target
        proxy = types.ModuleType(self.old, target.__doc__)
        proxy.__path__ = []  # a package: its old children are found by _MovedFinder

        def attribute(name: str):
            if f"{self.old}.{name}" in MOVED:
                return importlib.import_module(f"{self.old}.{name}")
            return getattr(target, name)

        proxy.__getattr__ = attribute
        return proxy

    def exec_module(self, module) -> None:
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path of :data:`MOVED` and hands back the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}", DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, new))


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())  # before the path finders: a stale folder of an old name (left by an
    # earlier checkout, holding only bytecode) would otherwise import as an empty namespace package
