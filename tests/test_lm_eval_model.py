"""sparsedecode as an lm-evaluation-harness model, offline on local tasks: against lm-eval's own ``hf`` model loaded
from the same weights, and on the RULER-style tasks exported by ``sparsedecode eval --export``."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseDecodeError

pytestmark = pytest.mark.xdist_group("lm-eval")  # one parallel worker builds the module's fixtures

DOC = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 4
).strip()  # 359 characters: every token of the rolling window past S = 97 is scored by a sparse step


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        logging.getLogger("lm-eval").setLevel(logging.ERROR)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with the char tokenizer; lm-eval needs an end-of-text token, so ``<unk>`` serves as one."""
    path = tmp_path_factory.mktemp("tiny-llama-lm-eval")
    tiny_model("llama").save_pretrained(path)
    tokenizer = char_tokenizer()
    tokenizer.eos_token = "<unk>"
    tokenizer.save_pretrained(path)
    return path


def _yaml(name: str, data, body: list[str]) -> str:
    head = [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data))}",
    ]
    return "\n".join([*head, "test_split: test", *body, "metadata:", "  version: 1.0", ""])


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """Three local tasks: multiple choice (loglikelihood), short generation, and a rolling-perplexity document."""
    path = tmp_path_factory.mktemp("lm-eval-tasks")
    docs = [
        {"question": "The sky is", "choices": ["blue", "green", "red"], "label": 0},
        {"question": "Grass is", "choices": ["purple", "green", "loud"], "label": 1},
        {"question": "Two plus two is", "choices": ["three", "five", "four"], "label": 2},
    ]
    (path / "qa.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (path / "doc.jsonl").write_text(json.dumps({"text": DOC}) + "\n")
    question = ['doc_to_text: "Question: {{question}} Answer:"']
    (path / "tiny_mc.yaml").write_text(
        _yaml(
            "tiny_mc",
            path / "qa.jsonl",
            [
                "output_type: multiple_choice",
                *question,
                "doc_to_choice: choices",
                "doc_to_target: label",
                "metric_list:",
                "  - metric: acc",
                "    higher_is_better: true",
            ],
        )
    )
    (path / "tiny_gen.yaml").write_text(
        _yaml(
            "tiny_gen",
            path / "qa.jsonl",
            [
                "output_type: generate_until",
                *question,
                'doc_to_target: "{{choices[label]}}"',
                "generation_kwargs:",
                '  until: ["."]',
                "  max_gen_toks: 10",
                "  do_sample: false",
                "metric_list:",
                "  - metric: exact_match",
                "    aggregation: mean",
                "    higher_is_better: true",
            ],
        )
    )
    (path / "tiny_ppl.yaml").write_text(
        _yaml(
            "tiny_ppl",
            path / "doc.jsonl",
            [
                "output_type: loglikelihood_rolling",
                'doc_to_text: ""',
                'doc_to_target: "{{text}}"',
                "metric_list:",
                "  - metric: word_perplexity",
                "  - metric: byte_perplexity",
                "  - metric: bits_per_byte",
            ],
        )
    )
    return path


def evaluate(model: str, model_args: str, tasks: list[str], include_path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from sparsedecode.integrations.lm_eval import register

    register()
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(include_path), include_defaults=False, verbosity="ERROR"),
        log_samples=True,
        device="cpu",
    )


def responses(result: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def loglikelihoods(result: dict, task: str) -> list[tuple[float, bool]]:
    return [
        tuple(r[0]) if isinstance(r[0], (list, tuple)) else (r[0], None) for rs in responses(result, task) for r in rs
    ]


TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]


@pytest.fixture(scope="module")
def hf(model_dir, tasks_dir):
    return evaluate("hf", f"pretrained={model_dir},dtype=float32", TASKS, tasks_dir)


def test_full_support_gives_the_hf_models_results(model_dir, tasks_dir, hf):
    sparse = evaluate("sparsedecode", f"pretrained={model_dir},support=100001", TASKS, tasks_dir)
    assert responses(sparse, "tiny_gen") == responses(hf, "tiny_gen")
    for task in ("tiny_mc", "tiny_ppl"):
        mine, theirs = loglikelihoods(sparse, task), loglikelihoods(hf, task)
        assert len(mine) == len(theirs) == (9 if task == "tiny_mc" else 1)
        assert [m[1] for m in mine] == [t[1] for t in theirs], "is-greedy flags equal"
        # a log-likelihood sums m token log-probs, each within twice the logits' round-off (2.6e-6 by
        # conftest.logits_tolerance): at most 5e-6 * m, below 2e-4 for the short choices and below 1e-5 relative
        # for the 359-token document (|log-likelihood| > 359)
        assert [m[0] for m in mine] == pytest.approx([t[0] for t in theirs], abs=2e-4, rel=1e-5)
    for task in TASKS:
        for metric, value in hf["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                # metrics from those log-likelihoods (perplexities: exp of their mean): 1e-4 relative covers it
                assert sparse["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)
    assert sparse["config"]["model_args"].startswith(f"pretrained={model_dir}")


def test_small_support_departs_on_the_long_document(model_dir, tasks_dir, hf):
    sparse = evaluate("sparsedecode", f"pretrained={model_dir},support=97", ["tiny_ppl"], tasks_dir)
    (mine,), (theirs,) = loglikelihoods(sparse, "tiny_ppl"), loglikelihoods(hf, "tiny_ppl")
    assert abs(mine[0] - theirs[0]) > 1e-2, "359 tokens scored with 97 of them in the support is not dense"


def test_exported_eval_tasks_run_the_same_samples_by_both_routes(model_dir, tmp_path):
    from sparsedecode import load_model
    from sparsedecode.experiments.evaluate import DENSE, EvalSpec, run_eval
    from sparsedecode.experiments.lm_eval_tasks import TAG, export_tasks, task_name
    from sparsedecode.experiments.sweep import parse_rows

    spec = EvalSpec(
        model=str(model_dir), tasks=("niah_single_noise",), contexts=(700,), samples=2, supports=(97,), answer_tokens=8
    )
    loaded = load_model(str(model_dir))
    exported = export_tasks(spec, loaded[1], tmp_path / "export")
    name = task_name("niah_single_noise", 700)
    assert exported.tasks == [name] and (tmp_path / "export" / f"{name}.yaml").exists()
    run_eval(spec, tmp_path / "eval", loaded=loaded)
    rows = parse_rows(tmp_path / "eval" / "runs.jsonl")
    dense = [r["output"] for r in sorted((r for r in rows if r["selector"] == DENSE), key=lambda r: r["sample"])]
    hf = evaluate("hf", f"pretrained={model_dir},dtype=float32", [TAG], tmp_path / "export")
    full = evaluate("sparsedecode", f"pretrained={model_dir},support=100001", [TAG], tmp_path / "export")
    small = evaluate("sparsedecode", f"pretrained={model_dir},support=97", [TAG], tmp_path / "export")
    docs = [json.loads(line) for line in (tmp_path / "export" / f"{name}.jsonl").read_text().splitlines()]
    for result in (hf, full):
        samples = sorted(result["samples"][name], key=lambda s: s["doc_id"])
        assert [s["arguments"][0][0] for s in samples] == [d["input"] for d in docs], "the exported prompt, verbatim"
        assert [s["resps"][0][0] for s in samples] == dense, "lm-eval's hf model answers as eval's dense runs"
    assert responses(small, name) != responses(hf, name), "with S = 97 sparse decoding departs at 700 tokens"
    score = hf["results"][name]["string_match_all,none"]
    assert score == pytest.approx(sum(r["score"] for r in rows if r["selector"] == DENSE) / 2)  # a mean of 2 shares


def test_registration_and_refusals(model_dir):
    from lm_eval.api.registry import get_model

    from sparsedecode.integrations.lm_eval import SparseDecodeLM, register

    register()
    register()  # twice is harmless
    assert get_model("sparsedecode") is SparseDecodeLM and get_model("hf").__name__ == "HFLM"
    with pytest.raises(SparseDecodeError, match="batch_size 1"):
        SparseDecodeLM(pretrained=str(model_dir), batch_size=4)
    with pytest.raises(SparseDecodeError, match="sparse_tail"):
        SparseDecodeLM(pretrained=str(model_dir), sparse_tail=-1)
    with pytest.raises(SparseDecodeError, match="unknown selector"):
        SparseDecodeLM(pretrained=str(model_dir), selector="nope")
    lm = SparseDecodeLM(pretrained=str(model_dir), support=97, device="cpu")
    import torch

    with pytest.raises(SparseDecodeError, match="greedily"):
        lm._model_generate(torch.tensor([[5, 6, 7]]), max_length=8, stop=[], do_sample=True)
    short = SparseDecodeLM(pretrained=str(model_dir), support=97, device="cpu", max_length=16)
    too_long = list(range(5, 22))  # max_length + 1 tokens: no context token left (found by probing: a tensor error)
    with pytest.raises(SparseDecodeError, match="more than max_length"):
        short._loglikelihood_tokens([(None, [3, 4], too_long)])
    assert len(short._loglikelihood_tokens([(None, [3, 4], too_long[:-1])])) == 1  # max_length tokens: scored
    assert lm.get_model_info()["sparse_config"]["support"] == 97


def test_the_thin_command_line_entry(model_dir, tasks_dir, tmp_path):
    from sparsedecode.cli.eval import run_lm_eval

    out = tmp_path / "results"
    args = ["--model", "sparsedecode", "--model_args", f"pretrained={model_dir},support=100001", "--tasks", "tiny_gen"]
    # no --device: lm-eval then asks for cuda:0, which a machine without CUDA answers with the CPU, as lm-eval's own
    # HF model does (this used to end in a traceback: "Torch not compiled with CUDA enabled")
    code = run_lm_eval([*args, "--include_path", str(tasks_dir), "--output_path", str(out)])
    assert code == 0
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1 and "tiny_gen" in json.loads(written[0].read_text())["results"]


def test_the_device_falls_back_as_lm_evals_own_model_does(capsys):
    import torch

    from sparsedecode.integrations.lm_eval import _device

    assert _device("cpu") == torch.device("cpu") and capsys.readouterr().err == ""
    fallback = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert _device(None) == fallback and capsys.readouterr().err == ""
    assert _device("cuda:99") == fallback
    assert "device 'cuda:99' is not available here" in capsys.readouterr().err


@pytest.mark.realmodel
def test_real_model_alias_against_lm_evals_hf_model(smollm2, tasks_dir, tmp_path):
    """The issue's check on the default model: ``pretrained=smollm2-135m`` (our alias) at full support gives what
    lm-eval's ``hf`` model gives from the same weights (the converted safetensors in our cache); at S = 97 a
    document of ~190 tokens is scored by sparse steps past position 97 (about 95 of them) and the perplexity
    departs."""
    from sparsedecode.models.catalog import cache_dir

    # the smollm2 fixture has fetched and converted it once (cached)
    weights = cache_dir() / "models" / "smollm2-135m"
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": " ".join([DOC] * 2)}) + "\n")
    body = ["output_type: loglikelihood_rolling", 'doc_to_text: ""', 'doc_to_target: "{{text}}"']
    body += ["metric_list:", "  - metric: word_perplexity"]
    (tmp_path / "long_ppl.yaml").write_text(_yaml("long_ppl", tmp_path / "long.jsonl", body))
    for name in ("tiny_mc.yaml", "tiny_gen.yaml", "qa.jsonl"):
        (tmp_path / name).write_text((tasks_dir / name).read_text().replace(str(tasks_dir), str(tmp_path)))
    tasks = ["tiny_mc", "tiny_gen", "long_ppl"]
    hf = evaluate("hf", f"pretrained={weights},dtype=float32", tasks, tmp_path)
    full = evaluate("sparsedecode", "pretrained=smollm2-135m,support=100001", tasks, tmp_path)
    small = evaluate("sparsedecode", "pretrained=smollm2-135m,support=97", tasks, tmp_path)
    assert responses(full, "tiny_gen") == responses(hf, "tiny_gen")
    for (a, a_greedy), (b, b_greedy) in zip(loglikelihoods(full, "tiny_mc"), loglikelihoods(hf, "tiny_mc")):
        # SmolLM2 logits (up to ~40) move by ~1e-4 between batchings (conftest.roundoff_tolerance); a short
        # choice's log-likelihood by a few times that
        assert a == pytest.approx(b, abs=1e-3) and a_greedy == b_greedy
    ppl = {name: r["results"]["long_ppl"]["word_perplexity,none"] for name, r in (("hf", hf), ("full", full))}
    assert ppl["full"] == pytest.approx(ppl["hf"], rel=1e-4)  # exp of a mean NLL, each off by ~1e-4 at random
    assert small["results"]["long_ppl"]["word_perplexity,none"] != pytest.approx(ppl["hf"], rel=1e-4)


# ---- issue 27: bad model arguments and bad lm-eval arguments, one line each ----


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"frobnicate": 3}, "unknown model argument 'frobnicate' for the sparsedecode model;"),
        ({"suport": 97}, "unknown model argument 'suport' for the sparsedecode model (did you mean 'support'?)"),
        ({"revision": "main"}, "'revision' is for lm-eval's hf model loading a model by name"),
        (
            {"support": 100},
            "support=100 is not 1 + W + b*B with W = 64, B = 16 (block selectors read whole blocks): use 97 or 113",
        ),  # fmt: skip
        ({"support": -5.0}, "support -5 is smaller than anchor + window = 65"),  # lm-eval's CLI parses -5 as -5.0
        ({"support": 97.5}, "model argument support must be an integer, got 97.5"),
        ({"window": "64"}, "model argument window must be an integer, got '64'"),
        # found by probing: taken, then not applied (hf answered in bfloat16, this model in float32)
        ({"mixed_precision_dtype": "bfloat16"}, "mixed_precision_dtype (lm-eval's autocast) is not applied"),
    ],
)
def test_bad_model_arguments_are_refused_before_the_model_loads(model_dir, monkeypatch, arguments, message):
    from sparsedecode.integrations.lm_eval import SparseDecodeLM, sparse_settings
    from sparsedecode.models import catalog as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("refused after loading the model"))
    with pytest.raises(SparseDecodeError) as raised:
        SparseDecodeLM(pretrained=str(model_dir), **arguments)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(SparseDecodeError, match="."):
        sparse_settings(pretrained=str(model_dir), **arguments)


def test_whole_number_arguments_are_taken_as_the_integers_they_are(model_dir):
    from sparsedecode.integrations.lm_eval import SparseDecodeLM

    lm = SparseDecodeLM(pretrained=str(model_dir), support=113.0, window=64.0, device="cpu", max_batch_size=64)
    assert lm.sparse_config.support == 113 and isinstance(lm.sparse_config.window, int)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "no_such_task_xyz"], "sparsedecode lm-eval: Tasks not found: no_such_task_xyz"),
        (["--tasks", "tiny_gen", "--mod", "x"], "unrecognized arguments: --mod x"),
        (["--tasks", "tiny_gen", "--model_args", "pretrained=M,foo"], "expected `key=value`, got 'foo'"),
        (["--tasks", "tiny_gen", "--model_args", "pretrained=M,suport=97"], "unknown model argument 'suport'"),
        (["--tasks", "tiny_gen", "--model_args", "pretrained=M,support=100"], "use 97 or 113"),
        (["--tasks", "tiny_gen", "--model_args", "pretrained=M,support=-5"], "support -5 is smaller"),
    ],
)
def test_bad_lm_eval_arguments_are_one_line_and_exit_2(model_dir, tasks_dir, tmp_path, capsys, args, message):
    from sparsedecode.cli import main

    args = [a.replace("pretrained=M", f"pretrained={model_dir}") for a in args]
    if "--model_args" not in args:
        args += ["--model_args", f"pretrained={model_dir}"]
    base = ["lm-eval", "--model", "sparsedecode", "--include_path", str(tasks_dir), "--device", "cpu"]
    capsys.readouterr()
    code = main([*base, *args, "--output_path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and "Traceback" not in err, err
    assert errors == [errors[0]] and errors[0].startswith("sparsedecode: error: ") and message in errors[0], err
    assert err.endswith(errors[0] + "\n") and not (tmp_path / "out").exists()


def test_h2o_scores_and_generates_from_the_prefills_history(model_dir):
    """h2o ranks positions by the attention they received, the prompt's included. The model class prefills outside
    any session, so it records that history (one more dense prefill, as ``compare`` does) and hands it to the
    sparse session: the log-probabilities equal those of a session that ran the prefill itself. It had none: every
    h2o request stopped at its first sparse step (found probing H2O's prefill history)."""
    import torch
    from transformers import DynamicCache

    from sparsedecode import SparseConfig, sparse_decoding
    from sparsedecode.integrations.lm_eval import SparseDecodeLM

    lm = SparseDecodeLM(pretrained=str(model_dir), support=97, device="cpu", selector="h2o", sparse_tail=8)
    context, continuation = [3 + (7 * i) % 80 for i in range(150)], [5, 6, 7, 8]
    (got, _), (again, _) = lm._loglikelihood_tokens([(None, context, continuation)] * 2)  # the second reuses it
    fed, cache, scored = context[-8:] + continuation[:-1], DynamicCache(config=lm.model.config), []
    with torch.no_grad(), sparse_decoding(lm.model, SparseConfig(support=97, selector="h2o")) as session:
        lm.model(input_ids=torch.tensor([context[:-8]]), cache=cache, use_cache=True)  # the session records it
        for token in fed:
            scored.append(lm.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1])
    assert session.sparse_steps > 0
    logits = torch.stack(scored[-len(continuation) :]).float()
    expected = float(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(continuation)[:, None]).sum())
    assert got == pytest.approx(expected, abs=1e-4) and again == got
    out = lm._model_generate(torch.tensor([context]), max_length=len(context) + 3, stop=[])
    assert out.shape == (1, len(context) + 3)


def test_generation_settings_greedy_decoding_does_not_apply_are_refused_not_ignored(model_dir):
    """Found by probing: a task's ``repetition_penalty`` or ``num_beams`` (which lm-eval's hf model applies) were
    dropped without a word, so full support answered otherwise than hf; so was the model's own generation config."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from sparsedecode.integrations.lm_eval import SparseDecodeLM

    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=1)
    lm = SparseDecodeLM(pretrained=str(model_dir), support=100001, device="cpu")

    def request(**kwargs):
        return [Instance("generate_until", {}, ("The sky is", {"until": ["\n\n"], "max_gen_toks": 12, **kwargs}), 0)]

    greedy = hf.generate_until(request(), disable_tqdm=True)
    assert lm.generate_until(request(), disable_tqdm=True) == greedy
    same = {"top_k": 5, "top_p": 0.5, "repetition_penalty": 1.0, "num_beams": 1, "do_sample": False}
    assert lm.generate_until(request(**same), disable_tqdm=True) == greedy, "settings greedy decoding ignores"
    for setting in ({"repetition_penalty": 1.5}, {"num_beams": 3}):
        assert hf.generate_until(request(**setting), disable_tqdm=True) != greedy, setting
        with pytest.raises(SparseDecodeError, match=f"generation setting {next(iter(setting))}="):
            lm.generate_until(request(**setting), disable_tqdm=True)
    with pytest.raises(SparseDecodeError, match="temperature 0"):
        lm.generate_until(request(temperature=0.7), disable_tqdm=True)  # lm-eval samples at a temperature
    lm.model.generation_config.repetition_penalty = 1.3
    try:
        with pytest.raises(SparseDecodeError, match="generation_config sets repetition_penalty=1.3.*--gen_kwargs"):
            lm.generate_until(request(), disable_tqdm=True)
        assert lm.generate_until(request(repetition_penalty=1.0), disable_tqdm=True) == greedy
    finally:
        lm.model.generation_config.repetition_penalty = None
