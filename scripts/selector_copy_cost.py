"""What the copies a user's selector is handed cost (``sparsedecode.selectors.select._call``): one selection call.

    OMP_NUM_THREADS=1 python scripts/selector_copy_cost.py [turns]

docs/selectors.md's ``MaxKeyBlocks`` (it reads every key) imported from a file, on SmolLM2's shape (9 query / 3 KV
heads, d = 64) at N = 8192, S = 193, calls cycling through 30 layers' keys (as a decode step walks the layers):
``choose_blocks`` as shipped (the selector is handed copies of the queries and keys) against the same class handed
the tensors themselves (``select.trusted`` patched to say it is the library's), in alternating 1-second timings of
one process (medians of repeated calls, then the median over the turns).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from sparsedecode.config import SparseConfig
from sparsedecode.experiments.bench import median_time
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import select
from sparsedecode.selectors.statistics import BlockStatistics

SELECTOR = """
from dataclasses import dataclass

import torch

import sparsedecode
from sparsedecode.selectors import group_mean_queries


@dataclass(frozen=True)
class MaxKeyBlocks(sparsedecode.BlockSelector):
    temperature: float = 1.0

    def score_blocks(self, queries, keys, layout):
        q = group_mean_queries(queries, keys.shape[0])
        logits = torch.einsum("hd,hnd->hn", q, keys.float())[:, 1 : layout.distant_end] / self.temperature
        pad = layout.n_blocks * layout.block_size - logits.shape[1]
        padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        return padded.view(keys.shape[0], layout.n_blocks, -1).amax(dim=-1)
"""


def main(turns: int = 8) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "my_selectors.py"
        path.write_text(SELECTOR)
        cfg = SparseConfig(support=193, selector=f"{path}:MaxKeyBlocks")
    generator = torch.Generator().manual_seed(0)
    layers = [
        (torch.randn(9, 64, generator=generator), torch.randn(3, 8192, 64, generator=generator)) for _ in range(30)
    ]
    layout = BlockLayout(n=8192, window=64, block_size=16, scale=64**-0.5)
    turn = iter(range(10**9))

    def one_call():
        queries, keys = layers[next(turn) % len(layers)]
        return select.choose_blocks(cfg.selector, cfg.blocks, BlockStatistics(16, ("mean",)), queries, keys, layout)

    shipped, times = select.trusted, {"handed copies": [], "handed the tensors": []}
    try:
        for _ in range(turns):
            for mode in times:
                select.trusted = shipped if mode == "handed copies" else (lambda selector, method: True)
                times[mode].append(median_time(one_call, budget_s=1.0) * 1e3)
    finally:
        select.trusted = shipped
    print(f"one selection, N = 8192, 3 KV heads, d = 64, 30 layers cycled, {torch.get_num_threads()} thread(s):")
    for mode, ms in times.items():
        print(f"  {mode}: {statistics.median(ms):.3f} ms (turns: {', '.join(f'{t:.3f}' for t in ms)})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
