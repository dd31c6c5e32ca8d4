"""Spec strings of a user's selector (issue #42, cases 14-16): a path may hold colons, optional parameters can be
set (annotations read as written, ``from __future__ import annotations`` included), and lm-eval's model arguments
say where a selector's parameters go."""

from __future__ import annotations

import pytest

from sparsedecode.errors import SparseDecodeError
from sparsedecode.selectors import parse_selector, split_selector_list

PARAMETERS = """
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import sparsedecode


@dataclass(frozen=True)
class Tempered(sparsedecode.BlockSelector):
    temperature: float = 1.0
    flag: bool = False
    cap: int | None = None
    floor: Optional[float] = None
    label: str = "x"
    unknown: Undefined = 3  # noqa: F821 - an annotation the module cannot resolve: read by its default's type

    def score_blocks(self, queries, keys, layout):
        return torch.zeros(keys.shape[0], layout.n_blocks)
"""

PLAIN = PARAMETERS.replace("from __future__ import annotations\n", "").replace(
    "    unknown: Undefined = 3  # noqa: F821 - an annotation the module cannot resolve: read by its default's type\n",
    "",
)


@pytest.fixture(params=["future", "plain"])
def selector_file(tmp_path, request):
    path = tmp_path / "co:lon" / "sel.py"
    path.parent.mkdir()
    path.write_text(PARAMETERS if request.param == "future" else PLAIN)
    return path


def test_optional_parameters_are_read_by_their_annotation(selector_file):
    spec = f"{selector_file}:Tempered:cap=3,floor=0.5,flag=true,temperature=2,label=none"
    selector = parse_selector(spec)
    assert selector.params()["cap"] == 3 and selector.params()["floor"] == 0.5
    assert selector.params()["flag"] is True and selector.params()["temperature"] == 2.0
    assert selector.params()["label"] == "none"  # a str field that is not optional takes the word
    assert parse_selector(selector.spec()) == selector  # the spec a row stores reads back as the same selector
    assert parse_selector(f"{selector_file}:Tempered:cap=None,floor=none").params()["cap"] is None
    if "unknown" in selector.params():
        assert parse_selector(f"{selector_file}:Tempered:unknown=4").params()["unknown"] == 4
    for bad, says in [("cap=x", "cap='x' is not int (or none)"), ("flag=1", "flag='1' is not bool")]:
        with pytest.raises(SparseDecodeError, match="Tempered") as raised:
            parse_selector(f"{selector_file}:Tempered:{bad}")
        assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_path_with_colons_names_its_file(selector_file):
    """The path ends at the last ``.py:`` that a class name follows; ``co`` is not a selector's name."""
    assert parse_selector(f"{selector_file}:Tempered").source[0] == str(selector_file)
    assert parse_selector(f"{selector_file}:Tempered:label=a.py:b").params()["label"] == "a.py:b"
    assert split_selector_list(f"quest,{selector_file}:Tempered:cap=2,floor=1,mean-pooled") == [
        "quest",
        f"{selector_file}:Tempered:cap=2,floor=1",
        "mean-pooled",
    ]
    with pytest.raises(SparseDecodeError, match="a file selector is path/to/file.py:ClassName"):
        parse_selector(f"{selector_file}:")
    with pytest.raises(SparseDecodeError, match="does not exist"):
        parse_selector(f"{selector_file.parent}/other:dir/sel.py:Tempered")


def test_the_command_line_takes_a_path_with_colons(selector_file, tiny_model_dir, monkeypatch, tmp_path, capsys):
    from sparsedecode.cli import main

    monkeypatch.chdir(selector_file.parent.parent)  # a relative path: co:lon/sel.py
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--tokens", "3"]
    assert main([*args, "--selector", "co:lon/sel.py:Tempered:cap=2", "--json", str(out)]) == 0, capsys.readouterr()
    assert '"selector": "co:lon/sel.py:Tempered:cap=2"' in out.read_text()


def test_lm_eval_says_a_selectors_parameters_are_separated_by_semicolons(selector_file):
    pytest.importorskip("lm_eval")
    from sparsedecode.integrations.lm_eval import sparse_settings

    spec = f"{selector_file}:Tempered:temperature=2"
    with pytest.raises(SparseDecodeError, match="'flag' is a parameter of selector") as raised:
        sparse_settings(pretrained="m", selector=spec, flag=True)
    assert f"(selector={spec};flag=True)" in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(SparseDecodeError, match=f"selector={selector_file}:Tempered:cap=2\\)"):
        sparse_settings(pretrained="m", selector=f"{selector_file}:Tempered", cap=2)
    cfg, _ = sparse_settings(pretrained="m", selector=f"{spec};flag=true;cap=none")
    assert cfg.selector.params()["flag"] is True and cfg.selector.params()["cap"] is None
    with pytest.raises(SparseDecodeError, match="unknown model argument 'nope'"):
        sparse_settings(pretrained="m", selector=spec, nope=1)


def test_lm_eval_command_line_refuses_a_cut_selector_in_one_line(selector_file, capsys):
    pytest.importorskip("lm_eval")
    from sparsedecode.cli import main

    model_args = f"pretrained=smollm2-135m,selector={selector_file}:Tempered:temperature=2,flag=true"
    code = main(["lm-eval", "--model", "sparsedecode", "--model_args", model_args, "--tasks", "arc_easy"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "separate a selector's parameters with ';'" in err, err


def test_a_numpy_float_parameter_gives_a_spec_that_reads_back():
    """A parameter swept with NumPy (``np.linspace`` gives ``float64``, whose ``repr`` is ``np.float64(0.5)``) is
    written as the float it is: the spec a row stores reads back to the same selector."""
    import numpy as np

    from sparsedecode.selectors.methods.twilight import Twilight

    for p in np.linspace(0.5, 0.9, 3):
        selector = Twilight(p=p)
        assert selector.spec() == f"twilight:p={float(p)!r}"
        assert parse_selector(selector.spec()).params() == selector.params()


PROJECTED = """
from dataclasses import dataclass, field

import torch

import sparsedecode
from sparsedecode.selectors import group_mean_queries


@dataclass(frozen=True)
class Projected(sparsedecode.BlockSelector):
    projection: torch.Tensor = field(default_factory=lambda: torch.eye(16))
    scale: float = 1.0

    def score_blocks(self, queries, keys, layout):
        q = group_mean_queries(queries, keys.shape[0]) @ self.projection
        return torch.einsum("hd,hbd->hb", q, keys[:, : layout.n_blocks].float() @ self.projection) * self.scale
"""


def test_a_tensor_parameter_with_a_default_runs_and_is_written_on_one_line(tmp_path, tiny_model_dir, capsys):
    """A selector whose parameter is a tensor with a default (a fixed projection) is usable by every command: its
    spec compared the tensor with its default by ``!=``, whose element-by-element answer has no truth value (a
    traceback from every command), and a changed one printed a tensor over several lines into its spec (error
    messages name a selector by it) and into the row's parameters, which JSON cannot hold."""
    import json

    import torch

    from sparsedecode import SparseConfig
    from sparsedecode.cli import main

    path = tmp_path / "projected.py"
    path.write_text(PROJECTED)
    default = parse_selector(f"{path}:Projected")
    assert default.spec() == f"{path}:Projected"
    changed = type(default)(projection=torch.eye(16).flip(0) * 3, scale=2.0)
    assert "\n" not in changed.spec() and changed.spec().startswith(f"{path}:Projected:projection=tensor([[0., 0.,")
    json.dumps(SparseConfig(selector=changed).to_dict())
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--tokens", "3"]
    assert main([*args, "--selector", f"{path}:Projected:scale=2", "--json", str(out)]) == 0, capsys.readouterr()
    settings = json.loads(out.read_text())["results"][0]["settings"]
    assert settings["selector"] == f"{path}:Projected:scale=2.0"
    assert settings["selector_params"]["projection"].startswith("tensor([[1., 0.,")


def test_twilight_names_its_base_as_the_base_names_itself(tmp_path):
    """One Twilight is one selector: its base is stored as the base's own spec writes it, so two ways of writing the
    same base (a default given, a number written otherwise) are one spec in rows, folders and merges, as
    ``block-top-p:p=0.90`` and ``block-top-p:p=0.9`` are. They were two: ``twilight:base=quest:grouping=per-head``
    ran beside ``twilight`` as another selector (found by probing spec round trips)."""
    from sparsedecode.experiments.specs import canonical_selectors
    from sparsedecode.selectors.methods.twilight import Twilight

    same = ["twilight", "twilight:base=quest:grouping=per-head", "twilight:base=quest"]
    assert set(canonical_selectors(same)) == {"twilight"}
    assert Twilight(base="quest:grouping=per-head") == Twilight() and Twilight(base="quest ").base == "quest"
    tuned = ["twilight:base=block-top-p:p=0.50", "twilight:base=block-top-p:p=.5", "twilight:p=0.5;base=mean-pooled"]
    assert canonical_selectors(tuned) == ("twilight:base=block-top-p:p=0.5",) * 2 + ("twilight:p=0.5,base=mean-pooled",)
    for spec in (*same, *tuned, "twilight:base=quest:grouping=mean-query"):
        written = parse_selector(spec).spec()
        assert parse_selector(written).spec() == written and parse_selector(written) == parse_selector(spec)
    path = tmp_path / "base.py"
    path.write_text(
        "from dataclasses import dataclass\nimport sparsedecode\nfrom sparsedecode.selectors.methods.mean_pooled "
        "import MeanPooled\n\n@dataclass(frozen=True)\nclass Base(MeanPooled):\n    pass\n"
    )
    assert parse_selector(f"twilight:base={path}:Base").spec() == f"twilight:base={path}:Base"  # a file's path kept


def test_a_selector_path_that_is_a_pipe_is_named_so(tmp_path):
    """A selector file that exists but is no regular file (a named pipe) was reported as not existing."""
    import os

    pipe = tmp_path / "sel.py"
    os.mkfifo(pipe)
    with pytest.raises(SparseDecodeError, match="is no regular file"):
        parse_selector(f"{pipe}:Mine")


def test_a_parameter_after_a_selector_without_parameters_starts_them(selector_file):
    """An item with ``=`` and no ``:`` continues the parameters of the selector before it (docs/selectors.md),
    starting them where it has none: ``block-top-p,p=0.8`` was joined into ``block-top-p,p=0.8``, refused as an
    unknown selector of that name."""
    from sparsedecode.cli.arguments import selector_list

    assert split_selector_list("mean-pooled,block-top-p,p=0.8,quest") == ["mean-pooled", "block-top-p:p=0.8", "quest"]
    assert split_selector_list(f"{selector_file}:Tempered,cap=2,floor=1") == [f"{selector_file}:Tempered:cap=2,floor=1"]
    assert selector_list("mean-pooled,block-top-p,p=0.8") == ("mean-pooled", "block-top-p:p=0.8")
    assert selector_list("twilight,p=0.9,quest") == (parse_selector("twilight:p=0.9").spec(), "quest")
