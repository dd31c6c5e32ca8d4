"""The library's switches in the environment (``SPARSEDECODE_*``) and the compile backend: the usual spellings are
taken, anything else is one line naming the variable, before any work (issue #42, cases 10 and 17)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import prompt, tiny_model

from sparsedecode import env
from sparsedecode.errors import SparseDecodeError

SWITCHES = {
    "SPARSEDECODE_HUGE_PAGES": ("sparsedecode.models.arena", "ENABLED", "huge"),  # first: the other modules import it
    "SPARSEDECODE_ROW_PRODUCTS": ("sparsedecode.compiled.cpu", "ROW_PRODUCTS", "y"),
    "SPARSEDECODE_ROW_CHUNK": ("sparsedecode.compiled.cpu", "ROW_CHUNK", "lots"),
    "SPARSEDECODE_FREEZE": ("sparsedecode.compiled.cpu", "FREEZE", "nonsense"),
    "SPARSEDECODE_AUTOTUNE": ("sparsedecode.compiled.cpu", "AUTOTUNE", "2"),
    "SPARSEDECODE_MODULE_GUARDS": ("sparsedecode.compiled.decoder", "MODULE_GUARDS_PER_INSTALL", "nonsense"),
    "SPARSEDECODE_QUANTIZED_C": ("sparsedecode.models.quantized", "C_KERNEL", "maybe"),
}
"""Every switch read when its module is imported: (module, the attribute it sets, a value it must refuse)."""


@pytest.mark.parametrize("word", ["1", "true", "True", "YES", "on", " On "])
def test_a_flag_takes_the_usual_spellings_of_on(monkeypatch, word):
    monkeypatch.setenv("SPARSEDECODE_TEST_FLAG", word)
    assert env.flag("SPARSEDECODE_TEST_FLAG", False) is True


@pytest.mark.parametrize("word", ["0", "false", "FALSE", "no", "Off"])
def test_a_flag_takes_the_usual_spellings_of_off(monkeypatch, word):
    monkeypatch.setenv("SPARSEDECODE_TEST_FLAG", word)
    assert env.flag("SPARSEDECODE_TEST_FLAG", True) is False


def test_unset_or_empty_is_the_default(monkeypatch):
    monkeypatch.delenv("SPARSEDECODE_TEST_FLAG", raising=False)
    assert env.flag("SPARSEDECODE_TEST_FLAG", True) is True
    monkeypatch.setenv("SPARSEDECODE_TEST_FLAG", " ")
    assert env.flag("SPARSEDECODE_TEST_FLAG", False) is False
    assert env.choice("SPARSEDECODE_TEST_FLAG", "install", ("install", "step")) == "install"
    assert env.count("SPARSEDECODE_TEST_FLAG", 8192) == 8192


@pytest.mark.parametrize(
    "read, value",
    [
        (lambda: env.flag("SPARSEDECODE_TEST_FLAG", True), "2"),
        (lambda: env.flag("SPARSEDECODE_TEST_FLAG", True), "nonsense"),
        (lambda: env.choice("SPARSEDECODE_TEST_FLAG", "install", ("install", "step")), "always"),
        (lambda: env.count("SPARSEDECODE_TEST_FLAG", 8192), "8k"),
        (lambda: env.count("SPARSEDECODE_TEST_FLAG", 8192), "0"),
    ],
)
def test_anything_else_is_one_line_naming_the_variable(monkeypatch, read, value):
    monkeypatch.setenv("SPARSEDECODE_TEST_FLAG", value)
    with pytest.raises(SparseDecodeError, match="SPARSEDECODE_TEST_FLAG") as raised:
        read()
    assert repr(value) in str(raised.value) and "\n" not in str(raised.value)


def test_every_switch_is_read_by_the_shared_reader():
    """No ``SPARSEDECODE_*`` switch is read from ``os.environ`` by hand (where a typo meant off); paths, not switches,
    are the variables read elsewhere: the cache folder and the vLLM environment's interpreter."""
    source = Path(__file__).parent.parent / "src" / "sparsedecode"
    by_hand = []
    for path in source.rglob("*.py"):
        for name in re.findall(r"os\.environ(?:\.get)?[\[(]\s*\"(SPARSEDECODE_\w+)\"", path.read_text()):
            if name not in ("SPARSEDECODE_CACHE", "SPARSEDECODE_VLLM_PYTHON"):
                by_hand.append(f"{path.name}: {name}")
    assert not by_hand
    read = set(re.findall(r"env\.\w+\(\s*\"(SPARSEDECODE_\w+)\"", "".join(p.read_text() for p in source.rglob("*.py"))))
    assert set(SWITCHES) | {"SPARSEDECODE_COMPILE_BACKEND"} == read


def test_every_switch_refuses_a_bad_value_when_its_module_is_imported():
    """Each switch with a value it does not take, in a fresh interpreter: one line naming it, at import; and
    ``yes``/``on``/``off`` are taken as what they say (they were read as off)."""
    script = textwrap.dedent(
        f"""
        import importlib, os, sys
        from sparsedecode.errors import SparseDecodeError
        switches = {SWITCHES!r}
        for name, (module, attribute, bad) in switches.items():
            os.environ[name] = bad
            try:
                importlib.import_module(module)
                print(name, "taken")
            except SparseDecodeError as error:
                print(name, name in str(error) and repr(bad) in str(error) and "\\n" not in str(error))
            del os.environ[name]
            sys.modules.pop(module, None)
        for word, expected in (("yes", True), ("on", True), ("off", False)):
            os.environ["SPARSEDECODE_FREEZE"] = word
            sys.modules.pop("sparsedecode.compiled.cpu", None)
            print(word, importlib.import_module("sparsedecode.compiled.cpu").FREEZE is expected)
        """
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEDECODE_")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=environment
    ).stdout
    assert out.split("\n")[:-1] == [f"{name} True" for name in SWITCHES] + ["yes True", "on True", "off True"]


def test_an_unknown_compile_backend_is_refused_before_the_prefill(monkeypatch):
    import sparsedecode as sd
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "nonsense")
    model = tiny_model("llama")
    handle = model.register_forward_pre_hook(lambda *_: pytest.fail("the model ran before the backend was checked"))
    for mode in ("dense", "sparse"):
        with pytest.raises(SparseDecodeError, match="compile backend 'nonsense'.*inductor") as raised:
            sd.generate(model, prompt(200), sd.SparseConfig(support=97), 4, mode=mode, compile=True)
        assert "SPARSEDECODE_COMPILE_BACKEND" in str(raised.value) and "\n" not in str(raised.value)
        assert "native" in str(raised.value) and "aot_eager" in str(raised.value)  # taken too (docs/compiled.md)
    handle.remove()
    with pytest.raises(SparseDecodeError, match="compile backend 'also-nonsense' is not"):
        compiled.CompiledDecoder(model, None, batch=1, max_len=256, backend="also-nonsense")


def test_bench_e2e_checks_the_switches_and_backend_before_any_row(tiny_model_dir):
    """The command line, each case in a process of its own: exit 2 and one line before the model loads, no rows."""
    from forked_commands import ForkedCommands

    base = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEDECODE_")}
    forked = ForkedCommands({**base, "OMP_NUM_THREADS": "1"})
    args = ("bench", "e2e", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--tokens", "4")
    try:
        for name, value in (("SPARSEDECODE_COMPILE_BACKEND", "nonsense"), ("SPARSEDECODE_FREEZE", "true-ish")):
            forked.env = {**base, "OMP_NUM_THREADS": "1", name: value}
            done = forked.run(*args, "--repeats", "1", "--compile")
            assert done.returncode == 2, done.stderr
            assert done.stderr.count("\n") == 1 and name in done.stderr and "Traceback" not in done.stderr
            assert "loading" not in done.stdout and "tok/s" not in done.stdout
    finally:
        forked.close()
