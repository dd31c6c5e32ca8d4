"""``--backend ray``: the units of a sweep, an evaluation or a selector comparison (see
:mod:`sparsedecode.experiments.work`) run on a pool of Ray actors; this process alone writes their rows.

Imported only when ``--backend ray`` is chosen: nothing else in the package imports Ray.

* **Where.** ``--address`` joins a running cluster (``ray start --head`` on one machine, ``ray start --address
  HEAD:6379`` on the others). Without it a Ray instance starts for this command on this machine, listening on the
  loopback interface only, with this machine's CPUs, and stops with the command.
* **Workers.** ``--workers`` actors, each reserving ``--worker-threads`` CPUs and running torch with that many
  threads (``torch.set_num_threads`` in the actor, ``OMP_NUM_THREADS`` through its runtime environment), so the
  workers Ray places on a machine never use more threads than it has CPUs (:func:`plan`). Each actor loads the model
  once and runs unit after unit, one at a time. Decoding runs on the CPU, as with the local backend: workers ask
  for no GPU.
* **Rows.** A unit returns its rows to this process, which appends them to ``runs.jsonl``; the folder lock, the
  settings check, resuming after ``kill -9`` and ``report`` are those of the local backend. Units already complete in
  ``runs.jsonl`` are not submitted, and a partly complete one runs only its missing runs.
* **Failures.** A worker process that dies while running a unit (killed, out of memory, its machine lost) is
  replaced by a fresh actor and the unit runs again from its start: its rows were never written, so none is lost or
  repeated. After :data:`RETRIES` retries of one unit the command stops with one line naming it. An error raised by
  the unit itself (a dense reference that differs from the stored one, a model that cannot load) stops the command
  at once, as it would locally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
from collections import deque
from collections.abc import Iterable, Iterator

from ..errors import SparseDecodeError, one_line

RETRIES = 2
"""Times one unit is run again after its worker died, before the command gives up on it."""

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to ``0`` before Ray is imported, Ray takes this machine's address to be the loopback address, so the
instance a command starts for itself listens on 127.0.0.1 only."""

EXIT_ENV = "SPARSEDECODE_TEST_WORKER_EXIT"
"""For the tests, which need a worker to die at a known point: ``N`` makes every worker exit abruptly (``os._exit``,
as a kill would) right after the first row of the ``N``-th unit it runs; ``N:FILE`` makes only the first worker to
get there exit, the one that creates ``FILE``. Forwarded to the workers when set here."""


def plan(cpus: list[int], workers: int | None, threads: int | None) -> tuple[int, int]:
    """``(workers, threads)`` for nodes with ``cpus`` CPUs each: every worker reserves ``threads`` CPUs on one node
    and runs that many torch threads, so the workers on a node never use more threads than it has CPUs.

    By default one thread per worker and as many workers as the CPUs hold; ``workers`` alone gets the most threads
    per worker that still place every worker; ``threads`` alone as many workers as fit.
    """
    if not any(c >= 1 for c in cpus):
        raise SparseDecodeError("the Ray cluster has no CPUs to run workers on")
    if threads is None:
        fits = [t for t in range(1, max(cpus) + 1) if sum(c // t for c in cpus) >= (workers or 1)]
        if not fits:
            raise SparseDecodeError(
                f"--workers {workers} do not fit the Ray cluster: its nodes have {_cpus(cpus)}, one per worker at least"
            )
        threads = max(fits) if workers is not None else 1
    room = sum(c // threads for c in cpus)
    if workers is None:
        workers = room
    if room < max(workers, 1):
        raise SparseDecodeError(
            f"{workers or 1} worker(s) of {threads} thread(s) do not fit the Ray cluster: its nodes have "
            f"{_cpus(cpus)}, room for {room}; ask for fewer --workers or --worker-threads"
        )
    return workers, threads


def _cpus(cpus: list[int]) -> str:
    return f"{', '.join(map(str, cpus))} CPU(s)"


def import_ray():
    """Ray, or one line saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise SparseDecodeError(
            "--backend ray needs Ray, which is not installed: pip install 'sparsedecode[ray]' (or pip install ray)"
        ) from error
    return ray


def local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def ray_executor(args, *, console, progress=None) -> Iterator[RayPool]:
    """A :class:`RayPool` for ``args`` (``--address``, ``--workers``, ``--worker-threads``, ``--model``, ``--dtype``):
    joins the cluster, or starts a local instance that is stopped on the way out; the actors are killed on the way
    out either way. A process already connected to Ray (``ray.init`` called before) keeps its connection."""
    if (args.address is None or _loopback(args.address)) and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    ray = import_ray()
    owned = not ray.is_initialized()
    if owned:
        quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
        try:
            if args.address is None:
                cpus = local_cpus()
                console.print(f"starting a Ray instance on this machine (loopback only, {cpus} CPUs)")
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)
            else:
                console.print(f"joining the Ray cluster at {args.address}; its workers run this sparsedecode")
                code = {"py_modules": [_package_dir()], "excludes": ["__pycache__"]}
                ray.init(address=args.address, runtime_env=code, **quiet)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError, ray.exceptions.RayError) as error:
            if args.address is None:
                raise SparseDecodeError(f"cannot start a local Ray instance: {_first_line(error)}") from error
            raise SparseDecodeError(
                f"cannot join the Ray cluster at {args.address}: {_first_line(error)} (a cluster with token "
                "authentication needs RAY_AUTH_MODE=token and its token here, in ~/.ray/auth_token or RAY_AUTH_TOKEN)"
            ) from error
    pool = None
    try:
        pool = RayPool(
            ray,
            model=args.model,
            dtype=args.dtype,
            workers=args.workers,
            threads=args.worker_threads,
            address=args.address,
            console=console,
            progress=progress,
        )
        d = pool.description
        console.print(
            f"Ray: {d['nodes']} node(s), {d['cpus']} CPUs; up to {d['workers']} workers x {d['threads_per_worker']} "
            f"thread(s), each loading {args.model} once; rows are written here"
        )
        yield pool
    finally:
        if pool is not None:
            pool.close()
        if owned:
            ray.shutdown()


def _package_dir() -> str:
    """This process's ``sparsedecode`` folder: sent with the job, so that every worker runs the same code."""
    from .. import errors

    return os.path.dirname(os.path.abspath(errors.__file__))


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` address; ``None`` for the other forms Ray takes (``auto``, ``ray://...``)."""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _loopback(address: str) -> bool:
    where = _host_port(address)
    return where is not None and (where[0] in ("localhost", "::1") or where[0].startswith("127."))


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse a ``HOST:PORT`` nothing answers on at once (Ray itself would retry for minutes), and an address of no
    form Ray takes (it would fail only after the model loads)."""
    where = _host_port(address)
    if where is None:
        if address in ("auto", "local") or address.startswith("ray://") and len(address) > len("ray://"):
            return
        raise SparseDecodeError(
            f"--address {address!r}: give HOST:PORT (as `ray start --head` prints), ray://HOST:PORT or auto"
        )
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as error:
        raise SparseDecodeError(
            f"cannot reach the Ray cluster at {address} ({error.strerror or error}): start it there with "
            "`ray start --head`, or give the address `ray start` printed"
        ) from error


class RayPool:
    """Units on Ray actors (:class:`Worker`), at most one unit per actor at a time; an
    :class:`~sparsedecode.experiments.work.Executor`. Actors start as units need them, up to ``workers``."""

    def __init__(self, ray, *, model, dtype, workers, threads, address=None, console=None, progress=None):
        self.ray = ray
        self.console = console
        self.progress = progress
        self.model, self.dtype = model, dtype
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        cpus = [int(node.get("Resources", {}).get("CPU", 0)) for node in nodes]
        self.workers, self.threads = plan(cpus, workers, threads)
        self.description = {
            "backend": "ray",
            "address": address or "local",
            "nodes": len(nodes),
            "cpus": sum(cpus),
            "workers": self.workers,
            "threads_per_worker": self.threads,
            "retries_per_unit": RETRIES,
        }
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if os.environ.get(EXIT_ENV):
            env[EXIT_ENV] = os.environ[EXIT_ENV]
        self._actor = ray.remote(Worker).options(
            num_cpus=self.threads,
            num_gpus=0,
            max_restarts=0,  # a dead worker is replaced here, so that its unit is retried a bounded number of times
            max_task_retries=0,
            runtime_env={"env_vars": env},
        )
        self.actors: list = []
        self.idle: list = []  # actors with no unit, kept from one run() to the next (a calibration's rounds)

    def _start(self):
        from ..selectors.registry import loaded_sources

        actor = self._actor.remote(self.model, self.dtype, self.threads, loaded_sources())
        self.actors.append(actor)
        return actor

    def _discard(self, actor) -> None:
        self.actors.remove(actor)
        if actor in self.idle:
            self.idle.remove(actor)
        with contextlib.suppress(Exception):
            self.ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for actor in list(self.actors):
            self._discard(actor)

    def _show(self, done: int, total: int, running: int, retried: int) -> None:
        if self.progress and total:
            self.progress("units", done, total, note=f"{running} running, {retried} retried")

    def run(self, units: Iterable, total: int) -> Iterator[tuple[object, list[dict]]]:
        from ray.exceptions import ObjectLostError, RayActorError, WorkerCrashedError

        lost = (RayActorError, ObjectLostError, WorkerCrashedError)
        fresh = iter(units)
        again: deque = deque()  # units whose worker died, run again before new ones
        failures: dict[object, int] = {}
        flight: dict = {}  # ObjectRef -> (actor, unit)
        for actor in [a for a in self.actors if a not in self.idle]:  # busy in a run() that was stopped
            self._discard(actor)
        idle = self.idle
        done = retried = 0
        self._show(done, total, 0, retried)
        while True:
            while len(flight) < self.workers:
                unit = again.popleft() if again else next(fresh, None)
                if unit is None:
                    break
                actor = idle.pop() if idle else self._start()
                flight[actor.run.remote(unit)] = (actor, unit)
            self._show(done, total, len(flight), retried)
            if not flight:
                return
            [ref], _ = self.ray.wait(list(flight), num_returns=1)
            actor, unit = flight.pop(ref)
            try:
                kind, value = self.ray.get(ref)
            except lost as error:
                self._discard(actor)
                if getattr(error, "actor_init_failed", False):  # not a death: it would fail the same way again
                    raise SparseDecodeError(
                        f"a Ray worker could not start ({_last_line(error)}): every node needs sparsedecode's "
                        f"dependencies (pip install 'sparsedecode[ray]') and access to the model {self.model}"
                    ) from error
                failures[unit] = failures.get(unit, 0) + 1
                reason = _death(error)
                if failures[unit] > RETRIES:
                    raise SparseDecodeError(
                        f"unit {unit} failed: its worker died {failures[unit]} times ({reason}); see the workers' logs "
                        "(logs/ in the Ray session folder, /tmp/ray/session_latest on each machine)"
                    ) from error
                retried += 1
                if self.console:
                    self.console.print(
                        f"[yellow]worker died during {unit}[/] ({reason}): running it again on a fresh worker "
                        f"(retry {failures[unit]} of {RETRIES})"
                    )
                again.append(unit)
                continue
            idle.append(actor)
            if kind == "error":
                raise SparseDecodeError(f"{unit}: {value}")
            done += 1
            yield unit, value


def _death(error: BaseException) -> str:
    """Why a worker died, as Ray says it, in one line."""
    return _first_line(error)[:200]


def _lines(error: BaseException) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Ray colours parts of its messages
    return [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]


def _first_line(error: BaseException) -> str:
    return _lines(error)[0]


def _last_line(error: BaseException) -> str:
    """The last line of a remote traceback: the exception raised, with its message."""
    return _lines(error)[-1][:300]


class Worker:
    """One Ray actor of a :class:`RayPool`: loads the model once, then runs unit after unit.

    Errors a user can act on (:class:`SparseDecodeError`, ``OSError``) come back as ``("error", one line)``, so the
    command stops with that line; ``("rows", rows)`` otherwise.
    """

    def __init__(self, model: str, dtype: str, threads: int, sources: dict | None = None):
        import torch

        from ..selectors.registry import provide_sources

        torch.set_num_threads(threads)
        provide_sources(sources)  # the driver's selector files, whatever this machine holds at their paths
        self.units = 0
        self.loaded = None
        self.failed = None
        try:
            from ..models.catalog import load_model
            from .loading import quiet_transformers

            quiet_transformers()
            self.loaded = load_model(model, dtype=dtype)
        except (SparseDecodeError, OSError) as error:
            self.failed = f"a worker cannot load {model}: {one_line(error)}"

    def run(self, unit) -> tuple[str, object]:
        if self.failed:
            return "error", self.failed
        self.units += 1
        try:
            return "rows", unit.run(*self.loaded, on_row=_exit_hook(self.units))
        except (SparseDecodeError, OSError) as error:
            return "error", one_line(error)


def _exit_hook(number: int):
    """The row callback of :data:`EXIT_ENV` for this worker's ``number``-th unit (``None`` when it does not apply)."""
    setting = os.environ.get(EXIT_ENV, "")
    which, _, marker = setting.partition(":")
    if not which or int(which) != number:
        return None

    def exit_now(row: dict) -> None:
        if marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        os._exit(70)

    return exit_now
