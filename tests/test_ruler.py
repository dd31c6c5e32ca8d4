"""RULER-style task generation: determinism, fit to the context in the model's tokens, answers where they belong."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from conftest import char_tokenizer

from sparsedecode import SparseDecodeError
from sparsedecode.experiments.ruler import CWE_RARE_FREQ, FWE_DOTS, NEEDLE, TASK_NAMES, TOLERANCE, build_sample, score

CONTEXT = 2000
"""Characters of the char tokenizer; every task fits here (cwe needs about 1500)."""


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }} <<end>>\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>> {% endif %}"
    )
    return tok


def fits(sample, context: int) -> bool:
    return (1 - TOLERANCE) * context <= sample.tokens <= context


@pytest.mark.parametrize("task", TASK_NAMES)
def test_deterministic_per_seed_and_fitted_within_one_percent(tokenizer, task):
    a = build_sample(tokenizer, task, CONTEXT, 0, seed=3)
    b = build_sample(tokenizer, task, CONTEXT, 0, seed=3)
    assert (a.text, a.ids, a.answers, a.question_start) == (b.text, b.ids, b.answers, b.question_start)
    assert build_sample(tokenizer, task, CONTEXT, 0, seed=4).text != a.text, "another seed, another sample"
    assert build_sample(tokenizer, task, CONTEXT, 1, seed=3).text != a.text, "another index, another sample"
    for context in (CONTEXT, 3100):
        sample = a if context == CONTEXT else build_sample(tokenizer, task, context, 2)
        assert fits(sample, context), (context, sample.tokens)
        assert sample.ids == list(tokenizer(sample.text, add_special_tokens=True)["input_ids"])
        assert sample.prompt_format == "plain"


def _split(sample, tokenizer) -> tuple[str, str]:
    """The prompt text before the question tail and the tail, cut where token ``question_start`` starts."""
    offsets = tokenizer(sample.text, return_offsets_mapping=True)["offset_mapping"]
    cut = offsets[sample.question_start][0]
    return sample.text[:cut], sample.text[cut:]


def _before_question(sample, tokenizer) -> str:
    return _split(sample, tokenizer)[0]


@pytest.mark.parametrize("task", [t for t in TASK_NAMES if t.startswith("niah")])
def test_needles_hold_the_answers_before_the_question(tokenizer, task):
    for index in range(3):
        sample = build_sample(tokenizer, task, CONTEXT, index)
        haystack = _before_question(sample, tokenizer)
        needles = sample.info["needles"]
        for key, value in needles:
            assert haystack.count(NEEDLE.format(key=key, value=value)) == 1
        keys = list(dict.fromkeys(k for k, _ in needles))
        asked = sample.info["asked"]
        assert sample.answers == [v for k, v in needles if k in asked]
        tail = _split(sample, tokenizer)[1]
        assert tail.startswith("What ") and all(k in tail for k in asked)
        assert not any(v in tail for _, v in needles), "the question does not give the answer away"
        shape = {  # distinct keys, needles, answers, keys asked
            "niah_single_noise": (1, 1, 1, 1),
            "niah_single_prose": (1, 1, 1, 1),
            "niah_multikey": (4, 4, 1, 1),
            "niah_multivalue": (1, 4, 4, 1),
            "niah_multiquery": (4, 4, 4, 4),
        }[task]
        assert (len(keys), len(needles), len(sample.answers), len(asked)) == shape
        assert len(set(sample.answers)) == len(sample.answers)
        if task == "niah_single_noise":
            assert "The grass is green." in haystack
        else:
            assert "The grass is green." not in haystack


def test_variable_tracking_chain_in_order(tokenizer):
    for index in range(3):
        sample = build_sample(tokenizer, "vt", CONTEXT, index)
        haystack = _before_question(sample, tokenizer)
        names = sample.answers
        value = re.search(r"VAR " + names[0] + r" = (\d+)\.", haystack).group(1)
        positions = [haystack.index(f"VAR {names[0]} = {value}.")]
        positions += [haystack.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
        assert positions == sorted(positions) and len(set(names)) == 5
        assert len(re.findall(r"VAR [A-Z]{5} =", haystack)) == 5
        assert f"value {value}" in _split(sample, tokenizer)[1]


def test_common_words_are_the_most_common(tokenizer):
    for index in range(3):
        sample = build_sample(tokenizer, "cwe", CONTEXT, index)
        items = re.findall(r"\d+\. ([a-z]+)", _before_question(sample, tokenizer))
        counts = Counter(items)
        frequency = sample.info["common_frequency"]
        assert frequency > CWE_RARE_FREQ + 1 and len(sample.answers) == 10
        assert all(counts[w] == frequency for w in sample.answers)
        assert all(c <= CWE_RARE_FREQ for w, c in counts.items() if w not in sample.answers)
        assert len(items) == sum(counts.values()) and len(counts) > 10


def test_frequent_words_are_the_top_three_after_the_dots(tokenizer):
    for index in range(3):
        sample = build_sample(tokenizer, "fwe", CONTEXT, index)
        body = _before_question(sample, tokenizer).split("coded words. ", 1)[1]
        counts = Counter(body.split())
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == FWE_DOTS and set(ranked[1:4]) == set(sample.answers)
        assert counts[sample.answers[2]] > max(c for w, c in counts.items() if w not in {FWE_DOTS, *sample.answers})


@pytest.mark.parametrize("task", TASK_NAMES)
def test_chat_template_is_used_and_counted(chat_tokenizer, task):
    sample = build_sample(chat_tokenizer, task, CONTEXT, 0)
    assert sample.prompt_format == "chat-template" and fits(sample, CONTEXT)
    assert sample.text.startswith("<<user>> ") and "<<end>>\n<<assistant>> " in sample.text
    tail = _split(sample, chat_tokenizer)[1]
    assert "<<end>>" in tail, "the rest of the template is part of the question tail"
    assert sample.text.endswith(tail) and tail.split("<<assistant>> ")[1] in sample.text
    plain = build_sample(chat_tokenizer, task, CONTEXT, 0, template="plain")
    assert plain.prompt_format == "plain" and "<<user>>" not in plain.text and fits(plain, CONTEXT)


def test_question_tail_is_question_then_answer_prefix(tokenizer):
    sample = build_sample(tokenizer, "niah_single_noise", CONTEXT, 0)
    tail = _split(sample, tokenizer)[1]
    key = sample.info["asked"][0]
    assert tail.startswith(f"What is the special magic number for {key}")
    assert tail.endswith(f"The special magic number for {key} mentioned in the provided text is")
    assert sample.max_new_tokens == 24 and sample.question_tokens == len(tail)


def test_scoring_is_the_share_of_answers_found():
    # a float64 share of three answers: exact but for the rounding of 2 / 3
    assert score("The numbers are 1234567 AND abcde.", ["1234567", "ABCDE", "7654321"]) == pytest.approx(2 / 3)
    assert score("nothing", ["1"]) == 0.0 and score("x 1 y", ["1"]) == 1.0
    with pytest.raises(SparseDecodeError):
        score("x", [])


def test_bad_requests_are_refused(tokenizer):
    with pytest.raises(SparseDecodeError, match="too short"):
        build_sample(tokenizer, "niah_single_noise", 150, 0)
    with pytest.raises(SparseDecodeError, match="too short for cwe"):
        build_sample(tokenizer, "cwe", 700, 0)
    with pytest.raises(SparseDecodeError, match="unknown task"):
        build_sample(tokenizer, "passkey", CONTEXT, 0)
    with pytest.raises(SparseDecodeError, match="no chat template"):
        build_sample(tokenizer, "vt", CONTEXT, 0, template="chat")


@pytest.mark.realmodel
def test_fit_and_answers_with_the_real_tokenizer(smollm2):
    _, tokenizer = smollm2
    for task in TASK_NAMES:
        for context in (1024, 4096):
            sample = build_sample(tokenizer, task, context, 1)
            assert sample.prompt_format == "chat-template" and fits(sample, context), (task, context, sample.tokens)
            assert sample.ids == list(tokenizer(sample.text)["input_ids"])
            before = tokenizer.decode(sample.ids[: sample.question_start])
            if task.startswith("niah") or task == "vt":
                assert all(answer in before for answer in sample.answers)
            assert "<|im_start|>assistant" in _split(sample, tokenizer)[1]


def test_no_common_word_lies_inside_another_word_of_the_prompt(tokenizer):
    """Scoring finds an answer as a substring of the output, so a common word inside a rare word of the list (the
    common ``select``, the rare ``selects``) or inside the prompt's own words (``list``) was found in a wrong answer
    or an echo of the question; such words are never drawn as common words."""
    for index in range(12):
        sample = build_sample(tokenizer, "cwe", CONTEXT, index, seed=1)
        items = set(re.findall(r"\d+\. ([a-z]+)", _before_question(sample, tokenizer)))
        prose = re.sub(r"\d+\. [a-z]+", " ", sample.text.lower())  # the prompt without its list
        for common in sample.answers:
            assert not [w for w in items if common in w and w != common] and common not in prose, (index, common)


def test_a_chat_template_reading_todays_date_gives_the_same_sample_every_day(monkeypatch):
    """Found by probing: a template that writes today's date when no ``date_string`` is given (Llama 3.2's and
    3.3's: ``strftime_now("%d %b %Y")``) made a sample depend on the day it was built, so an evaluation resumed or
    sharded across midnight, or exported on another day, held other prompts. Samples pass Llama 3.1's fixed date."""
    import datetime

    import transformers.utils.chat_template_utils as templates

    tok = char_tokenizer()
    tok.chat_template = (
        '{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
        "<<system>> Today Date: {{ date_string }} <<end>>\n"
        "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }} <<end>>\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>> {% endif %}"
    )
    samples = []
    for day in (datetime.datetime(2026, 12, 6, 23, 59), datetime.datetime(2027, 1, 1, 0, 1)):

        class Today(datetime.datetime):
            @classmethod
            def now(cls, tz=None, day=day):
                return day

        monkeypatch.setattr(templates, "datetime", Today)
        samples.append(build_sample(tok, "niah_single_noise", CONTEXT, 0))
    assert samples[0].ids == samples[1].ids and "Today Date: 26 Jul 2024" in samples[0].text
