"""``--backend ray`` on a local Ray instance (loopback only, 2 CPUs, one thread per worker) and tiny models.

The rows a Ray run writes equal the local backend's, timings aside, even when a worker dies mid-unit or the driver
is killed with SIGKILL and rerun; no row is lost or written twice; changed settings are refused as locally; a unit
whose worker keeps dying stops the command with one line naming it. One Ray instance serves the module: commands
run in this process reuse it, and the killed driver joins it with ``--address``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_model

import sparsedecode
from sparsedecode.cli import main
from sparsedecode.cli import sweep as cli_sweep
from sparsedecode.cli.ray_backend import EXIT_ENV, LOOPBACK_ENV, RETRIES, plan
from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments.evaluate import key_of as eval_key
from sparsedecode.experiments.sweep import RUNS_FILE, key_of, parse_rows, read_rows, without_timings

SRC = Path(__file__).parents[1] / "src"
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one worker, one Ray instance per group
OTHER_WORKER = pytest.mark.xdist_group("ray-2")
"""The longest Ray tests split over two groups, so two parallel workers (each with its own Ray instance) share them."""


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module, listening on 127.0.0.1 only; yields its address."""
    saved = os.environ.get(LOOPBACK_ENV)
    os.environ[LOOPBACK_ENV] = "0"  # read when Ray is imported
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}, "loopback only"
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved


@pytest.fixture(autouse=True)
def one_thread():
    """The workers run one torch thread each, so the local runs they are compared with run one too: another thread
    count sums in another order, and rows would differ in their last bits (perplexities, margins)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sweep_args(model_dir: Path, *extra: str) -> list[str]:
    grid = ["--context", "150,220", "--support", "97,113", "--prompts", "2", "--tokens", "10"]
    return ["sweep", "--model", str(model_dir), *grid, *extra]


def by_key(rows: list[dict], key=key_of) -> list[dict]:
    """Rows in key order without timings: a Ray run writes units in the order they finish."""
    return sorted((without_timings(row) for row in rows), key=lambda row: json.dumps(key(row)))


def test_plan_keeps_workers_times_threads_within_each_node():
    assert plan([2], None, None) == (2, 1)
    assert plan([16], 4, None) == (4, 4)
    assert plan([8, 8], 3, None) == (3, 4)  # 5 threads would place only two workers
    assert plan([8, 4], None, 4) == (3, 4)
    assert plan([2], None, 2) == (1, 2)
    with pytest.raises(SparseDecodeError, match="do not fit"):
        plan([2], 3, None)
    with pytest.raises(SparseDecodeError, match="room for 1"):
        plan([2], 2, 2)
    with pytest.raises(SparseDecodeError, match="no CPUs"):
        plan([0], None, None)


def test_the_library_never_imports_ray_and_help_does_not_either():
    package = Path(sparsedecode.__file__).parent
    library = [path for path in package.rglob("*.py") if "cli" not in path.relative_to(package).parts]
    assert len(library) > 20
    for path in library:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(name.split(".")[0] == "ray" for name in names), f"{path} imports Ray"
    for args in (["sweep", "--help"], ["compare-selectors", "--backend", "ray", "--workers", "0", "--support", "97"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "sparsedecode", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(SRC)},
        )
        assert proc.returncode == (0 if "--help" in args else 2), proc.stderr[-500:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "sparsedecode.cli" in imported, "the import log was read"
        assert not {name.split(".")[0] for name in imported} & {"ray", "torch"}


def test_ray_options_are_refused_in_one_line_without_the_ray_backend_or_without_ray(tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path / "s")]
    assert main(sweep_args(tmp_path, "--workers", "2", *out)) == 2
    assert "--workers applies to --backend ray only" in capsys.readouterr().err
    assert main(sweep_args(tmp_path, "--backend", "ray", "--worker-threads", "0", *out)) == 2
    assert "--worker-threads must be >= 1" in capsys.readouterr().err
    assert main(sweep_args(tmp_path, "--backend", "ray", "--batch", "2", *out)) == 2
    assert "--batch applies to --backend local" in capsys.readouterr().err
    assert main(sweep_args(tmp_path, "--backend", "ray", "--address", "127.0.0.1:1", *out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach the Ray cluster at 127.0.0.1:1" in err
    for malformed in ("", "abc", "127.0.0.1:abc", ":", "ray://"):  # passed, to fail only after the model loaded
        assert main(sweep_args(tmp_path, "--backend", "ray", "--address", malformed, *out)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--address {malformed!r}: give HOST:PORT" in err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(sweep_args(tmp_path, "--backend", "ray", *out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'sparsedecode[ray]'" in err
    assert not (tmp_path / "s").exists(), "nothing written by a refused command"


@OTHER_WORKER
def test_sweep_on_ray_equals_local_even_when_a_worker_dies_mid_unit(
    cluster, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    assert main([*sweep_args(tiny_model_dir), "--out", str(tmp_path / "local")]) == 0
    died = tmp_path / "died"
    monkeypatch.setenv(EXIT_ENV, f"2:{died}")  # the first worker to start its 2nd unit dies after that unit's 1st row
    shown = []

    @contextlib.contextmanager
    def recorded(**_):
        yield lambda stage, done, total, note="": shown.append((stage, done, total, note))

    monkeypatch.setattr(cli_sweep, "progress_bars", recorded)
    assert main([*sweep_args(tiny_model_dir, "--backend", "ray"), "--out", str(tmp_path / "ray")]) == 0
    out = capsys.readouterr().out
    assert died.exists() and "worker died during context" in out and f"(retry 1 of {RETRIES})" in out
    units = [(done, total, note) for stage, done, total, note in shown if stage == "units"]
    assert (0, 4, "2 running, 0 retried") in units and units[-1] == (4, 4, "0 running, 1 retried")
    assert ("runs", 8, 8, "") in shown
    local, ray_rows = read_rows(tmp_path / "local" / RUNS_FILE), read_rows(tmp_path / "ray" / RUNS_FILE)
    assert len(ray_rows) == len({key_of(row) for row in ray_rows}) == 8, "no row lost or written twice"
    assert by_key(ray_rows) == by_key(local)
    session = json.loads((tmp_path / "ray" / "sweep.json").read_text())["sessions"][-1]
    assert session["backend"] == {
        "backend": "ray",
        "address": "local",
        "nodes": 1,
        "cpus": 2,
        "workers": 2,
        "threads_per_worker": 1,
        "retries_per_unit": RETRIES,
    }
    assert main(["report", str(tmp_path / "ray")]) == 0 and (tmp_path / "ray" / "report.md").exists()


def child_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **extra}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc): what a command's own Ray instance started."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def test_a_unit_whose_worker_keeps_dying_stops_the_command_naming_it(cluster, tiny_model_dir, tmp_path):
    args = ["sweep", "--model", str(tiny_model_dir), "--context", "150", "--support", "97,113", "--prompts", "1"]
    args += ["--tokens", "6", "--backend", "ray", "--workers", "1", "--address", cluster, "--out", str(tmp_path / "s")]
    proc = subprocess.run(  # joins this module's Ray instance, sending it the package as the command does
        [sys.executable, "-m", "sparsedecode", *args],
        capture_output=True,
        text=True,
        env=child_env(**{EXIT_ENV: "1"}),  # every worker dies after the first row of its first unit
        timeout=900,  # a bound against a hang, not a speed target: each retry starts a worker (import torch, load)
    )
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stdout.count("worker died during context 150, prompt 0") == RETRIES
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sparsedecode:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert f"unit context 150, prompt 0 failed: its worker died {RETRIES + 1} times" in errors[0]
    assert parse_rows(tmp_path / "s" / RUNS_FILE) == [], "no row of a unit that never finished"


def test_driver_killed_with_sigkill_then_rerun_finishes_the_grid_without_duplicates(
    cluster, tiny_model_dir, tmp_path, capsys
):
    args = sweep_args(tiny_model_dir, "--backend", "ray")
    args[args.index("--prompts") + 1] = "3"
    killed = tmp_path / "killed"
    proc = subprocess.Popen(  # starts its own Ray instance, as a command without --address does
        [sys.executable, "-m", "sparsedecode", *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=child_env(),
    )
    runs = killed / RUNS_FILE
    deadline = time.monotonic() + 600  # the driver starts its own Ray instance: minutes on a loaded machine
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.exists() and runs.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.005)
    started = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    time.sleep(1)
    for pid in started:  # Ray's agents outlive a SIGKILLed driver for a minute: end the ones this test started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    before = len(read_rows(runs))
    total = 2 * 3 * 2
    assert 2 <= before < total, f"the kill should land mid-sweep ({before} of {total} rows): {err.decode()[-300:]}"
    # one group also misses one run (a local sweep killed between two rows): only that run is submitted again
    lines = runs.read_bytes().splitlines(keepends=True)
    runs.write_bytes(b"".join(lines[: before - 1]))
    assert main([*args, "--out", str(killed)]) == 0
    assert f"{total - before + 1} runs now, {before - 1} before: {total} of {total}" in capsys.readouterr().out
    assert main([*sweep_args(tiny_model_dir), "--prompts", "3", "--out", str(tmp_path / "local")]) == 0
    resumed = read_rows(runs)
    assert len({key_of(row) for row in resumed}) == len(resumed) == total, "no row duplicated or missing"
    assert by_key(resumed) == by_key(read_rows(tmp_path / "local" / RUNS_FILE))


def test_changed_settings_are_refused_with_the_ray_backend_as_locally(tiny_model_dir, tmp_path, capsys):
    base = ["sweep", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--prompts", "1"]
    out = ["--out", str(tmp_path / "s")]
    assert main([*base, "--tokens", "6", *out]) == 0
    before = (tmp_path / "s" / RUNS_FILE).read_bytes()
    capsys.readouterr()
    assert main([*base, "--tokens", "8", "--backend", "ray", *out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokens: 6 vs 8" in err
    assert main([*base, "--tokens", "6", "--shard", "1/2", "--backend", "ray", *out]) == 2
    assert "sparsedecode merge" in capsys.readouterr().err
    assert (tmp_path / "s" / RUNS_FILE).read_bytes() == before, "nothing written by a refused run"


@OTHER_WORKER
def test_compare_selectors_on_ray_equals_local(cluster, tiny_model_dir, tmp_path, capsys, monkeypatch):
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "300", "--support", "97,113"]
    args += ["--selectors", "mean-pooled,streaming", "--prompts", "2", "--tokens", "8", "--retrieval", "1"]
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    died = tmp_path / "died"
    monkeypatch.setenv(EXIT_ENV, f"2:{died}")  # two prompts then a passkey trial: a worker dies in its 2nd unit
    assert main([*args, "--backend", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert died.exists() and "worker died during" in capsys.readouterr().out
    local, ray_data = (json.loads((tmp_path / d / "selectors.json").read_text()) for d in ("local", "ray"))
    assert len(local["runs"]) == 2 * 2 * 2 and len(local["retrieval"]) == 1 + 2 * 2
    for name in ("runs", "retrieval"):  # the same order too: rows are put back in the local order
        assert [without_timings(r) for r in ray_data[name]] == [without_timings(r) for r in local[name]]
    assert [{**r, "op_ms": None} for r in ray_data["summary"]] == [{**r, "op_ms": None} for r in local["summary"]]
    assert ray_data["settings"]["backend"]["workers"] == 2 and "backend" not in local["settings"]


def one_layer_dir(path: Path) -> Path:
    tiny_model("llama", layers=1, max_position_embeddings=4096).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_eval_on_ray_equals_local_and_resumes(cluster, tmp_path, capsys, monkeypatch):
    model = one_layer_dir(tmp_path / "model")
    args = ["eval", "--model", str(model), "--tasks", "niah_single_noise", "--context", "600", "--samples", "2"]
    args += ["--selectors", "mean-pooled,streaming", "--support", "97", "--answer-tokens", "4"]
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    died = tmp_path / "died"
    monkeypatch.setenv(EXIT_ENV, f"1:{died}")  # the first worker to answer dies right after its first row
    assert main([*args, "--backend", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert died.exists() and "worker died during niah_single_noise, context 600, sample" in capsys.readouterr().out
    local, ray_rows = parse_rows(tmp_path / "local" / RUNS_FILE), parse_rows(tmp_path / "ray" / RUNS_FILE)
    assert len(ray_rows) == len({eval_key(row) for row in ray_rows}) == 2 * 3, "no row lost or written twice"
    assert by_key(ray_rows, eval_key) == by_key(local, eval_key)
    # a sample missing its sparse runs: its stored dense answer is checked and only the missing runs are written
    monkeypatch.delenv(EXIT_ENV)
    runs = tmp_path / "ray" / RUNS_FILE
    kept = [row for row in ray_rows if not (row["sample"] == 1 and row["selector"] != "dense")]
    runs.write_text("".join(json.dumps(row) + "\n" for row in kept))
    assert main([*args, "--backend", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert "2 runs now, 4 before: 6 of 6" in capsys.readouterr().out
    assert by_key(parse_rows(runs), eval_key) == by_key(local, eval_key)


@OTHER_WORKER
def test_a_selector_file_reaches_the_workers_and_their_rows_equal_the_local_ones(cluster, tiny_model_dir, tmp_path):
    """The file's content travels with the work: the workers import it even where its path is gone (a cluster whose
    machines do not share the driver's files), and a sweep of it on Ray writes the local rows."""
    from test_selector_protocol import USER_SELECTOR

    source = tmp_path / "mine.py"
    source.write_text(USER_SELECTOR)
    grid = ["--selectors", f"mean-pooled,{source}:MaxKeyBlocks:temperature=2", "--workers", "2", "--address", cluster]
    assert main([*sweep_args(tiny_model_dir), *grid[:2], "--out", str(tmp_path / "local")]) == 0
    from sparsedecode.selectors import registry

    registry.provide_sources(registry.loaded_sources())  # as a worker would, this process now reads what it imported
    moved = tmp_path / "moved.py"
    source.rename(moved)  # the workers cannot read the path; the driver sends what it imported
    try:
        assert main([*sweep_args(tiny_model_dir, "--backend", "ray"), *grid, "--out", str(tmp_path / "ray")]) == 0
    finally:
        moved.rename(source)
    local, remote = (read_rows(tmp_path / d / RUNS_FILE) for d in ("local", "ray"))
    assert by_key(remote) == by_key(local)
    assert {row["selector_sha256"] for row in local if "MaxKeyBlocks" in row["selector"]} != set()


def test_calibrate_on_ray_runs_rounds_of_trials_as_an_in_process_search_and_resumes(
    cluster, tiny_model_dir, tmp_path, capsys
):
    from sparsedecode import SparseConfig
    from sparsedecode.experiments import calibrate
    from sparsedecode.models.catalog import load_model

    out = tmp_path / "ray"
    args = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--choices", "97,1009", "--tokens", "6"]
    args += ["--target", "tf-match>=90", "--prompts", "2", "--held-out", "1", "--out", str(out)]
    assert main([*args, "--trials", "6", "--backend", "ray", "--workers", "2"]) == 0, capsys.readouterr().err
    data = json.loads((out / "calibration.json").read_text())
    assert data["settings"]["batch"] == 2 and len(data["trials"]) == 6

    class InProcess:  # the same rounds, each trial's unit run here
        description = {"workers": 2}

        def __init__(self, loaded):
            self.loaded = loaded

        def run(self, work, total):
            for unit in work:
                yield unit, unit.run(*self.loaded)

    loaded = load_model(str(tiny_model_dir))
    fields = set(calibrate.Search.__dataclass_fields__)
    search = calibrate.Search(**{k: v for k, v in data["settings"].items() if k in fields})
    study = calibrate.open_study(tmp_path / "here.db", search)
    drawn = tuple(data["settings"]["prompt_indices"]["calibration"])  # the prompts the split drew
    spec = calibrate.UnitsSpec(corpus="python-docs", context=300, first=0, count=2, tokens=6, indices=drawn)
    calibrate.run_search(None, None, SparseConfig(support=97), search, study, 6, execute=InProcess(loaded), spec=spec)
    here = [{"supports": [t.params[f"layer_{i}"] for i in range(2)], "state": t.state.name.lower(), "cost": t.value,
             "means": t.user_attrs.get("means")} for t in calibrate.finished(study)]  # fmt: skip
    assert [{k: t[k] for k in ("supports", "state", "cost", "means")} for t in data["trials"]] == here
    assert main([*args, "--trials", "8", "--backend", "ray", "--workers", "2"]) == 0  # resumed: 6 kept, 2 more
    again = json.loads((out / "calibration.json").read_text())["trials"]
    assert len(again) == 8 and again[:6] == data["trials"]
    capsys.readouterr()
    assert main([*args, "--trials", "8"]) == 2  # proposed one at a time, the search would differ
    assert "holds a search of other settings (batch differ)" in capsys.readouterr().err
