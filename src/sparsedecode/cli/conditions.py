"""The conditions numbers were measured under (model, dtype, threads, corpus, the run's settings, how sparse steps run
here), as printed above a command's tables and written into its result files."""

from __future__ import annotations

from .display import plain
from .parser import layer_budget

__all__ = ["conditions", "environment", "plain_layers", "run_settings"]


def environment(model=None) -> dict:
    """Where numbers were measured: library versions, device, threads (with ``model``: where its weights lie)."""
    from ..experiments.environment import environment as measured_environment

    return measured_environment(model)


def plain_layers(value):
    """A per-layer setting as JSON holds it: a list of layers, or ``{layer: support}`` with text keys."""
    return {str(layer): support for layer, support in value} if value and isinstance(value[0], tuple) else list(value)


def run_settings(args, command: str, *, machine: bool = True) -> dict:
    """The settings a result file of ``command`` records beside its rows, the machine's environment included (unless
    not ``machine``: no torch imported, for comparing settings before any work)."""
    keys = ("model", "dtype", "corpus", "window", "block_size", "reuse", "selector", "tokens", "prompt_index")
    return {
        "command": command,
        **{key: getattr(args, key) for key in keys},
        **({"weights": args.weights} if getattr(args, "weights", None) else {}),
        **({"weights_loaded": args.weights_loaded} if getattr(args, "weights_loaded", None) else {}),
        "contexts": args.context,
        "supports": args.support,
        **{name: plain_layers(value) for name, value in layer_budget(args).items() if value},
        **({"environment": environment()} if machine else {}),
    }


def _kernel_in_use(dtype: str, selector: str, shape: tuple[int, int, int, int] | None = None) -> str:
    """How sparse steps run here under ``SparseConfig.kernel="auto"`` on the CPU, as the kernel dispatch decides it
    (:func:`sparsedecode.kernels.refusals` on tensors of the run's dtype and the model's head shape
    ``(query_heads, kv_heads, d, dv)``)."""
    import torch

    from .. import kernels
    from ..layout import BlockLayout
    from ..selectors import resolve_selector

    method = resolve_selector(selector)
    if method.token_level:
        return "sparse steps: torch operations (token-level selector)"
    if method.adaptive:
        return "sparse steps: torch operations (adaptive budget)"
    query_heads, kv_heads, d, dv = shape or (2, 1, 16, 16)
    kind = getattr(torch, dtype)
    q = torch.zeros(query_heads, d, dtype=kind)
    keys, values = torch.zeros(kv_heads, 128, d, dtype=kind), torch.zeros(kv_heads, 128, dv, dtype=kind)
    reason = kernels.refusals(q, keys, values, BlockLayout(n=128, window=64, block_size=16))["c"]
    if reason is not None:
        return f"sparse steps: torch operations (the C kernel cannot serve: {reason})"
    if method.kernel_scoring != "mean-dot":
        return "sparse steps: torch selection, C kernel attention"
    return "sparse steps: C kernel"


def _weights(args) -> str:
    """``, weights W`` where ``--weights`` chose quantized ones, else nothing."""
    weights = getattr(args, "weights", None)
    return f", weights {weights}" if weights not in (None, args.dtype) else ""


def conditions(args) -> str:
    """One line (rich markup) of the conditions a command's numbers are measured under, printed above its tables."""
    import torch

    return (
        f"[bold]{plain(args.model)}[/] {args.dtype}{_weights(args)} on cpu, {torch.get_num_threads()} threads; corpus "
        f"{plain(args.corpus)}, "
        f"prompt {args.prompt_index}; T = {args.tokens}; W = {args.window}, B = {args.block_size}, "
        f"R = {args.reuse}, selector {plain(args.selector)}; {_kernel_in_use(args.dtype, args.selector)}"
    )
