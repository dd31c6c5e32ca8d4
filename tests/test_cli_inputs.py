"""Bad input at the command line: one line on stderr, exit status 2, no traceback, nothing written, and refused
before a model is loaded; ``--help`` and argument errors import neither torch nor transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import one_line_exit_2

from sparsedecode.cli import main
from sparsedecode.cli.outputs import atomic_path, write_json
from sparsedecode.models import catalog as models

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the bad input should have been refused before loading the model")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.fixture
def folder(tmp_path):
    """A folder holding one regular file, ``afile``."""
    (tmp_path / "afile").write_text("keep me")
    return tmp_path


def contents(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def assert_refused(args, message, capsys):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("sparsedecode: error: "), err
    assert message in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--json", "{f}"], "is a folder"),
        (["run", "--json", "{f}/afile/out.json"], "is a file, not a folder"),
        (["run", "--json", "/proc/sparsedecode-out.json"], "cannot create files in /proc"),
        (["run", "--json", "/proc/self/status"], "cannot create files in /proc/self"),
        (["run", "--json", "/dev/null"], "not a regular file"),
        (["run", "--mode", "lossless", "--json", "/proc/x.json"], "cannot create files in /proc"),
        (["probe", "mass", "--out", "{f}/afile"], "is an existing file, not a folder"),
        (["probe", "mass", "--out", "/proc/sparsedecode/mass"], "cannot create files in /proc"),
        (["probe", "retrieval", "--out", "{f}/afile"], "is an existing file, not a folder"),
        (["probe", "retrieval", "--out", "/proc/x"], "cannot create files in /proc"),
        (["compare-selectors", "--out", "{f}/afile"], "is an existing file, not a folder"),
        (["compare-selectors", "--out", "/proc/x"], "cannot create files in /proc"),
        (["sweep", "--out", "{f}/afile"], "is an existing file, not a folder"),
        (["sweep", "--out", "/proc/x"], "cannot create files in /proc"),
        (["merge", "{f}", "--out", "{f}/afile"], "is an existing file, not a folder"),
        (["merge", "{f}", "--out", "/proc/x"], "cannot create files in /proc"),
        (["report", "/proc"], "cannot create files in /proc"),
        (["bench", "op", "--json", "/proc/x.json"], "cannot create files in /proc"),
        (["bench", "e2e", "--json", "{f}"], "is a folder"),
    ],
)
def test_unwritable_outputs_are_refused_before_the_model_loads(args, message, folder, no_model_load, capsys):
    before = contents(folder)
    assert_refused([a.replace("{f}", str(folder)) for a in args], message, capsys)
    assert contents(folder) == before, "nothing written"


def read_only(path, monkeypatch) -> None:
    """Make ``path`` refuse new files: its mode, and for root (whom modes do not stop) the refusal the kernel gives
    any other user, at the one call that creates files there."""
    import errno
    import tempfile

    path.chmod(0o555)
    if ROOT:
        real = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if dir is not None and os.path.realpath(dir) == os.path.realpath(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(dir))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_read_only_output_folder_is_refused(folder, no_model_load, capsys, monkeypatch):
    read_only(folder, monkeypatch)
    try:
        assert_refused(["run", "--json", str(folder / "out.json")], "Permission denied", capsys)
        assert_refused(["probe", "mass", "--out", str(folder / "mass")], "Permission denied", capsys)
    finally:
        folder.chmod(0o755)
    assert sorted(os.listdir(folder)) == ["afile"]


@pytest.mark.parametrize("cache", ["/proc/sparsedecode-cache", "/proc"])
def test_model_cache_that_takes_no_files_is_refused_before_fetching(cache, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPARSEDECODE_CACHE", cache)
    monkeypatch.setattr(models, "ensure_gguf", lambda *a, **k: pytest.fail("tried to fetch the model"))
    out = tmp_path / "out.json"
    assert_refused(["run", "--model", "smollm2-135m", "--json", str(out)], "SPARSEDECODE_CACHE", capsys)
    assert not out.exists()


def test_read_only_model_cache_is_refused(monkeypatch, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    read_only(cache, monkeypatch)
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(cache))
    monkeypatch.setattr(models, "ensure_gguf", lambda *a, **k: pytest.fail("tried to fetch the model"))
    try:
        assert_refused(["run", "--model", "smollm2-135m"], "Permission denied", capsys)
    finally:
        cache.chmod(0o755)


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--support", "100"],
        ["run", "--support", "97,100", "--window", "64", "--block-size", "16"],
        ["probe", "mass", "--support", "100"],
        ["probe", "retrieval", "--support", "100"],
        ["compare-selectors", "--support", "100", "--selectors", "streaming,mean-pooled"],
        ["sweep", "--support", "100", "--out", "{f}/sweep"],
        ["bench", "op", "--support", "100"],
        ["bench", "e2e", "--support", "100"],
        ["bench", "vllm", "--support", "100"],  # it started the dense engine first (found by probing)
    ],
)
def test_support_that_is_not_whole_blocks_is_refused_with_the_nearest_valid_ones(args, folder, no_model_load, capsys):
    assert_refused([a.replace("{f}", str(folder)) for a in args], "use 97 or 113", capsys)
    assert sorted(os.listdir(folder)) == ["afile"]


@pytest.mark.parametrize(
    "command",
    [
        ["compare-selectors", "--selectors", "mean-pooled,quest"],
        ["bench", "e2e"],
        ["bench", "vllm"],
        ["run"],
        ["sweep", "--out", "{f}/s"],
    ],
)
@pytest.mark.parametrize("given", [["--layer-supports", "1:100"], ["--budget", "{f}/budget.json"]])
def test_per_layer_supports_that_are_not_whole_blocks_are_refused(command, given, folder, no_model_load, capsys):
    """Found by probing: compare-selectors, bench e2e and bench vllm checked only ``--support`` for whole blocks, so
    ``--layer-supports 1:100`` ran layer 1 at 97 (the library floors it) and recorded 100 as its support."""
    (folder / "budget.json").write_text('{"layer_supports": {"1": 100}}')
    args = [a.replace("{f}", str(folder)) for a in [*command, "--support", "97", *given]]
    assert_refused(args, "layer 1's support 100 is not 1 + W + b*B", capsys)
    assert sorted(os.listdir(folder)) == ["afile", "budget.json"]


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_bench_vllm_refuses_a_thread_count_below_one_before_any_engine(threads, no_model_load, capsys):
    """Found by probing: ``bench vllm --threads 0`` went on to start vLLM's engines with it."""
    assert_refused(["bench", "vllm", "--support", "97", "--threads", threads], "--threads must be >= 1", capsys)


def test_a_sweeps_selectors_beside_a_budget_file_naming_a_selector(folder, no_model_load, capsys):
    """Found by probing: ``sweep --budget b.json --selectors quest``, b.json naming quest, was refused with 'give
    --selector NAME or --selectors A,B,C, not both' (no --selector was given): the budget's selector went to
    ``--selector`` beside the ``--selectors`` given. The same selector runs; others are refused as differing."""
    (folder / "b.json").write_text('{"selector": "quest"}')
    sweep = ["sweep", "--support", "97", "--budget", str(folder / "b.json"), "--out", str(folder / "s")]
    with pytest.raises(AssertionError, match="before loading the model"):
        main([*sweep, "--selectors", "quest"])
    assert_refused([*sweep, "--selectors", "mean-pooled,quest"], "differs from budget file", capsys)
    assert_refused([*sweep, "--selector", "mean-pooled"], "differs from budget file", capsys)
    with pytest.raises(AssertionError, match="before loading the model"):
        main([*sweep, "--selector", "quest"])
    assert sorted(os.listdir(folder)) == ["afile", "b.json"]


def _feed(fifo: Path, text: bytes, seconds: float = 20.0) -> None:
    """Write ``text`` to every reader that opens ``fifo`` within ``seconds`` (a command that reads it, maybe several
    times), from a thread."""
    import errno
    import threading
    import time

    def write():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                handle = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as error:
                if error.errno != errno.ENXIO:  # ENXIO: no reader yet
                    return
                time.sleep(0.01)
                continue
            os.write(handle, text)
            os.close(handle)
            time.sleep(0.01)  # the reader takes it and its end of file before the next one opens

    threading.Thread(target=write, daemon=True).start()


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--budget", "{pipe}"], "budget file {pipe} is not a regular file"),
        (["sweep", "--budget", "{pipe}", "--out", "{f}/s"], "budget file {pipe} is not a regular file"),
        (["report", "{f}/r", "--retrieval", "{pipe}"], "retrieval results {pipe} are not a regular file"),
    ],
)
def test_an_input_file_that_is_a_pipe_or_device_is_refused_unread(args, message, folder, no_model_load, capsys):
    """Found by probing: ``--budget /dev/zero`` and ``report --retrieval /dev/zero`` read until memory ran out (a
    MemoryError traceback, or the process killed), and a named pipe hung them; corpora refuse such files already."""
    pipe = folder / "pipe"
    os.mkfifo(pipe)
    (folder / "r").mkdir()
    _feed(pipe, b'{"dense_layers": [0]}')  # what a command that reads the pipe gets
    before = contents(folder)
    given = [a.replace("{f}", str(folder)).replace("{pipe}", str(pipe)) for a in args]
    assert_refused(given, message.replace("{pipe}", str(pipe)), capsys)
    assert contents(folder) == before


@pytest.mark.parametrize(
    "marker, message",
    [
        ("selectors.json", "holds a selector comparison (selectors.json), whose report does not show them"),
        ("eval.json", "holds an evaluation (eval.json), whose report does not show them"),
        ("retrieval.json", "holds retrieval results of its own (retrieval.json), which its report shows"),
    ],
)
def test_report_retrieval_beside_other_results_is_refused(marker, message, tmp_path, capsys):
    """Found by probing: ``report COMPARISON --retrieval R`` wrote R's retrieval report into the comparison's folder
    and removed its selectors.csv; beside an evaluation --retrieval was ignored without a word; a retrieval folder
    got a report of other results than its own retrieval.json."""
    from test_bad_input import RETRIEVAL_SPEC, TRIAL

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "retrieval.json").write_text(json.dumps({"spec": RETRIEVAL_SPEC, "trials": [TRIAL]}))
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / marker).write_text("{}")
    (folder / "selectors.csv").write_text("kept\n")
    before = contents(folder)
    assert_refused(["report", str(folder), "--retrieval", str(elsewhere)], message, capsys)
    assert contents(folder) == before
    (folder / marker).unlink()  # no results of its own: the retrieval results are rendered there
    assert main(["report", str(folder), "--retrieval", str(elsewhere)]) == 0, capsys.readouterr().err
    assert (folder / "report.md").is_file()


def test_support_check_names_the_window_and_block_size(no_model_load, capsys):
    assert_refused(["run", "--support", "50", "--window", "8", "--block-size", "32"], "use 41 or 73", capsys)
    assert_refused(["run", "--support", "50", "--window", "8", "--block-size", "32"], "W = 8, B = 32", capsys)


def test_token_level_selectors_take_any_support():
    from conftest import TOKEN_SELECTORS

    from sparsedecode.cli.common import check_whole_blocks
    from sparsedecode.config import SparseConfig

    check_whole_blocks([SparseConfig(support=100, selector=s) for s in TOKEN_SELECTORS])
    with pytest.raises(Exception, match="use 97 or 113"):
        check_whole_blocks([SparseConfig(support=100, selector="quest")])


def test_a_file_system_error_inside_a_command_is_one_line(monkeypatch, capsys):
    def fail():
        raise PermissionError(13, "Permission denied", "/somewhere/models")

    monkeypatch.setattr(models, "list_models", fail)
    assert_refused(["models"], "Permission denied: /somewhere/models", capsys)


def test_atomic_writes_leave_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"a": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half a fi")
        raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"a": 1}, "the old file is untouched"
    assert sorted(os.listdir(tmp_path)) == ["out.json"], "no temporary file left"
    with pytest.raises(TypeError):
        write_json(tmp_path / "new.json", {"a": object()})
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_an_output_that_is_a_link_is_written_through(tmp_path, capsys):
    elsewhere = tmp_path / "results"
    elsewhere.mkdir()
    (elsewhere / "run.json").write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(elsewhere / "run.json")
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads((elsewhere / "run.json").read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["latest.json", "results"]
    assert sorted(os.listdir(elsewhere)) == ["run.json"], "no temporary file left"
    # the folder that must take the new file is the target's: a link to a file in a folder that takes none is refused
    from sparsedecode.cli.outputs import check_output_file

    link.unlink()
    link.symlink_to("/proc/sys/kernel/hostname")
    with pytest.raises(models.SparseDecodeError, match="cannot create files in /proc/sys/kernel"):
        check_output_file(link, "--json")


def test_cli_spells_library_defaults_the_same():
    from sparsedecode.cli import bench, common
    from sparsedecode.experiments import bench as experiments_bench

    assert common.DEFAULT_MODEL == models.DEFAULT_MODEL
    assert bench.SHAPES == tuple(sorted(experiments_bench.SHAPES))
    assert bench.DEFAULT_CONTEXTS == experiments_bench.DEFAULT_CONTEXTS
    assert bench.DEFAULT_SUPPORTS == experiments_bench.DEFAULT_SUPPORTS
    from sparsedecode.cli import parser
    from sparsedecode.decoding import lossless

    assert parser.MAX_DRAFT_TOKENS == lossless.MAX_DRAFT_TOKENS


HELP_AND_ERRORS = """
import sys, json
from sparsedecode.cli import main
codes = []
for args in {cases!r}:
    try:
        codes.append(main(args))
    except SystemExit as done:  # --help
        codes.append(done.code)
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "transformers"}})
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""


def test_help_and_argument_errors_import_no_torch():
    cases = [
        ["--help"],
        ["run", "--help"],
        ["bench", "op", "--help"],
        ["probe", "retrieval", "--help"],
        ["run", "--dtype", "int8"],
        ["run", "--context", "abc"],
        ["run", "--support", "10"],
        ["run", "--support", "100"],
        ["run", "--tokens", "0"],
        ["run", "--json", "/proc/x.json"],
        ["bench", "op", "--support", "100"],
        ["sweep", "--out", "/tmp/never-written", "--support", "100"],
        ["sweep", "--out", "/tmp/never-written", "--prompts", "0"],
        ["sweep", "--out", "/tmp/never-written", "--selector", "nope"],
        ["sweep", "--out", "/tmp/never-written", "--batch", "0"],
        ["probe", "retrieval", "--depths", "2"],
        ["probe", "retrieval", "--support", "100"],
        ["bench", "e2e", "--batch", "0"],
        ["eval", "--out", "/tmp/never-written", "--samples", "0"],
        ["eval", "--out", "/tmp/never-written", "--tasks", "nope"],
        ["eval", "--out", "/tmp/never-written", "--support", "100"],
        ["eval"],
        ["frobnicate"],
        ["sweep", "--out", "/tmp/never-written", "--shard", "a/b"],
        ["sweep", "--out", "/tmp/never-written", "--shard", "3/2"],
        ["sweep", "--out", ""],
        ["bench", "op", "--layers", "0"],
        ["bench", "op", "--budget", "nan"],
        ["bench", "op", "--device", "tpu"],
        ["report", "/tmp/never-written/nothing-here"],
        ["run", "--support", "97,,193"],
        ["run", "--support", "97,97"],
        ["compare-selectors", "--selectors", "quest,quest"],
        ["compare-selectors", "--selectors", "all,quest"],
        ["sweep", "--out", "/tmp/never-written", "--selectors", "nope"],
        ["probe", "mass", "--tokens", "1"],
        ["probe", "mass", "--support", "100"],
        ["run", "--json", "/tmp/never-written/"],
        ["bench", "e2e", "--json", "/tmp/never-written/"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HELP_AND_ERRORS.format(cases=cases)], capture_output=True, text=True, check=True
    )
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["codes"] == [0] * 4 + [2] * 35
    assert done["heavy"] == [], f"imported {done['heavy']}"


def test_module_entry_point_help_imports_no_torch():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sparsedecode", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "compare-selectors" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "sparsedecode.cli" in imported, "the import log was read"
    assert not {name.split(".")[0] for name in imported} & {"torch", "transformers"}


@pytest.mark.parametrize("args", [["--help"], ["--bogus"], ["run", "--tasks"]])
def test_lm_eval_help_and_usage_errors_import_no_torch(args):
    """``lm-eval --help`` is lm-eval's own help: it took seconds, registering the model (torch, transformers) before
    lm-eval's parser had looked at the arguments."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sparsedecode", "lm-eval", *args], capture_output=True, text=True
    )
    assert proc.returncode == (0 if args == ["--help"] else 2), proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "lm_eval" in imported, "the import log was read"
    assert not {name.split(".")[0] for name in imported} & {"torch", "transformers"}


def test_file_system_error_through_the_module_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sparsedecode", "run", "--json", "/proc/sparsedecode/out.json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "/proc" in proc.stderr
    file = tmp_path / "afile"
    file.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "sparsedecode", "probe", "mass", "--out", str(file)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert file.read_text() == "keep me"


@pytest.mark.parametrize("command", [["run"], ["bench", "op"], ["bench", "e2e"]])
def test_a_json_output_ending_in_a_slash_is_refused_not_written_as_a_file(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = one_line_exit_2([*command, "--json", "o.json/"], capsys)
    assert "argument --json: expected a file name, got 'o.json/', which ends in a slash" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,named",
    [
        (["run", "--bogus", "1"], "sparsedecode run: unrecognized arguments: --bogus 1"),
        (["bench", "op", "--x"], "sparsedecode bench op: unrecognized arguments: --x"),
        (["probe", "mass", "extra"], "sparsedecode probe mass: unrecognized arguments: extra"),
        (["--x", "run"], "sparsedecode: unrecognized arguments: --x"),
    ],
)
def test_unknown_arguments_are_named_with_their_command(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"sparsedecode: error: {named}\n"


# ---- a user's trial, second round: outputs that clash, inputs that would be overwritten, options that do nothing ----


@pytest.mark.parametrize(
    "args, made, message",
    [
        (["compare-selectors", "--out", "{f}"], "selectors.md/", "selectors.md (--out"),
        (["probe", "mass", "--context", "300", "--support", "97", "--out", "{f}"], "mass.json/", "it is a folder"),
        (["probe", "mass", "--context", "300", "--support", "97", "--out", "{f}"], "mass-c300-s97.png/", "a folder"),
        (["probe", "retrieval", "--out", "{f}"], "retrieval.json/", "it is a folder"),
        (["sweep", "--out", "{f}"], "runs.jsonl/", "it is a folder"),
        (["sweep", "--out", "{f}"], ".lock/", "it is a folder"),  # was refused only once the model had loaded
        (["eval", "--out", "{f}"], ".lock/", "it is a folder"),
        (["report", "{f}"], "report.md/", "is not a regular file"),
        (
            ["run", "--audit", "--context", "300", "--support", "97", "--json", "{f}/o.json"],
            "o.audit-c300-s97.npz/",
            "written with --json",
        ),
        (["sweep", "--out", "{f}"], "eval.json", "holds an evaluation (eval.json); write a sweep into a folder of"),
        (["sweep", "--out", "{f}"], "runs.jsonl", "holds runs that are not a sweep's"),
        # each kind of results in a folder of its own (a report would show one of them), retrieval beside a sweep
        (["sweep", "--out", "{f}"], "selectors.json", "holds a selector comparison (selectors.json); write a sweep"),
        (["sweep", "--out", "{f}"], "mass.json", "holds an attention-mass probe (mass.json)"),
        (
            ["compare-selectors", "--out", "{f}"],
            "sweep.json",
            "holds a sweep (sweep.json); write a selector comparison",
        ),
        (["compare-selectors", "--out", "{f}"], "retrieval.json", "holds retrieval results (retrieval.json)"),
        (["compare-selectors", "--out", "{f}"], "eval.json", "holds an evaluation (eval.json)"),
        (["probe", "retrieval", "--out", "{f}"], "eval.json", "holds an evaluation (eval.json); write retrieval"),
        (["probe", "retrieval", "--out", "{f}"], "selectors.json", "holds a selector comparison"),
        (["probe", "retrieval", "--out", "{f}"], "mass.json", "holds an attention-mass probe"),
        (["probe", "mass", "--context", "300", "--support", "97", "--out", "{f}"], "sweep.json", "holds a sweep"),
        (["probe", "mass", "--context", "300", "--support", "97", "--out", "{f}"], "retrieval.json", "retrieval"),
        (["eval", "--out", "{f}"], "selectors.json", "holds a selector comparison (selectors.json); write an eval"),
        (["eval", "--out", "{f}"], "retrieval.json", "holds retrieval results (retrieval.json); write an evaluation"),
        (["run", "--corpus", "{f}/afile", "--json", "{f}/afile"], "", "is the input --corpus"),
        (["sweep", "--corpus", "{f}", "--out", "{f}/results"], "", "is inside the input --corpus"),
        (["bench", "e2e", "--model", "{f}", "--json", "{f}/e2e.json"], "", "is inside the input --model"),
        (["probe", "mass", "--corpus", "{f}/mass.json", "--out", "{f}"], "mass.json", "is the input --corpus"),
        (["compare-selectors", "--corpus", "{f}/selectors.json", "--out", "{f}"], "selectors.json", "input --corpus"),
        (["probe", "retrieval", "--haystack", "{f}/retrieval.json", "--out", "{f}"], "retrieval.json", "--haystack"),
    ],
)
def test_outputs_that_clash_are_refused_before_the_model_loads(args, made, message, folder, no_model_load, capsys):
    """A name the command writes that is taken by a folder, runs of another kind, or an output that is an input
    (the corpus would be overwritten): refused at once, and the folder is left as it was."""
    if made.endswith("/"):
        (folder / made).mkdir()
    elif made:
        (folder / made).write_text("{}\n")
    before = contents(folder)
    assert_refused([a.replace("{f}", str(folder)) for a in args], message, capsys)
    assert contents(folder) == before, "nothing written"


SELECTOR_FILE = """
import torch

import sparsedecode as sd


class Mine(sd.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        return torch.zeros(keys.shape[0], layout.n_blocks)
"""


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--budget", "{f}/b.json", "--json", "{f}/b.json"], "is the input --budget"),
        (["run", "--mode", "lossless", "--budget", "{f}/b.json", "--json", "{f}/b.json"], "is the input --budget"),
        (["bench", "e2e", "--budget", "{f}/b.json", "--json", "{f}/b.json"], "is the input --budget"),
        (["run", "--selector", "{f}/sel.py:Mine", "--json", "{f}/sel.py"], "is the input --selector"),
        (["bench", "op", "--selector", "{f}/sel.py:Mine", "--json", "{f}/sel.py"], "is the input --selector"),
        (["probe", "mass", "--budget", "{f}/mass.json", "--out", "{f}"], "is the input --budget"),
    ],
)
def test_an_output_that_is_the_budget_or_selector_file_is_refused(args, message, folder, no_model_load, capsys):
    """Found by probing: ``run --budget b.json --json b.json`` (or ``--selector sel.py:Mine --json sel.py``) ran and
    wrote its results over the budget file (the selector's code): only ``--model``, ``--corpus`` and ``--haystack``
    counted as inputs."""
    for name in ("b.json", "mass.json", "sel.py"):
        if any(f"{{f}}/{name}" in arg for arg in args):
            (folder / name).write_text(SELECTOR_FILE if name.endswith(".py") else '{"dense_layers": [0]}')
    before = contents(folder)
    assert_refused([a.replace("{f}", str(folder)) for a in args], message, capsys)
    assert contents(folder) == before, "the inputs are kept"


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--adaptive"], "apply to --mode lossless only"),
        (["run", "--draft-tokens", "2"], "apply to --mode lossless only"),
        (["run", "--mode", "lossless", "--draft-tokens", "10", "--tokens", "4"], "between 1 and --tokens - 1 = 3"),
        (["bench", "e2e", "--tokens", "1"], "--tokens must be >= 2"),
        (["bench", "e2e", "--adaptive"], "apply to --mode lossless only"),
        (["bench", "e2e", "--draft-tokens", "2"], "apply to --mode lossless only"),
        (["bench", "e2e", "--mode", "lossless", "--draft-tokens", "2,1000", "--tokens", "4"], "between 1 and"),
        # an adaptive k grows up to 16: generate refused a longer one only after the model and the dense run
        (["run", "--mode", "lossless", "--adaptive", "--draft-tokens", "20", "--tokens", "40"], "grows k up to 16"),
        (["bench", "e2e", "--mode", "lossless", "--adaptive", "--draft-tokens", "4,20"], "grows k up to 16"),
        (["run", "--corpus", ""], "corpus name is empty"),
        (["run", "--corpus", "{f}/missing.txt"], "unknown corpus"),
        (["run", "--prompt-index", "-1"], "--prompt-index must be >= 0"),
        (["probe", "mass", "--corpus", "{f}/missing.txt"], "unknown corpus"),
        (["bench", "e2e", "--corpus", "{f}/missing.txt"], "unknown corpus"),
        (["bench", "e2e", "--prompt-index", "-1"], "--prompt-index must be >= 0"),
    ],
)
def test_options_that_would_do_nothing_and_bad_corpora_are_refused_before_loading(
    args, message, folder, no_model_load, capsys
):
    assert_refused([a.replace("{f}", str(folder)) for a in args], message, capsys)


def test_wikitext2_without_the_hub_fails_at_once_and_before_the_model(monkeypatch, no_model_load, capsys):
    """No retries against an unreachable hub: one connection check, then only the local datasets cache is read."""
    monkeypatch.setattr(models, "hub_unreachable", lambda *a, **k: "no connection (test)")
    assert_refused(["run", "--corpus", "wikitext2", "--context", "300"], "wikitext2", capsys)


def test_corrupt_or_partial_model_folders_are_one_line(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    with open(truncated / "model.safetensors", "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(models.SparseDecodeError, match="cannot load model from directory .*SafetensorError") as e:
        models.load_model(str(truncated))
    assert "\n" not in str(e.value)

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    with pytest.raises(models.SparseDecodeError, match="cannot load the tokenizer of") as e:
        models.load_model(str(no_tokenizer))
    assert "\n" not in str(e.value)

    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 40)  # the magic, then nothing a reader can use
    with pytest.raises(models.SparseDecodeError, match="cannot convert GGUF") as e:
        models.load_model(str(gguf))
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache" / "models").glob("*")), "no entry left in the model cache"


def test_an_audit_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    import numpy as np

    from sparsedecode.protocol.diagnostics import save_audit

    (tmp_path / "taken.npz").mkdir()
    with pytest.raises(OSError):
        save_audit(tmp_path / "taken.npz", {"a": np.zeros(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.npz"]


def test_standard_bench_e2e_takes_few_tokens_without_draft_lengths(no_model_load):
    """The lossless-only default draft length is not held against a standard run: it gets as far as the model."""
    with pytest.raises(AssertionError, match="before loading the model"):
        main(["bench", "e2e", "--tokens", "4"])


@pytest.mark.parametrize("where", ["runs.jsonl", "."])
def test_a_dangling_link_in_or_as_the_output_folder_is_refused(folder, no_model_load, capsys, where):
    out = folder / "out"
    if where == ".":
        out.symlink_to(folder / "nowhere")
    else:
        out.mkdir()
        (out / where).symlink_to(folder / "nowhere")
    before = contents(folder)
    assert_refused(["sweep", "--out", str(out)], "symbolic link to nothing", capsys)
    assert contents(folder) == before


def test_a_failed_command_leaves_no_empty_output_folder_and_names_the_file(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    import errno

    from sparsedecode.cli import run as run_command
    from sparsedecode.errors import naming

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    target = tmp_path / "new" / "deeper" / "o.json"

    def disk_full(path, data):
        path.parent.mkdir(parents=True)
        with naming(path):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_command, "write_json", disk_full)
    args = ["run", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--context", "100", "--support", "97"]
    assert_refused([*args, "--tokens", "3", "--json", str(target)], f"No space left on device: {target}", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"], "the folders made for --json are gone"


# ---- issue 27: an abbreviated or misspelt option is refused as such, on every command ----


def leaf_commands():
    """``(words, parser)`` of every command that parses its own options (``lm-eval`` hands them to lm-eval)."""
    import argparse

    from sparsedecode.cli import build_parser

    def walk(parser, words):
        subs = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        yield words, parser, not subs
        for sub in subs:
            for name, child in sub.choices.items():
                yield from walk(child, [*words, name])

    return [(words, parser, leaf) for words, parser, leaf in walk(build_parser(), []) if words != ["lm-eval"]]


def test_no_parser_takes_abbreviations():
    commands = leaf_commands()
    assert {" ".join(words) for words, _, _ in commands} >= {"", "bench", "run", "sweep", "merge", "report", "eval"}
    assert all(parser.allow_abbrev is False for _, parser, _ in commands)
    assert main(["--hel"]) == 2 and main(["bench", "--hel"]) == 2


@pytest.mark.parametrize("words", [words for words, _, leaf in leaf_commands() if leaf], ids=" ".join)
def test_every_option_shortened_by_a_letter_is_an_unknown_argument(words, tmp_path, no_model_load, capsys):
    """Each long option less its last letter (``--mode`` for ``--model``), on each command, with its required
    arguments given: refused as an unrecognised argument of that command, nothing written."""
    parser = {" ".join(w): p for w, p, _ in leaf_commands()}[" ".join(words)]
    required = []
    for action in parser._actions:
        if not action.option_strings and action.required:
            required.append(str(tmp_path / "in"))
        elif action.required and action.option_strings:
            required += [action.option_strings[0], str(tmp_path / "out")]
    known = {option for action in parser._actions for option in action.option_strings}
    shortened = sorted({o[:-1] for o in known if o.startswith("--") and len(o) > 4 and o[:-1] not in known})
    assert shortened
    for option in shortened:
        code = main([*words, *required, f"{option}=1"])
        err = capsys.readouterr().err
        assert code == 2, (words, option, err)
        assert err == f"sparsedecode: error: sparsedecode {' '.join(words)}: unrecognized arguments: {option}=1\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["sweep", "--mode", "lossless", "--out", "OUT"],
        ["eval", "--mode", "lossless", "--out", "OUT"],
        ["compare-selectors", "--mode", "lossless"],
        ["run", "--mode", "lossless", "--draft", "4"],
        ["run", "--sup", "97"],
    ],
)
def test_the_issues_abbreviations_are_not_taken_for_another_option(args, tmp_path, no_model_load, capsys):
    args = [str(tmp_path / "o") if a == "OUT" else a for a in args]
    err = one_line_exit_2(args, capsys)
    assert "unrecognized arguments: " in err and "unknown model" not in err
    assert list(tmp_path.iterdir()) == []


def test_running_out_of_memory_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    """Found by probing huge counts (eval --samples 99999999999999999 built its sample list until memory ran out):
    a MemoryError was a traceback; it is one line naming what to ask less of, and a folder made for it is removed."""
    import sparsedecode.cli as cli
    from sparsedecode.cli import outputs

    def grow(args):
        (tmp_path / "made").mkdir()
        outputs.MADE_FOLDERS.append(tmp_path / "made")
        raise MemoryError

    monkeypatch.setattr(cli, "apply_budget_file", grow)
    assert main(["run", "--context", "300", "--support", "97"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sparsedecode: error: out of memory: ask for less") and err.count("\n") == 1
    assert not (tmp_path / "made").exists()
