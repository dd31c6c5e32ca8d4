"""How much memory the machine can still give: asked before allocating what may not fit (benchmarks' layers and
batches, a frozen compiled step's copy of the weights)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Memory that can still be allocated on ``device`` now: ``MemAvailable`` (Linux), else the free physical pages;
    the free memory of a CUDA device. ``None`` where it cannot be told."""
    if device != "cpu":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
