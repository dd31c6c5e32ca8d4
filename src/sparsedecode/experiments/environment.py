"""Where numbers were measured: library versions, device, threads (stored with every result file)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def source_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout this package runs from (``None`` outside a checkout)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def environment(model: torch.nn.Module | None = None) -> dict:
    """Library versions, the device the model's weights are on (``cpu`` without a model), threads, machine."""
    import numpy
    import transformers

    from .. import __version__

    device = "cpu"
    if model is not None:
        parameter = next(model.parameters(), None)
        if parameter is not None:
            device = str(parameter.device)
    return {
        "sparsedecode": __version__,
        "revision": source_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
