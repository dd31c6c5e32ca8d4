"""Is dense greedy decoding reproducible run to run on the GPU (random bfloat16 weights)?

Run from the repository root: ``PYTHONPATH=src python3 docs/bench/gpu/1951216/dense_repeatability.py [--quick]``.
One 32704-token prefill per cache kind, then 64 greedy dense tokens three times from the same cache (cropped back
between runs); prints where the runs first differ and the top-1/top-2 logit margins at that step.
"""

import sys

import torch

sys.path.insert(0, "scripts")  # gpu_check's random model with qwen2.5-coder-0.5b's shapes
import gpu_check as g  # noqa: E402
from transformers import DynamicCache

from sparsedecode.cache import GrowingCache
from sparsedecode.paired import crop_cache, greedy_decode, prefill

ctx = 512 if g.QUICK else 32704
model = g.random_qwen_coder()
ids = torch.randint(1, 150000, (1, ctx), generator=torch.Generator().manual_seed(3)).to(g.DEVICE)
for kind in ("growing", "dynamic"):
    cache = GrowingCache(config=model.config) if kind == "growing" else DynamicCache(config=model.config)
    _, logits = prefill(model, ids, cache=cache)
    first = int(logits.argmax())
    runs, margins = [], []
    for _ in range(3):
        m = []

        def hook(step, lg, m=m):
            top = torch.topk(lg, 2).values
            m.append(float(top[0] - top[1]))

        out, _ = greedy_decode(model, cache, first, 64, on_logits=hook)
        crop_cache(cache, ctx)
        runs.append(out)
        margins.append(m)
    for r in (1, 2):
        diff = next((i for i, (a, b) in enumerate(zip(runs[0], runs[r])) if a != b), None)
        info = (
            "identical"
            if diff is None
            else f"first differs at step {diff + 1}: margins there {margins[0][diff]:.4g} / {margins[r][diff]:.4g}"
        )
        print(kind, f"run 1 vs run {r + 1}:", info, flush=True)
    print(kind, "median margin run 1:", sorted(margins[0])[32], "min:", min(margins[0]), flush=True)
