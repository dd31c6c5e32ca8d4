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


CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "bf16", "i8mm")  # fmt: skip
"""The CPU features that decide how fast the kernels, torch's products and llama.cpp's builds run (and which
llama.cpp builds run at all): the x86 vector extensions, AMX, and Arm's."""


def cpu_record(cpuinfo: str | None = None) -> dict:
    """``cpu_model`` (the model name), ``cpu_id`` (vendor, family, model and stepping: a virtual machine's model name
    often hides the generation, "AMD EPYC" for Zen 2 to Zen 4, these numbers do not) and ``cpu_flags`` (those of
    :data:`CPU_FLAGS` it has), from ``/proc/cpuinfo`` (Linux; ``cpuinfo`` its text), else ``None`` for each."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"cpu_model": None, "cpu_id": None, "cpu_flags": None}
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    model = fields.get("model name") or fields.get("Model") or fields.get("Hardware")
    present = set((fields.get("flags") or fields.get("Features") or "").split())
    keys = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
    parts = [fields.get("vendor_id"), *(f"{name} {fields[key]}" for name, key in keys if fields.get(key))]
    identity = " ".join(filter(None, parts)) if fields.get("cpu family") else None  # x86 only: Arm has no family
    return {"cpu_model": model, "cpu_id": identity, "cpu_flags": [flag for flag in CPU_FLAGS if flag in present]}


def cpu_cores(cpus=None, root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """How many distinct cores the CPUs this process may run on (``cpus``, default its affinity) sit on, by Linux's
    topology (package and core id): two threads of one core count once, so a "2-CPU" machine whose CPUs are one
    core's two threads shows 1. A virtual machine reports its guest view. ``None`` where the topology is not
    readable."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 0)
    cores = set()
    for cpu in cpus:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            return None
    return len(cores) or None


def environment(model: torch.nn.Module | None = None) -> dict:
    """Library versions, the device the model's weights are on (``cpu`` without a model), threads, machine; the
    kernel's transparent huge page mode and whether the model's weights lie in one buffer on them
    (:mod:`sparsedecode.models.arena`)."""
    import numpy
    import transformers

    from .. import __version__
    from ..models.arena import transparent_huge_pages

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
        "cpu_cores": cpu_cores(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        **cpu_record(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transparent_huge_pages": transparent_huge_pages(),
        "weights_gathered": bool(getattr(model, "sparsedecode_gathered", 0)),
    }
