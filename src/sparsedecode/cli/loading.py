"""Loading the model a command runs on and cutting its prompts, after the checks that need neither (the whole-blocks
rule, the corpus, the model cache), so bad input is refused before any time goes into loading."""

from __future__ import annotations

from ..errors import SparseDecodeError
from .display import console
from .outputs import check_writable_folder
from .parser import layer_budget

__all__ = [
    "check_model_cache",
    "check_prompt_source",
    "check_whole_blocks",
    "load",
    "prepare",
    "quiet_transformers",
]


def _configs(args, audit: bool = False) -> list:
    """One :class:`SparseConfig` per ``--support``, each checked to be whole blocks."""
    from ..config import SparseConfig

    configs = [
        SparseConfig(
            support=s,
            window=args.window,
            block_size=args.block_size,
            reuse=args.reuse,
            selector=args.selector,
            audit=audit,
            **layer_budget(args),
        )
        for s in args.support
    ]
    check_whole_blocks(configs)
    check_one_support_per_budget(args)
    return configs


def check_one_support_per_budget(args) -> None:
    """A budget file giving every one of its ``layers`` a support (or dense) leaves ``--support`` nothing to set:
    several would be the same configuration under several labels (in every command taking both)."""
    if getattr(args, "budget_file", None) is None or len(args.support) < 2:
        return
    from ..config import read_budget_file

    budget = read_budget_file(args.budget_file)
    named = {*budget["dense_layers"], *(layer for layer, _ in budget["layer_supports"])}
    if "layers" in budget and named == set(range(budget["layers"])):
        raise SparseDecodeError(
            f"budget file {args.budget_file} sets every layer's support, so --support "
            f"{','.join(map(str, args.support))} would run one configuration under {len(args.support)} labels: give "
            "one --support"
        )


def check_whole_blocks(configs) -> None:
    """Refuse a support that a block selector would floor to whole blocks, naming the two nearest that are not.

    The library floors ``support`` to ``1 + W + b*B`` (:attr:`SparseConfig.effective_support`); the command line
    refuses instead, so the support asked for is the support in every table and JSON file.
    """
    for cfg in configs:
        layers = [(f"layer {layer}'s support", cfg.for_layer(layer)) for layer, _ in cfg.layer_supports]
        for what, asked in [("--support", cfg), *layers]:
            floored = asked.effective_support
            if not cfg.token_level and floored != asked.support:
                raise SparseDecodeError(
                    f"{what} {asked.support} is not 1 + W + b*B with W = {cfg.window}, B = {cfg.block_size} "
                    f"(block selectors read whole blocks): use {floored} or {floored + cfg.block_size}"
                )


def load(args):
    """``(model, tokenizer)`` of ``--model``, after checking that the model cache can take it if it must."""
    from ..models.catalog import load_model

    quiet_transformers()
    check_model_cache(args.model)
    from ..validate import check_sparse_attention

    weights = getattr(args, "weights", None)
    with console.status(f"loading {args.model} ({weights or args.dtype})"):
        model, tokenizer = load_model(args.model, dtype=args.dtype, weights=weights)
    check_sparse_attention(model, args.model)
    _check_budget_layers(args, model)
    _check_named_layers(args, model)
    if weights is not None:  # what ran, for the settings a result records: float weights set the dtype too
        from ..models.weights import FLOAT_WEIGHTS, weights_label

        args.dtype = weights if weights in FLOAT_WEIGHTS else args.dtype
        args.weights_loaded = weights_label(model)
    return model, tokenizer


def _check_budget_layers(args, model) -> None:
    """A budget file made for a model of another number of attention layers is refused: its layers would be other
    layers, and the model's others would read ``--support``."""
    if getattr(args, "budget_file", None) is None:
        return
    from ..config import read_budget_file
    from ..validate import attention_modules

    made_for, layers = read_budget_file(args.budget_file).get("layers"), len(attention_modules(model))
    if made_for is not None and made_for != layers:
        raise SparseDecodeError(
            f"budget file {args.budget_file} was made for a model of {made_for} attention layers; {args.model} has "
            f"{layers}"
        )


def _check_named_layers(args, model) -> None:
    """``--dense-layers`` and ``--layer-supports`` naming a layer the model lacks are refused as the model loads,
    before a prefill or a dense reference is spent (the session would refuse them only as it opens)."""
    dense, supports = getattr(args, "dense_layers", ()) or (), getattr(args, "layer_supports", ()) or ()
    if not dense and not supports:
        return
    from ..config import SparseConfig, check_named_layers
    from ..validate import attention_modules

    check_named_layers(SparseConfig(dense_layers=dense, layer_supports=supports), attention_modules(model))


def quiet_transformers() -> None:
    """Our own progress bars replace transformers' tqdm bars and info logging."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_model_cache(spec: str) -> None:
    """A built-in alias that is not converted yet is fetched into the cache: refuse a cache that takes no files."""
    from ..models.aliases import ALIASES
    from ..models.store import cache_dir, verify_converted

    source = ALIASES.get(spec)
    converted = source is not None and verify_converted(
        cache_dir() / "models" / source.alias, source.sha256, check_hashes=False
    )
    if source is not None and not converted:
        check_writable_folder(
            cache_dir(),
            f"{spec} into the model cache {cache_dir()}",
            hint="; set SPARSEDECODE_CACHE to a writable folder, or to one that already holds the model",
        )


def prepare(args, audit: bool = False):
    """Validate prompt arguments, load the model, cut the prompts: ``(configs, model, tokenizer, prompts)``."""
    if args.tokens < 2:
        raise SparseDecodeError(f"--tokens must be >= 2 (got {args.tokens}): step 1 is shared with dense")
    if any(c < 1 for c in args.context):
        raise SparseDecodeError("--context values must be >= 1")
    configs = _configs(args, audit=audit)
    check_prompt_source(args)
    model, tokenizer = load(args)
    from ..experiments.corpus import check_context_fits, prompt_ids

    check_context_fits(model, args.context, args.tokens)
    prompts = {c: prompt_ids(tokenizer, args.corpus, c, args.prompt_index, args.tokens) for c in args.context}
    return configs, model, tokenizer, prompts


def check_prompt_source(args) -> None:
    """``--prompt-index`` and ``--corpus``, before the model loads: the corpus is read once (cached), so a missing,
    empty or binary one is refused here."""
    if args.prompt_index < 0:
        raise SparseDecodeError(f"--prompt-index must be >= 0 (got {args.prompt_index})")
    from ..experiments.corpus import check_corpus

    check_corpus(args.corpus)
