"""The passkey retrieval probe: prompt construction, dense vs full-support sparse, audit fields, summaries."""

from __future__ import annotations

import json

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseConfig, SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.decoding.loop import prefill
from sparsedecode.experiments.retrieval import (
    NEEDLE,
    QUESTION,
    RetrievalSpec,
    accuracy,
    answer,
    build_prompt,
    mass_vs_success,
    passkey,
    run_retrieval,
    trial_prompt,
)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("llama"), char_tokenizer()


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_lands_at_the_requested_depth(depth):
    tokenizer = char_tokenizer()
    key = passkey(0, 0)
    prompt = build_prompt(tokenizer, 900, depth, key)
    ids = prompt.ids[0].tolist()
    assert len(ids) == prompt.context == 900
    assert tokenizer.decode(ids[prompt.needle_start : prompt.needle_end]) == NEEDLE.format(key=key)
    assert tokenizer.decode(ids[prompt.question_start :]).endswith(QUESTION.strip())  # no newline in the char vocab
    longest_sentence = 23  # characters, so tokens, of the longest filler sentence; the haystack is > 600 tokens
    assert abs(prompt.needle_depth - depth) <= longest_sentence / 600
    if depth == 0.0:
        assert prompt.needle_depth == 0.0
    if depth == 1.0:
        assert prompt.needle_end == prompt.question_start, "depth 1 sits right before the question"


def test_corpus_haystack_places_the_needle_at_the_token():
    tokenizer = char_tokenizer()
    prompt = build_prompt(tokenizer, 800, 0.5, "12345", haystack="python-docs")
    assert prompt.context == 800 and abs(prompt.needle_depth - 0.5) < 1 / 500
    assert "12345" in tokenizer.decode(prompt.ids[0, prompt.needle_start : prompt.needle_end].tolist())


def test_trials_past_the_end_of_a_corpus_read_other_text(tmp_path):
    """Found by probing a corpus of 1774 tokens at context 600: trial 3's haystack started past the corpus' end and
    went back to token 0, the very text of trial 0 (only the passkey differed); it now wraps around instead."""
    words = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "light", "sound")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words[(i * 7 + i // 3) % len(words)] for i in range(300)))
    tokenizer = char_tokenizer()
    hays = []
    for trial in range(4):
        prompt = trial_prompt(tokenizer, 600, 0.0, trial, haystack=str(corpus))
        assert prompt.context == 600
        hays.append(tuple(prompt.ids[0, prompt.needle_end : prompt.question_start].tolist()))
    assert len(set(hays)) == 4, "every trial reads its own stretch of the corpus"


def test_passkeys_are_fixed_by_seed_and_trial():
    assert passkey(0, 1) == passkey(0, 1) and len(passkey(0, 1, digits=7)) == 7
    assert len({passkey(0, t) for t in range(20)}) > 15 and passkey(1, 0) != passkey(0, 0)


def test_passkeys_longer_than_str_converts_are_whole():
    """``--digits 100000`` was a traceback (str() of an int of more than 4300 digits); the digits are as before."""
    import random

    key = passkey(3, 2, digits=100_000)
    assert len(key) == 100_000 and key[0] != "0" and key.isdigit()
    value = random.Random("passkey-3-2").randint(10**99_999, 10**100_000 - 1)
    assert int(key[-1000:]) == value % 10**1000 and key[:4] != "0000"
    assert passkey(0, 1, digits=4300) == str(random.Random("passkey-0-1").randint(10**4299, 10**4300 - 1))


def test_full_support_answers_like_dense_and_small_support_is_audited(loaded):
    model, tokenizer = loaded
    prompt = build_prompt(tokenizer, 400, 0.5, passkey(0, 0))
    cache, _ = prefill(model, prompt.ids[:, : prompt.question_start])
    dense = answer(model, tokenizer, prompt, cache, None)
    full = answer(model, tokenizer, prompt, cache, SparseConfig(support=1 + 64 + 16 * 30))
    small = answer(model, tokenizer, prompt, cache, SparseConfig(support=97))
    assert cache.get_seq_length() == prompt.question_start, "cache cropped back after each answer"
    assert full["answer_ids"] == dense["answer_ids"] and full["sparse_steps"] == 0
    assert dense["captured_mass_ratio_mean"] is None and full["captured_mass_ratio_mean"] is None
    questions = prompt.context - prompt.question_start
    assert small["sparse_steps"] == (questions + 8 - 1) * 2  # every question and answer step, both layers
    for name in ("captured_mass_ratio_mean", "omitted_mass_mean", "needle_read_mean", "needle_mass_mean"):
        assert 0.0 <= small[name] <= 1.0 + 1e-12, name
    again = answer(model, tokenizer, prompt, cache, None)
    assert again["answer_ids"] == dense["answer_ids"], "deterministic"


def test_answer_refuses_a_cache_of_another_length(loaded):
    """Found by probing ``answer`` with a cache 5 positions short of the question: it answered that other prompt
    silently (another answer), then "cropped" the cache to a length it never had; a one-line error now."""
    model, tokenizer = loaded
    prompt = build_prompt(tokenizer, 300, 0.5, passkey(0, 0))
    for length in (prompt.question_start - 5, prompt.context):
        cache, _ = prefill(model, prompt.ids[:, :length])
        with pytest.raises(SparseDecodeError, match=f"holds {length} positions, not the prompt's"):
            answer(model, tokenizer, prompt, cache, None)


class _Answers:
    """The char tokenizer, except that every decoded answer reads ``text``."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    def decode(self, ids, **kwargs) -> str:
        return self.text

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize(
    ("text", "correct"),
    [(" 40213. Remember", True), ("key:40213", True), (" 402135.", False), (" 140213", False), (" 040213", False)],
)
def test_a_passkey_inside_a_longer_number_is_no_success(loaded, text, correct):
    """An answer of another, longer number that holds the passkey's digits (``402135`` for ``40213``) was counted a
    success (a bare substring test); the passkey must stand as a whole number."""
    model, tokenizer = loaded
    prompt = build_prompt(tokenizer, 300, 0.5, "40213")
    cache, _ = prefill(model, prompt.ids[:, : prompt.question_start])
    result = answer(model, _Answers(tokenizer, text), prompt, cache, None, answer_tokens=2)
    assert result["answer"] == text and result["correct"] is correct


def test_run_retrieval_grid_and_summaries(loaded):
    spec = RetrievalSpec(model="tiny", contexts=(300,), depths=(0.0, 1.0), trials=2, supports=(97,), answer_tokens=4)
    trials = run_retrieval(spec, loaded=loaded)
    assert len(trials) == 1 * 2 * 2 * 2  # contexts x depths x trials x (dense + supports)
    assert [(t["mode"], t["selector"]) for t in trials[:2]] == [("dense", None), ("sparse", "mean-pooled")]
    table = accuracy(trials)
    assert [row["mode"] for row in table] == ["dense", "dense", "S=97", "S=97"]
    assert all(row["trials"] == 2 for row in table)
    synthetic = [
        {"mode": "dense", "support": None, "context": 1, "depth": 0.0, "trial": 0, "correct": True},
        {"mode": "dense", "support": None, "context": 1, "depth": 0.0, "trial": 1, "correct": False},
        *[
            {
                "mode": "sparse",
                "support": 97,
                "context": 1,
                "depth": 0.0,
                "trial": t,
                "correct": ok,
                "captured_mass_ratio_mean": mass,
                "needle_read_mean": read,
            }
            for t, ok, mass, read in [(0, False, 0.95, 0.0), (1, False, 0.5, 0.2)]
        ],
    ]
    (row,) = mass_vs_success(synthetic)
    assert row["accuracy"] == 0.0 and row["failed_with_high_mass"] == 1 and row["failed_where_dense_succeeded"] == 1
    # a float64 mean of 0.95 and 0.5: round-off ~1e-16, far inside approx's default 1e-6 relative
    assert row["captured_mass_failed_mean"] == pytest.approx(0.725) and row["captured_mass_correct_mean"] is None


def test_a_context_too_short_is_refused_before_any_trial(loaded):
    """Found by probing ``--context 300,100``: the grid ran every trial of context 300, then failed on context 100's
    too-short prompt, losing those results (retrieval.json is written at the end); every prompt is now built first."""
    spec = RetrievalSpec(model="tiny", contexts=(300, 100), depths=(0.0,), trials=1, supports=(97,), answer_tokens=2)
    done = []
    with pytest.raises(SparseDecodeError, match="context 100 is too short"):
        run_retrieval(spec, loaded=loaded, on_trial=done.append)
    assert done == [], "no trial runs before the grid's prompts are all known to fit"


def test_the_report_states_the_whole_number_rule():
    """The report's conditions said "success = the passkey digits appear in the answer", the bare substring test
    that scoring no longer is (``402135`` is no answer for ``40213``); found by hunt-probes reading a report."""
    from sparsedecode.reports.retrieval import _conditions_lines

    text = "\n".join(_conditions_lines(RetrievalSpec(model="m").to_dict(), {}, None))
    assert "as a whole number" in text and "digits appear in the answer" not in text


def test_bad_retrieval_input():
    tokenizer = char_tokenizer()
    with pytest.raises(SparseDecodeError, match="too short"):
        build_prompt(tokenizer, 100, 0.5, "12345")
    with pytest.raises(SparseDecodeError, match="depths"):
        RetrievalSpec(model="m", depths=(1.5,))
    with pytest.raises(SparseDecodeError):
        RetrievalSpec(model="m", supports=(10,))


def test_cli_probe_retrieval_then_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "retrieval"
    args = ["probe", "retrieval", "--model", str(tiny_model_dir), "--context", "300", "--depths", "0,1"]
    assert main([*args, "--trials", "1", "--support", "97", "--answer-tokens", "3", "--out", str(out)]) == 0
    data = json.loads((out / "retrieval.json").read_text())
    assert len(data["trials"]) == 4 and data["spec"]["depths"] == [0.0, 1.0] and "--depths 0,1" in data["command"]
    assert "passkey exact-match accuracy" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "Passkey retrieval" in report and "Captured attention mass vs retrieval" in report
    for name in ("retrieval_dense.png", "retrieval_s97.png", "mass_vs_retrieval.png", "retrieval_accuracy.csv"):
        assert (out / name).exists(), name
    assert "What these numbers do not establish" in report


def test_trials_dense_by_construction_are_no_sparse_result(tiny_model_dir, tmp_path, capsys):
    """Found by probing: at a context whose question and answer fit the support, the sparse trials took no sparse
    step, yet counted in the support's trials and accuracy (a support dense at short contexts gained accuracy)."""
    out = tmp_path / "retrieval"
    args = ["probe", "retrieval", "--model", str(tiny_model_dir), "--context", "250,400", "--depths", "0"]
    args += ["--trials", "1", "--support", "257", "--answer-tokens", "3", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    trials = json.loads((out / "retrieval.json").read_text())["trials"]
    sparse = [t for t in trials if t["mode"] == "sparse"]
    assert sorted(t["sparse_steps"] > 0 for t in sparse) == [False, True]  # context 250 fits S = 257
    (row,) = mass_vs_success(trials)
    assert (row["trials"], row["dense_by_construction"]) == (1, 1)
    marked = {t["context"]: t["dense_by_construction"] for t in accuracy(trials) if t["mode"] == "S=257"}
    assert marked == {250: True, 400: False}
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "(dense)" in report and "1 sparse trial(s) dense by construction" in report
