"""``--backend local | ray``: the options that choose where the units of work run, their checks, and the executor.

Ray is imported only by :mod:`.ray_backend`, and that only when ``--backend ray`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from ..errors import SparseDecodeError
from .display import console

__all__ = ["BACKENDS", "add_backend_args", "check_backend_args", "executor"]

BACKENDS = ("local", "ray")


def add_backend_args(parser: argparse.ArgumentParser, *, unit: str) -> None:
    """``--backend``, ``--address``, ``--workers``, ``--worker-threads``; ``unit`` names what one work unit is."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="local",
        help=f"local: run here; ray: each {unit} is a unit of work on a Ray cluster's workers, rows written here",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --backend ray: the cluster to join (HOST:PORT, or auto); default: a Ray instance for this command",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --backend ray: worker processes, each loading the model once (default: as many as the CPUs hold)",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="with --backend ray: torch threads (and CPUs reserved) per worker (default 1, or the most that fit)",
    )


def check_backend_args(args) -> None:
    """Refuse Ray options without ``--backend ray``, counts below 1, ``--backend ray`` without Ray installed (checked
    without importing it) and an ``--address`` nothing answers on, before any model is loaded."""
    options = {"--address": args.address, "--workers": args.workers, "--worker-threads": args.worker_threads}
    if args.backend != "ray":
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise SparseDecodeError(f"{', '.join(given)} applies to --backend ray only")
        return
    for flag in ("--workers", "--worker-threads"):
        if options[flag] is not None and options[flag] < 1:
            raise SparseDecodeError(f"{flag} must be >= 1, got {options[flag]}")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise SparseDecodeError(
            "--backend ray needs Ray, which is not installed: pip install 'sparsedecode[ray]' (or pip install ray)"
        )
    if args.address is not None:
        from .ray_backend import check_reachable

        check_reachable(args.address)


@contextlib.contextmanager
def executor(args, progress=None) -> Iterator:
    """``None`` for ``--backend local``; for ``--backend ray`` a pool of Ray workers (Ray is imported here, not
    before), shut down on the way out."""
    if args.backend != "ray":
        yield None
        return
    from .ray_backend import ray_executor

    with ray_executor(args, console=console, progress=progress) as pool:
        yield pool
