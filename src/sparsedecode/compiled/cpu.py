"""How the compiled step is built on the CPU (:mod:`sparsedecode.compiled.decoder`): a half-precision one-row step's
linear layers as row products, the weights frozen into the step, its matrix products autotuned; each choice measured
here and with an environment variable to turn it off.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .. import env
from ..memory import available_memory_bytes

ROW_PRODUCTS = env.flag("SPARSEDECODE_ROW_PRODUCTS", True)
"""On the CPU, a half-precision model's linear layers compute a one-token step as a product and a sum in float32
(:func:`row_linear`), which the compiler turns into one loop over the weight (``SPARSEDECODE_ROW_PRODUCTS=0``:
``F.linear`` as in eager). torch's bfloat16 matrix-vector product reads the weights at under half the speed of its
float32 one here; the loop reads them at the memory's speed, so half-precision weights halve the step's weight
time."""


ROW_CHUNK = env.count("SPARSEDECODE_ROW_CHUNK", 8192)
"""A row-sum linear layer with more outputs (a vocabulary projection) sums them in pieces of this many outputs: on
SmolLM2's (49,152 outputs) one piece per 8,192 made the projection 1.6x faster than one loop over all of them, and
than ``F.linear``, in the compiled step here (inductor fuses the whole projection with the norm before it)."""


FREEZE = env.flag("SPARSEDECODE_FREEZE", True)
"""On the CPU, inductor compiles the step with the weights frozen into it (``torch._inductor.config.freezing``):
constants it packs once for oneDNN or MKL, the linear layers that share an input (queries, keys and values; gate
and up) concatenated into one (``cpp.enable_concat_linear``). SmolLM2, sparse S = 193, two threads: bfloat16 batch
8 at 8K 46.5 -> 42.8 ms a step frozen, and 34.0 -> 31.9 concatenated (with the kernel on torch's threads); float32
at 4K batch 8 60 -> 46 ms, batch 1 30 -> 27 ms. Not where row products serve (a half-precision one-row step:
:data:`ROW_PRODUCTS`), whose float32 products freezing would fold into float32 copies of the weights. Costs:
compiling takes longer (about 25 s more on SmolLM2), and a frozen decoder keeps about twice the weights' bytes
(packed and concatenated copies; compiling peaks at about three times), so a step is compiled frozen only where the
memory available when it compiles holds four times the weights (:func:`room_to_freeze`); a change to the
weights after compiling is seen at the next install (:func:`~sparsedecode.compiled.guards.weight_versions`) and
compiles again. ``SPARSEDECODE_FREEZE=0``: weights read as inputs, as before."""
AUTOTUNE = env.flag("SPARSEDECODE_AUTOTUNE", True)
"""A frozen step of several rows also lets inductor time its own matrix-product code against torch's for each
linear layer and keep the faster (``max_autotune``, backends ``CPP,ATEN``). SmolLM2 8K batch 8, sparse S = 193, two
threads: bfloat16 on the AMX Intel Xeon 30 -> 27-28 ms a step, compiling 31 -> 53-62 s; float32 there no gain, but
on the AMD EPYC (where torch's float32 products run on MKL at 7 GB/s of weights) 98 -> 46 ms a step, compiling 48 ->
91 s. Not for one row (slower in float32 on the Intel Xeon). ``SPARSEDECODE_AUTOTUNE=0`` turns it off."""


def row_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; where ``x`` is one row (a decode step of one sequence) the sum of products in float32,
    rounded to the model's dtype once (what ``F.linear`` does for half precision, in another order)."""
    if x.shape[:-1].numel() != 1:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    row = x.float().unsqueeze(-2)
    parts = [(row * w.float()).sum(-1) for w in module.weight.split(ROW_CHUNK)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if module.bias is not None:
        out = out + module.bias.float()
    return out.to(x.dtype)


def room_to_freeze(model: torch.nn.Module) -> bool:
    """Whether the memory available now holds four times the model's weights: what freezing them keeps and what it
    needs while compiling. Measured on SmolLM2, two rows, against compiling the same step unfrozen: 513 MiB of
    float32 weights, frozen kept 817-938 MiB more and peaked 1,571 MiB above; bfloat16 (257 MiB), 500 and 631 MiB.
    Up to ``KEPT`` decoders per model keep theirs; one evicted frees its copies. Asked when a decoder is made and
    again when its step compiles (decoders made together compile one after another). Unknown memory counts as room."""
    available = available_memory_bytes()
    return available is None or available >= 4 * sum(p.nelement() * p.element_size() for p in model.parameters())


def uses_row_products(model: torch.nn.Module, device: torch.device) -> bool:
    dtype = next(model.parameters()).dtype
    return ROW_PRODUCTS and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def choices(model: torch.nn.Module, device: torch.device, backend: str, batch: int, row_products: bool):
    """``(frozen, autotuned)`` for a step of ``batch`` rows compiled with ``backend`` (see :data:`FREEZE`,
    :data:`AUTOTUNE`)."""
    frozen = backend == "inductor" and device.type == "cpu" and FREEZE
    frozen = frozen and not (row_products and batch == 1) and room_to_freeze(model)
    from ..models.quantized import is_quantized

    frozen = frozen and not is_quantized(model)  # freezing would fold the de-quantization into float constants
    return frozen, frozen and AUTOTUNE and batch > 1


def inductor_settings(autotuned: bool, *, quiet: bool):
    """inductor's settings for a frozen step (``autotuned``: its matrix products timed); ``quiet`` (compiling):
    torch's own deprecation warning that autotuning raises is not shown."""
    from torch._inductor import config

    settings = {"freezing": True, "cpp.enable_concat_linear": True}
    if not autotuned:
        return config.patch(settings)
    # nothing on stderr for each linear layer: no timings, no choices' statistics, not torch's own warning
    settings.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", autotune_num_choices_displayed=0)
    if hasattr(config, "max_autotune_report_choices_stats"):
        settings["max_autotune_report_choices_stats"] = False
    if not quiet:  # every step after the first: the settings alone, no warnings filter entered and left
        return config.patch(settings)
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    stack.enter_context(config.patch(settings))
    return stack
