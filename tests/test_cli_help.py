"""`--help` teaches: every option of every command shows its default (or that it is required), and every command's
help ends with example command lines that the real parser accepts as written."""

from __future__ import annotations

import argparse
import shlex

import pytest

from sparsedecode.cli import build_parser
from sparsedecode.cli.common import HelpFormatter


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """``(names, parser)`` of every command that runs, nested ones (``bench op``) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.add_help:  # lm-eval passes every argument to lm-eval, whose help is its own
                    nested = list(commands(sub, (*prefix, name)))
                    yield from nested or [((*prefix, name), sub)]


COMMANDS = list(commands(build_parser()))


def examples(parser: argparse.ArgumentParser) -> list[list[str]]:
    return [shlex.split(line) for line in (parser.epilog or "").splitlines() if line.startswith("  sparsedecode ")]


def test_every_command_is_covered():
    names = {" ".join(names) for names, _ in COMMANDS}
    assert names == {
        "run",
        "probe mass",
        "probe retrieval",
        "models",
        "compare-selectors",
        "sweep",
        "merge",
        "report",
        "bench op",
        "bench e2e",
        "bench vllm",
        "eval",
        "calibrate",
    }


@pytest.mark.parametrize("names,parser", COMMANDS, ids=[" ".join(n) for n, _ in COMMANDS])
def test_every_option_shows_its_default(names, parser):
    formatter = HelpFormatter(prog=parser.prog)
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._get_help_string(action)
        assert "default" in shown or "(required)" in shown, f"{names} {action.option_strings[-1]}: {shown!r}"
        assert "(default: )" not in shown, f"{names} {action.option_strings[-1]} shows an empty default: {shown!r}"
        assert action.help and action.help.strip(), f"{names} {action.option_strings[-1]} has no help"
        assert action.option_strings[-1] in text


@pytest.mark.parametrize("names,parser", COMMANDS, ids=[" ".join(n) for n, _ in COMMANDS])
def test_every_command_ends_with_examples_that_parse(names, parser):
    text = parser.format_help()
    found = examples(parser)
    assert 1 <= len([argv for argv in found if argv[1 : 1 + len(names)] == list(names)]) <= 2, names
    assert text.rstrip().endswith(shlex.join(found[-1])), "the examples end the help, one per line, as written"
    for argv in found:
        assert argv[0] == "sparsedecode"
        args = build_parser().parse_args(argv[1:])  # raises (one line) on anything the parser refuses
        assert callable(args.handler)


def test_defaults_are_shown_as_typed():
    text = " ".join(dict((" ".join(n), p) for n, p in COMMANDS)["sweep"].format_help().split())
    assert "(default: 97,193,385,769)" in text and "(required)" in text
    assert "--context N[,N...]" in text and "--shard I/N" in text
    assert "--support (default: none)" in text  # --layer-supports' empty list, not "(default: )"
    assert "--window and --block-size where not given" in text  # what --budget sets, as docs/cli.md says


def test_top_level_help_has_examples():
    parser = build_parser()
    assert examples(parser) and parser.format_help().rstrip().endswith(shlex.join(examples(parser)[-1]))
