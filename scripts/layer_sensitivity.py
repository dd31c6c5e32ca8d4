"""How a model's teacher-forced match depends on which layers read a small support: groups of consecutive layers
lowered from a uniform support that meets a target, and raised from one that misses it, each against its dense
references on the same prompts (the paired protocol, docs/definitions.md section 3).

    PYTHONPATH=src OMP_NUM_THREADS=1 python3 scripts/layer_sensitivity.py --model smollm2-135m --context 2048 \
        --prompts 8 --tokens 64 --high 385 --low 97 --group 5 > sensitivity.md

Prints a Markdown table: the configuration, the mean teacher-forced match over the prompts (percent), each prompt's,
and the mean change of perplexity. Where per-layer budgets can save positions is where lowering a group costs little
and raising one gains much; a model whose groups all cost about alike gains little from budgets by layer beyond what
the grid of uniform supports leaves between its steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparsedecode.config import SparseConfig
from sparsedecode.experiments.corpus import prompt_ids
from sparsedecode.models.catalog import load_model
from sparsedecode.protocol.paired import compare, dense_reference
from sparsedecode.validate import attention_modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--high", type=int, default=385, help="the uniform support groups are lowered from")
    parser.add_argument("--low", type=int, default=97, help="the support a lowered group reads")
    parser.add_argument("--group", type=int, default=5, help="consecutive layers per group")
    parser.add_argument("--selector", default="mean-pooled")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    layers = len(attention_modules(model))
    prompts = [prompt_ids(tokenizer, args.corpus, args.context, i, args.tokens) for i in range(args.prompts)]
    references = [dense_reference(model, ids, tokens=args.tokens) for ids in prompts]
    groups = [list(range(start, min(start + args.group, layers))) for start in range(0, layers, args.group)]
    configs = {f"uniform {args.high}": SparseConfig(support=args.high, selector=args.selector),
               f"uniform {args.low}": SparseConfig(support=args.low, selector=args.selector)}  # fmt: skip
    for group in groups:
        lowered = tuple((layer, args.low) for layer in group)
        configs[f"{args.high}, layers {group[0]}-{group[-1]} at {args.low}"] = SparseConfig(
            support=args.high, selector=args.selector, layer_supports=lowered
        )
    for group in groups:
        raised = tuple((layer, args.high) for layer in group)
        configs[f"{args.low}, layers {group[0]}-{group[-1]} at {args.high}"] = SparseConfig(
            support=args.low, selector=args.selector, layer_supports=raised
        )
    print(f"{args.model}, context {args.context}, {args.prompts} prompts of {args.corpus}, {args.tokens} tokens, "
          f"{args.selector}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")  # fmt: skip
    print("| configuration | TF match % | per prompt | dPPL % |\n| --- | ---: | --- | ---: |")
    for name, cfg in configs.items():
        results = [compare(model, None, ids, cfg, args.tokens, reference=ref) for ids, ref in zip(prompts, references)]
        match = [r.teacher_forced_match for r in results]
        dppl = statistics.mean(r.delta_ppl_percent for r in results)
        print(f"| {name} | {statistics.mean(match):.2f} | {', '.join(f'{m:.1f}' for m in match)} | {dppl:+.2f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
