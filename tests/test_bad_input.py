"""Bad input fails at the call, in one line (SparseDecodeError), before any expensive work, leaving nothing behind.

Library entry points are called directly; the command-line cases go through ``sparsedecode.cli.main`` and check
exit status 2, one line on stderr and no traceback. Nothing here touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode import models
from sparsedecode.attention import sparse_decoding
from sparsedecode.cli import main
from sparsedecode.compare import compare, dense_reference
from sparsedecode.config import SparseConfig
from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments.corpus import check_corpus, load_text
from sparsedecode.experiments.sweep import LOCK_FILE, RUNS_FILE, SPEC_FILE, SweepSpec, locked, merge_sweeps
from sparsedecode.report import write_report
from sparsedecode.selectors import select_blocks, select_support, top_blocks
from sparsedecode.speculative import generate


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def one_line_exit_2(args: list[str], capsys) -> str:
    """Run the CLI; assert exit status 2 and a single line on stderr without a traceback; return that line."""
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse errors exit instead of returning
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


class NoForward:
    """A forward pre-hook that fails the test if the model runs at all (the check must come first)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        raise AssertionError("the model ran before the arguments were checked")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# ---- types, counts and positions at the library's entry points ----


@pytest.mark.parametrize("cfg", [None, {"support": 97}, 97, "mean-pooled"])
def test_compare_refuses_a_config_that_is_not_a_sparse_config(model, cfg):
    with NoForward(model), pytest.raises(SparseDecodeError, match="config must be a SparseConfig") as error:
        compare(model, None, prompt(150), cfg, 8)
    assert "\n" not in str(error.value)
    if isinstance(cfg, dict):
        assert "SparseConfig(**settings)" in str(error.value)


@pytest.mark.parametrize(
    "ids, message",
    [
        (prompt(150)[0], "shape \\(1, length >= 1\\)"),  # 1-D
        (torch.zeros(1, 0, dtype=torch.long), "shape \\(1, length >= 1\\)"),
        (prompt(150).float(), "integer tensor"),
        (prompt(150) > 3, "integer tensor"),
        (prompt(150) + 200, "must lie in \\[0, 96\\)"),  # beyond the vocabulary
        (prompt(150) - 100, "must lie in \\[0, 96\\)"),
        ([[1, 2, 3]], "torch tensor"),
    ],
)
def test_prompt_ids_are_checked_before_the_model_runs(model, ids, message):
    cfg = SparseConfig(support=97)
    for call in (
        lambda: compare(model, None, ids, cfg, 8),
        lambda: dense_reference(model, ids, tokens=8),
        lambda: generate(model, ids, cfg, 8),
    ):
        with NoForward(model), pytest.raises(SparseDecodeError, match=message):
            call()


def test_batches_are_checked_before_the_model_runs(model):
    batch = prompt(150).repeat(2, 1)
    cfg = SparseConfig(support=97)
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match="shape \\(1, length >= 1\\)"):
            dense_reference(model, batch, tokens=8)  # one prompt; dense_references takes several
        with pytest.raises(SparseDecodeError, match="lossless generation runs one sequence at a time"):
            generate(model, batch, cfg, 8)
        with pytest.raises(SparseDecodeError, match="must lie in"):
            compare(model, None, [prompt(150), prompt(150) + 200], cfg, 8)
        with pytest.raises(SparseDecodeError, match="exceeds the model's"):
            generate(model, [prompt(150), prompt(1020)], cfg, 8, mode="sparse")


def test_positions_past_the_model_are_refused_before_decoding(model):
    limit = model.config.max_position_embeddings  # 1024
    ids = prompt(limit - 10)
    cfg = SparseConfig(support=97)
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match=f"context {limit - 10} \\+ 11 tokens exceeds the model's {limit}"):
            compare(model, None, ids, cfg, 11)
        with pytest.raises(SparseDecodeError, match="exceeds the model's"):
            dense_reference(model, ids, tokens=11)
        for mode in ("dense", "sparse", "lossless"):
            with pytest.raises(SparseDecodeError, match="exceeds the model's"):
                generate(model, ids, cfg, 11, mode=mode)
    # at the limit it runs
    assert len(dense_reference(model, prompt(limit - 4), tokens=4).tokens) == 4


@pytest.mark.parametrize("tokens", [0, 1, 2.0, "8", True, None])
def test_token_counts_must_be_integers(model, tokens):
    with NoForward(model), pytest.raises(SparseDecodeError, match="tokens must be an integer"):
        compare(model, None, prompt(150), SparseConfig(support=97), tokens)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1"),
        (dict(draft_tokens=0), "draft_tokens must be an integer >= 1"),
        (dict(draft_tokens=1.5), "draft_tokens must be an integer >= 1"),
        (dict(max_draft_tokens=0), "max_draft_tokens must be an integer >= 1"),
        (dict(cfg={"support": 97}), "config must be a SparseConfig"),
        (dict(cfg=None, mode="sparse"), "needs a SparseConfig"),
        (dict(mode="fast"), "unknown mode"),
    ],
)
def test_generate_checks_its_arguments(model, overrides, message):
    arguments = dict(cfg=SparseConfig(support=97), max_new_tokens=8, mode="lossless")
    arguments.update(overrides)
    cfg, tokens = arguments.pop("cfg"), arguments.pop("max_new_tokens")
    with NoForward(model), pytest.raises(SparseDecodeError, match=message):
        generate(model, prompt(150), cfg, tokens, **arguments)


@pytest.mark.parametrize("not_a_model", [None, "smollm2-135m", torch.nn.Linear(2, 2)])
def test_entry_points_refuse_what_is_not_a_model(not_a_model):
    cfg = SparseConfig(support=97)
    for call in (
        lambda: compare(not_a_model, None, prompt(150), cfg, 8),
        lambda: dense_reference(not_a_model, prompt(150), tokens=8),
        lambda: generate(not_a_model, prompt(150), cfg, 8),
    ):
        with pytest.raises(SparseDecodeError, match="model must be a transformers causal LM"):
            call()
    with pytest.raises(SparseDecodeError, match="model must be a transformers causal LM"):
        with sparse_decoding(not_a_model, cfg):
            pass


def test_compare_refuses_a_reference_of_another_kind(model):
    with NoForward(model), pytest.raises(SparseDecodeError, match="reference must be a DenseReference"):
        compare(model, None, prompt(150), SparseConfig(support=97), 8, reference={"tokens": [1, 2]})


@pytest.mark.parametrize("config", [{"support": 97}, 97, "mean-pooled"])
def test_sparse_decoding_refuses_a_dict_or_other_config_at_entry(model, config):
    with pytest.raises(SparseDecodeError, match="config must be a SparseConfig"):
        with sparse_decoding(model, config):
            pass
    assert model.config._attn_implementation == "sdpa"  # nothing was switched on


def test_sparse_decoding_names_an_unknown_override(model):
    with pytest.raises(SparseDecodeError, match="unknown SparseConfig field\\(s\\) suport"):
        with sparse_decoding(model, suport=97):
            pass
    with sparse_decoding(model, support=97) as session:  # known fields still work
        assert session.config.support == 97


# ---- non-finite queries and keys never select silently ----


@pytest.mark.parametrize("method", ["mean-pooled", "quest", "oracle-blocks", "oracle-tokens", "h2o", "streaming"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["queries", "keys"])
def test_select_support_refuses_non_finite_queries_or_keys(method, bad, where):
    generator = torch.Generator().manual_seed(0)
    tensors = {"queries": torch.randn(4, 16, generator=generator), "keys": torch.randn(2, 400, 16, generator=generator)}
    if where == "queries":
        tensors["queries"][1, 3] = bad
    else:
        tensors["keys"][0, 37, 5] = bad
    with pytest.raises(SparseDecodeError, match=f"{where} hold NaN or infinite values"):
        select_support(tensors["queries"], tensors["keys"], support=97, method=method)


def test_all_nan_queries_no_longer_pick_the_first_blocks():
    keys = torch.randn(2, 400, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SparseDecodeError, match="queries hold NaN"):
        select_support(torch.full((4, 16), float("nan")), keys, support=97)


@pytest.mark.parametrize(
    "queries, keys",
    [
        ("not a tensor", torch.randn(2, 400, 16)),
        (torch.randn(4, 16), [[0.0]]),
        (torch.ones(4, 16, dtype=torch.long), torch.randn(2, 400, 16)),
        (torch.randn(4, 16), torch.randn(2, 0, 16)),
        (torch.randn(4, 16), torch.randn(0, 400, 16)),
    ],
)
def test_select_support_refuses_wrong_kinds_of_tensors(queries, keys):
    with pytest.raises(SparseDecodeError):
        select_support(queries, keys, support=97)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_top_blocks_refuses_non_finite_scores_when_it_chooses(bad):
    scores = torch.randn(2, 20)
    scores[1, 4] = bad
    with pytest.raises(SparseDecodeError, match="scores hold NaN or infinite"):
        top_blocks(scores, 5)
    assert top_blocks(scores, 20).shape == (2, 20)  # everything is kept: nothing to choose


@pytest.mark.parametrize("kernel", ["torch", "c"])
def test_the_decode_step_refuses_a_nan_query_on_every_selection_path(kernel):
    from sparsedecode.centroids import BlockCentroids
    from sparsedecode.cpu_kernel import library
    from sparsedecode.selectors import BlockLayout

    if kernel == "c" and library() is None:
        pytest.skip("no C compiler here: the C kernel path does not exist")
    cfg = SparseConfig(support=97, kernel=kernel)
    keys = torch.randn(2, 400, 16)
    queries = torch.randn(4, 16)
    queries[2, 0] = float("nan")
    layout = BlockLayout(n=400, window=cfg.window, block_size=cfg.block_size)
    with pytest.raises(SparseDecodeError, match="NaN or infinite"):
        select_blocks(cfg, BlockCentroids(cfg.block_size, ("mean",)), queries, keys, layout, scale=0.25)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["full block", "tail block"])
@pytest.mark.parametrize("kernel", ["torch", "c"])
def test_a_non_finite_key_in_a_scored_block_refuses_on_every_selection_path(kernel, where, bad):
    """A finite query and one non-finite key in the distant region: the torch path's score check and the C kernel's
    check inside its scoring both refuse, whether the key lies in a cached full block or in the short tail block."""
    from sparsedecode.centroids import BlockCentroids
    from sparsedecode.cpu_kernel import library
    from sparsedecode.selectors import BlockLayout

    if kernel == "c" and library() is None:
        pytest.skip("no C compiler here: the C kernel path does not exist")
    cfg = SparseConfig(support=97, kernel=kernel)
    n = 407  # distant region [1, 343): 21 full blocks and a tail block of 6
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    assert layout.n_blocks == layout.n_full + 1
    keys = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(3))
    position = 1 + 5 * cfg.block_size + 3 if where == "full block" else layout.distant_end - 2
    keys[1, position, 7] = bad
    queries = torch.randn(4, 16)
    fine = keys.clone()
    fine[1, position, 7] = 0.0
    select_blocks(cfg, BlockCentroids(cfg.block_size, ("mean",)), queries, fine, layout, scale=0.25)  # finite: runs
    with pytest.raises(SparseDecodeError, match="scores hold NaN or infinite"):
        select_blocks(cfg, BlockCentroids(cfg.block_size, ("mean",)), queries, keys, layout, scale=0.25)


@pytest.mark.parametrize("kernel", ["torch", "c", "auto"])
@pytest.mark.parametrize("selector", ["mean-pooled", "quest", "oracle-tokens"])
@pytest.mark.parametrize("poison", ["q_proj", "k_proj"])
def test_non_finite_hidden_states_raise_in_compare_instead_of_selecting(kernel, selector, poison):
    """A model whose queries (or keys) are NaN from layer 0 on: dense prefill runs, the first sparse step refuses."""
    model = tiny_model("llama")
    with torch.no_grad():
        getattr(model.model.layers[0].self_attn, poison).weight[0, 0] = float("nan")
    with pytest.raises(SparseDecodeError, match="NaN or infinite"):
        compare(model, None, prompt(150), SparseConfig(support=97, selector=selector, kernel=kernel), 4)


# ---- models: unknown paths and an unreachable hub fail at once, without the hub's retries ----


def refuse_hub(monkeypatch):
    """Record every from_pretrained; fail the test if one would ask the hub (not only the local cache)."""
    calls = []

    def load(path, dtype, **kwargs):
        calls.append((str(path), kwargs.get("local_files_only", False)))
        if not kwargs.get("local_files_only"):
            raise AssertionError(f"asked the hub for {path}")
        raise OSError(f"{path} is not in the cache")

    monkeypatch.setattr(models, "_load_pretrained", load)
    return calls


@pytest.mark.parametrize("spec", ["./nope", "../nope/model", "nope/", "a/b/c", "~/no-such-model-dir"])
def test_an_unknown_relative_path_never_asks_the_hub(tmp_path, monkeypatch, spec, capsys):
    monkeypatch.chdir(tmp_path)
    calls = refuse_hub(monkeypatch)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: pytest.fail("probed the hub"))
    with pytest.raises(SparseDecodeError, match="unknown model .*no file or directory") as error:
        models.load_model(spec)
    assert "\n" not in str(error.value) and calls == []
    err = one_line_exit_2(["run", "--model", spec], capsys)
    assert "no file or directory" in err


def test_an_owner_name_spec_with_the_hub_unreachable_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = refuse_hub(monkeypatch)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: "no connection to the hub: test")
    with pytest.raises(SparseDecodeError, match="the hub is not reachable \\(no connection to the hub: test\\)") as e:
        models.load_model("nope/model")
    assert "\n" not in str(e.value) and "no file or directory" in str(e.value)
    assert calls == [("nope/model", True)], "only the local hub cache was asked"
    err = one_line_exit_2(["run", "--model", "nope/model"], capsys)
    assert "not reachable" in err


def test_hub_unreachable_answers_offline_mode_and_refused_connections_without_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import socket

    with socket.socket() as closed:  # a local port nobody listens on: the connection is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    reason = models.hub_unreachable(timeout=2.0)
    assert reason is not None and reason.startswith("no connection to 127.0.0.1")
    with socket.socket() as server:  # and one that listens: reachable
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert models.hub_unreachable(timeout=2.0) is None


# ---- corpora: binary, non-UTF-8 and empty files are refused ----


@pytest.mark.parametrize(
    "content, message",
    [
        (b"some text\x00\x01\x02 and more", "is binary \\(a NUL byte at offset 9\\)"),
        (b"caf\xe9 au lait, " * 20, "is not UTF-8 text \\(byte 0xe9 at offset 3\\)"),
        (b"", "holds no text"),
        (b"  \n\t\n", "holds no text"),
    ],
)
def test_binary_or_empty_corpus_files_are_refused(tmp_path, content, message):
    path = tmp_path / "corpus.bin"
    path.write_bytes(content)
    with pytest.raises(SparseDecodeError, match=message):
        load_text(str(path))
    with pytest.raises(SparseDecodeError, match=message):
        check_corpus(str(path))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text " if content.strip() else "")
    (folder / "bad.txt").write_bytes(content)
    if content.strip():
        with pytest.raises(SparseDecodeError, match="bad.txt"):
            load_text(str(folder))
    else:
        with pytest.raises(SparseDecodeError, match="holds no text"):
            load_text(str(folder))


def test_a_device_file_is_not_a_corpus():
    with pytest.raises(SparseDecodeError, match="not a regular file"):
        load_text("/dev/null")


def test_utf8_text_still_loads(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("café au lait, naïve résumé\n" * 3, encoding="utf-8")
    assert load_text(str(path)).startswith("café")


def test_cli_refuses_a_binary_corpus_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 16)
    out = tmp_path / "never.json"
    args = ["--model", str(tiny_model_dir), "--corpus", str(binary), "--context", "150", "--tokens", "4"]
    err = one_line_exit_2(["run", *args, "--json", str(out)], capsys)
    assert "is binary" in err and not out.exists()
    sweep_out = tmp_path / "sweep"
    err = one_line_exit_2(["sweep", *args, "--support", "97", "--prompts", "1", "--out", str(sweep_out)], capsys)
    assert "is binary" in err and not sweep_out.exists()


# ---- merge and sweep refusals leave no lock file or folder behind ----


def sweep_folder(path: Path, **overrides) -> Path:
    settings = dict(model="tiny", contexts=(150,), supports=(97,), prompts=1, tokens=10)
    settings.update(overrides)
    path.mkdir(parents=True)
    (path / SPEC_FILE).write_text(json.dumps({"spec": SweepSpec(**settings).to_dict(), "sessions": []}))
    (path / RUNS_FILE).write_text("")
    return path


def test_a_refused_merge_leaves_nothing_behind(tmp_path, capsys):
    a, b = sweep_folder(tmp_path / "a"), sweep_folder(tmp_path / "b", tokens=8)
    out = tmp_path / "deep" / "merged"
    with pytest.raises(SparseDecodeError, match="settings differ"):
        merge_sweeps([a, b], out)
    assert not (tmp_path / "deep").exists()
    err = one_line_exit_2(["merge", str(a), str(b), "--out", str(out)], capsys)
    assert "settings differ" in err and not (tmp_path / "deep").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    one_line_exit_2(["merge", str(a), str(b), "--out", str(existing)], capsys)
    assert existing.is_dir() and list(existing.iterdir()) == []  # kept (it was there), and no .lock inside
    assert sorted(p.name for p in a.iterdir()) == [RUNS_FILE, SPEC_FILE]


def test_a_merge_that_succeeds_leaves_no_lock_file(tmp_path):
    a = sweep_folder(tmp_path / "a")
    merge_sweeps([a], tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [RUNS_FILE, SPEC_FILE]


def test_locked_removes_its_lock_and_the_folders_it_made_on_failure(tmp_path):
    target = tmp_path / "x" / "y"
    with pytest.raises(RuntimeError), locked(target):
        assert (target / LOCK_FILE).exists()
        raise RuntimeError("refused")
    assert not (tmp_path / "x").exists()
    with pytest.raises(RuntimeError), locked(target):
        (target / "kept.txt").write_text("work done before the failure")
        raise RuntimeError("refused later")
    assert sorted(p.name for p in target.iterdir()) == ["kept.txt"]  # not empty: kept, minus the lock file
    with locked(target):
        with pytest.raises(SparseDecodeError, match="another process"), locked(target):
            pass
        assert (target / LOCK_FILE).exists(), "a refused second writer must not remove the holder's lock"
    assert not (target / LOCK_FILE).exists()


# ---- report: malformed input files give one line naming the file, and no partial output ----

RETRIEVAL_SPEC = {
    "model": "tiny",
    "dtype": "float32",
    "haystack": "filler",
    "contexts": [256],
    "depths": [0.5],
    "trials": 1,
    "digits": 5,
    "seed": 0,
    "answer_tokens": 8,
    "supports": [97],
    "window": 64,
    "block_size": 16,
    "reuse": 1,
    "selector": "mean-pooled",
}
TRIAL = {
    "mode": "dense",
    "support": None,
    "context": 256,
    "depth": 0.5,
    "trial": 0,
    "correct": True,
    "captured_mass_ratio_mean": None,
    "needle_read_mean": None,
}


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        ("[1, 2, 3]", "is not a retrieval result"),
        ('{"spec": {}}', "is not a retrieval result"),
        ('{"spec": [], "trials": []}', "is not a retrieval result"),
        (json.dumps({"spec": RETRIEVAL_SPEC, "trials": [1, 2]}), "a trial that is not a JSON object"),
        (json.dumps({"spec": RETRIEVAL_SPEC, "trials": [{"mode": "dense"}]}), "a field 'support' is missing"),
        (json.dumps({"spec": {"model": "tiny"}, "trials": []}), "a field 'dtype' is missing"),
        (
            json.dumps({"spec": RETRIEVAL_SPEC, "trials": [dict(TRIAL, correct="yes")]}),
            "does not hold what a report needs",
        ),
    ],
)
def test_a_malformed_retrieval_json_is_one_line_naming_it(tmp_path, capsys, content, message):
    path = tmp_path / "retrieval.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SparseDecodeError, match=message) as error:
        write_report(tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    err = one_line_exit_2(["report", str(tmp_path)], capsys)
    assert str(path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retrieval.json"], "nothing half-written"


@pytest.mark.parametrize(
    "spec_text, runs_text, message",
    [
        ("{broken", "", "sweep.json is not a valid sweep description"),
        ("[]", "", "sweep.json is not a valid sweep description \\(not a JSON object\\)"),
        ('{"sessions": []}', "", "sweep.json is not a valid sweep description \\(missing 'spec'\\)"),
        ('{"spec": {"model": "m", "supports": [50]}}', "", "sweep.json is not a valid sweep description \\(support 50"),
        ('{"spec": {"bogus": 1}}', "", "sweep.json is not a valid sweep description"),
        (None, "{not json\n", "runs.jsonl line 1 is not valid JSON"),
        (None, "[1, 2]\n", "runs.jsonl line 1 is not a JSON object"),
        (None, '{"context": 150}\n', "runs.jsonl run 1: a row of the old first_divergence convention lacks its token"),
        (None, '{"context": 150, "first_divergence_convention": 2}\n', "runs.jsonl does not hold what a report needs"),
    ],
)
def test_a_malformed_sweep_folder_is_one_line_naming_the_file(tmp_path, capsys, spec_text, runs_text, message):
    folder = sweep_folder(tmp_path / "s")
    if spec_text is not None:
        (folder / SPEC_FILE).write_text(spec_text)
    (folder / RUNS_FILE).write_text(runs_text)
    with pytest.raises(SparseDecodeError, match=message) as error:
        write_report(folder)
    assert "\n" not in str(error.value)
    one_line_exit_2(["report", str(folder)], capsys)
    assert sorted(p.name for p in folder.iterdir()) == [RUNS_FILE, SPEC_FILE], "nothing half-written"
