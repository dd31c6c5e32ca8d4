"""sparsedecode as an lm-evaluation-harness model (``pip install 'sparsedecode[eval]'``, lm-eval 0.4.13).

::

    sparsedecode lm-eval --model sparsedecode \\
        --model_args pretrained=smollm2-135m,support=193,selector=mean-pooled --tasks TASKS ...

or from Python: ``register()``, then ``lm_eval.simple_evaluate(model="sparsedecode", model_args=...)``.

:class:`SparseDecodeLM` is lm-eval's own ``hf`` model (:class:`lm_eval.models.huggingface.HFLM`: the same request
handling, tokenisation, chat templates, stop sequences and post-processing) with the model calls replaced:

* ``generate_until``: dense prefill of the context except its last ``sparse_tail`` tokens, which are then fed one at
  a time under sparse attention; then greedy decoding, every step sparse, until a stop sequence, an end-of-sequence
  token or ``max_gen_toks``. Greedy only: ``do_sample=True`` is refused, and so is a setting ``hf`` would apply
  to greedy decoding (``repetition_penalty``, ``num_beams``, ..., the task's or the model's generation config's).
* ``loglikelihood``: dense prefill of the context except its last ``sparse_tail`` tokens; those and the continuation
  are fed one token at a time under sparse attention, and the continuation is scored from the logits of those
  steps. With ``sparse_tail=0`` the first continuation token is scored from the dense prefill, the rest from sparse
  steps. (A single forward over context and continuation would be a dense prefill and measure nothing.)
* ``loglikelihood_rolling`` (perplexity tasks): lm-eval cuts the document into windows of the model's maximum
  length, each prefixed by one token; every token of a window is then scored by a sparse decode step as above (the
  prefix token is the whole dense prefill). That is the document's perplexity under sparse decoding, token by
  token, at the cost of one forward per token.

A decode step whose cache holds no more positions than the support is dense (the support is everything), so with a
support at least the longest context plus generation the results equal the ``hf`` model's up to float rounding of
the chunked computation. Batches are one sequence (``batch_size=1``), as every sparse step here is.

Model arguments, besides ``HFLM``'s: ``pretrained`` (an alias of :func:`sparsedecode.list_models`, a local
directory or ``.gguf`` file, or a hub id), ``dtype`` (float32), ``support`` (193), ``selector`` (mean-pooled),
``window`` (64), ``block_size`` (16), ``reuse`` (1), ``kernel`` (auto), ``seed`` (0, for random-blocks),
``sparse_tail`` (1). Of ``HFLM``'s own arguments those that act on a model already loaded are taken
(:data:`HFLM_ARGS`; ``mixed_precision_dtype``, an autocast this model does not apply, is refused); the ones for
loading a model by name (``revision``, ``peft``, ``parallelize``, ...) are refused, and so is any name neither model
knows: a misspelt ``suport=97`` must not run the default support. lm-eval's
command line turns ``-5`` into ``-5.0``, so a whole number of a float type is taken as the integer it is; a block
selector's ``support`` must be whole blocks, ``1 + window + b * block_size``, as on every command (``support=100`` is
refused naming 97 and 113, rather than run as 97).

This module imports lm-eval; the library never imports this module.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from ..config import SparseConfig
from ..decoding.loop import decode_tokens, prefill
from ..errors import SparseDecodeError
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache

try:
    from lm_eval.models.huggingface import HFLM
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise SparseDecodeError(
        "the lm-evaluation-harness model needs lm-eval: pip install 'sparsedecode[eval]'"
    ) from error

MODEL_NAME = "sparsedecode"
SPARSE_ARGS = ("support", "selector", "window", "block_size", "reuse", "kernel", "seed")
INTEGER_ARGS = ("support", "window", "block_size", "reuse", "seed", "sparse_tail")
HFLM_ARGS = (
    "backend",
    "truncation",
    "logits_cache",
    "max_length",
    "softmax_dtype",
    "mixed_precision_dtype",
    "max_batch_size",
    "trust_remote_code",
    "add_bos_token",
    "prefix_token_id",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
)
"""``HFLM``'s arguments that act on a model it is given (lm-eval passes ``max_batch_size`` and, with
``--trust_remote_code``, ``trust_remote_code`` itself); its others load a model by name, which this model does not."""
OWN_ARGS = ("pretrained", "dtype", "device", "batch_size", *SPARSE_ARGS, "sparse_tail")


def check_model_args(kwargs: dict, selector=None) -> None:
    """Refuse a model argument that neither this model nor ``HFLM`` given a loaded model would use; one that is a
    parameter of ``selector`` (lm-eval cut ``selector=NAME:a=1,b=2`` at the comma) says to separate them by ``;``."""
    import difflib
    import inspect

    from ..selectors.registry import parameter_names

    loading = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs", *HFLM_ARGS}
    for name in kwargs:
        if name in HFLM_ARGS:
            continue
        if name in loading:
            raise SparseDecodeError(
                f"model argument {name!r} is for lm-eval's hf model loading a model by name; the sparsedecode model "
                "loads `pretrained` itself (a built-in alias, a local directory or .gguf file, or a hub id): drop it"
            )
        if isinstance(selector, str) and name in (parameter_names(selector) or ()):
            spec = f"{selector}{';' if ':' in selector.split('.py:')[-1] else ':'}{name}={kwargs[name]}"
            raise SparseDecodeError(
                f"model argument {name!r} is a parameter of selector {selector!r}, not of the sparsedecode model: "
                f"lm-eval splits --model_args at every comma, so separate a selector's parameters with ';' "
                f"(selector={spec})"
            )
        close = difflib.get_close_matches(name, (*OWN_ARGS, *HFLM_ARGS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SparseDecodeError(
            f"unknown model argument {name!r} for the sparsedecode model{hint}; it takes {', '.join(OWN_ARGS)} and "
            f"lm-eval's {', '.join(HFLM_ARGS)}"
        )


def sparse_settings(
    *,
    batch_size: int | str = 1,
    support=193,
    selector: str = "mean-pooled",
    window=64,
    block_size=16,
    reuse=1,
    kernel: str = "auto",
    seed=0,
    sparse_tail=1,
    **others,
) -> tuple[SparseConfig, int]:
    """``(SparseConfig, sparse_tail)`` from the model arguments, every one checked (``others``: the rest, which
    :func:`check_model_args` checks by name); loads nothing, so the command line checks ``--model_args`` with it
    before lm-eval starts."""
    check_model_args(
        {name: value for name, value in others.items() if name not in ("pretrained", "dtype", "device")}, selector
    )
    if others.get("mixed_precision_dtype") is not None:  # found by probing: taken and then not applied
        raise SparseDecodeError(
            "model argument mixed_precision_dtype (lm-eval's autocast) is not applied by the sparsedecode model: "
            "give the dtype to run in as dtype= instead"
        )
    if str(batch_size) != "1":
        raise SparseDecodeError(f"sparsedecode runs one sequence at a time: use batch_size 1 (got {batch_size})")
    support, window, block_size, reuse, seed, sparse_tail = (
        _integer(name, value)
        for name, value in zip(INTEGER_ARGS, (support, window, block_size, reuse, seed, sparse_tail))
    )
    if sparse_tail < 0:
        raise SparseDecodeError(f"sparse_tail must be an integer >= 0, got {sparse_tail!r}")
    cfg = SparseConfig(
        support=support, window=window, block_size=block_size, reuse=reuse, selector=selector, kernel=kernel, seed=seed
    )
    if not cfg.token_level and cfg.effective_support != cfg.support:
        raise SparseDecodeError(
            f"support={cfg.support} is not 1 + W + b*B with W = {cfg.window}, B = {cfg.block_size} (block "
            f"selectors read whole blocks): use {cfg.effective_support} or {cfg.effective_support + cfg.block_size}"
        )
    return cfg, sparse_tail


def _integer(name: str, value):
    """``value`` as an int when it is one, whole floats included (lm-eval's command line parses ``-5`` as ``-5.0``);
    anything else is refused naming the argument."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SparseDecodeError(f"model argument {name} must be an integer, got {value!r}")
    return value


def _device(requested: str | None) -> torch.device:
    """The device to run on, as lm-eval's own HF model chooses it: the one asked for where this machine has it, else
    CUDA when available, else the CPU (lm-eval asks for ``cuda:0`` unless told otherwise, on every machine)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = {"cpu", *(["cuda"] if gpus else []), *(f"cuda:{i}" for i in range(gpus))}
    if torch.backends.mps.is_available():
        available |= {"mps", "mps:0"}
    if requested in available:
        return torch.device(requested)
    chosen = "cuda" if gpus else "cpu"
    if requested is not None:
        print(f"sparsedecode: device {requested!r} is not available here; running on {chosen}", file=sys.stderr)
    return torch.device(chosen)


SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""Generation settings only sampling reads: greedy decoding ignores them, as lm-eval's ``hf`` model does."""
PASSED = ("do_sample", "attention_mask", "pad_token_id", "use_cache", "length_penalty", "early_stopping")
"""Generation settings ``_model_generate`` takes or that leave greedy decoding's tokens as they are."""
NEUTRAL = {"repetition_penalty": 1.0, "num_beams": 1, "num_return_sequences": 1, "no_repeat_ngram_size": 0}
NEUTRAL |= {"min_new_tokens": 0, "min_length": 0}
"""Settings that change greedy decoding's tokens under ``generate`` (lm-eval's ``hf`` model) unless they hold these
values (or none); any other setting a task names counts as such when it holds a value."""


def check_greedy(generation_kwargs: dict, generation_config=None) -> None:
    """Refuse a generation setting of the task (``generation_kwargs``) or of the model's ``generation_config`` that
    lm-eval's ``hf`` model would apply and plain greedy decoding does not (a repetition penalty, beams, ...): the
    answers would differ from ``hf``'s with nothing said."""
    if generation_kwargs.get("do_sample"):
        raise SparseDecodeError(
            "sparsedecode decodes greedily: set do_sample false (or temperature 0; lm-eval samples at a temperature "
            "above 0) for this task"
        )
    for name, value in generation_kwargs.items():
        if name not in (*SAMPLING_ONLY, *PASSED) and value is not None and value != NEUTRAL.get(name):
            raise SparseDecodeError(
                f"sparsedecode decodes greedily and does not apply generation setting {name}={value!r}, which "
                "lm-eval's hf model would: drop it from the task's generation_kwargs"
            )
    for name, neutral in NEUTRAL.items():
        value = getattr(generation_config, name, None)
        if name not in generation_kwargs and value is not None and value != neutral:
            raise SparseDecodeError(
                f"the model's generation_config sets {name}={value!r}, which lm-eval's hf model applies and "
                f"sparsedecode's greedy decoding does not: add --gen_kwargs {name}={neutral} to decode without it"
            )


def register() -> None:
    """Register :class:`SparseDecodeLM` with lm-eval as ``sparsedecode`` (lm-eval's own models stay available)."""
    import lm_eval.models  # noqa: F401 - registers lm-eval's own models first (they are looked up lazily)
    from lm_eval.api.registry import model_registry

    if model_registry.get(MODEL_NAME, None) is None:
        model_registry.register(MODEL_NAME, target=SparseDecodeLM)


class SparseDecodeLM(HFLM):
    """lm-eval's ``hf`` model decoding and scoring with sparse attention after a dense prefill (see the module)."""

    def __init__(
        self,
        pretrained: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 1,
        support: int = 193,
        selector: str = "mean-pooled",
        window: int = 64,
        block_size: int = 16,
        reuse: int = 1,
        kernel: str = "auto",
        seed: int = 0,
        sparse_tail: int = 1,
        **kwargs,
    ) -> None:
        from ..models.catalog import load_model

        self.sparse_config, sparse_tail = sparse_settings(
            batch_size=batch_size,
            support=support,
            selector=selector,
            window=window,
            block_size=block_size,
            reuse=reuse,
            kernel=kernel,
            seed=seed,
            sparse_tail=sparse_tail,
            **kwargs,
        )
        self.sparse_tail = sparse_tail
        model, tokenizer = load_model(str(pretrained), dtype=dtype)
        model = model.to(_device(device))
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, **kwargs)
        self.pretrained = str(pretrained)
        self._reuse: tuple | None = None

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "model_source": self.pretrained,
            "sparse_config": self.sparse_config.to_dict(),
            "sparse_tail": self.sparse_tail,
        }

    # --- the two model calls ----------------------------------------------------------------------------------

    def _prefilled(self, ids: list[int]):
        """``(cache, logits)``: a cache holding exactly ``ids`` (dense prefill) and the float32 logits after its last
        position (``None`` for no ids); reused, cropped back, when the previous call prefilled the same ids."""
        if self._reuse is not None and self._reuse[0] == tuple(ids):
            _, cache, logits, _ = self._reuse
            crop_cache(cache, len(ids))
            return cache, logits
        history = None
        if ids:
            cache, logits = prefill(self.model, torch.tensor([ids], device=self.device))
            if self.sparse_config.selector.uses_history:  # h2o: the prefill's attention, which the session needs
                history = prefill_history(self.model, torch.tensor([ids], device=self.device))
        else:
            from transformers import DynamicCache

            cache, logits = DynamicCache(config=self.model.config), None
        self._reuse = (tuple(ids), cache, logits, history)
        return cache, logits

    @contextlib.contextmanager
    def _sparse(self, cache):
        """The sparse session over ``cache`` as :meth:`_prefilled` left it, handed the prefill's H2O history where the
        selector ranks by it (the prefill ran outside the session)."""
        with sparse_decoding(self.model, self.sparse_config) as session:
            history = self._reuse[3] if self._reuse is not None and self._reuse[1] is cache else None
            if history is not None:
                session.adopt_history(cache, history)
            yield session

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of ``continuation`` after ``context`` and whether it is the greedy continuation."""
        split = max(len(context) - self.sparse_tail, 0)
        cache, logits = self._prefilled(context[:split])
        whole = split == len(context) and logits is not None  # sparse_tail = 0: the first token from the prefill
        scored = [logits[0]] if whole else []
        fed = context[split:] + continuation[:-1]  # teacher-forced: each step's logits score the next token
        if fed:
            with self._sparse(cache):
                decode_tokens(
                    self.model,
                    cache,
                    fed[:1],
                    len(fed),
                    teacher=[fed],
                    on_logits=lambda _, x: scored.append(x[0]),
                    nll=False,
                )
        last = torch.stack(scored[-len(continuation) :])
        targets = torch.tensor(continuation, device=last.device)
        total = float(torch.log_softmax(last, dim=-1).gather(1, targets[:, None]).sum())
        return total, bool((last.argmax(dim=-1) == targets).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``(log-probability, is greedy)`` per ``(cache key, context ids, continuation ids)``, in order."""
        del override_bs
        from tqdm import tqdm

        results = []
        for cache_key, context, continuation in tqdm(
            requests, disable=disable_tqdm or self.rank != 0, desc="sparse loglikelihood"
        ):
            if not continuation:
                raise SparseDecodeError("lm-eval sent an empty continuation to score")
            if len(continuation) > self.max_length:  # lm-eval's hf model asserts it: no context token would be left
                raise SparseDecodeError(
                    f"lm-eval sent a continuation of {len(continuation)} tokens to score, more than max_length "
                    f"({self.max_length}) holds beside a token of context"
                )
            whole = (context + continuation)[-(self.max_length + 1) :]
            kept = whole[: len(whole) - len(continuation)]
            answer = self._score(kept, continuation)
            results.append(answer)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    @torch.no_grad()
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """Greedy continuation of the one sequence in ``context`` ``(1, length)``: the context and the new tokens."""
        if context.shape[0] != 1:
            raise SparseDecodeError("sparsedecode generates one sequence at a time (batch_size 1)")
        check_greedy(generation_kwargs, self.model.generation_config)
        mask = generation_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise SparseDecodeError("sparsedecode cannot generate from a padded context")
        ids = context[0].tolist()
        split = max(len(ids) - self.sparse_tail, 1)
        cache, logits = self._prefilled(ids[:split])
        eos = self.model.generation_config.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        budget = max_length - len(ids)  # new tokens at most

        def done(new: list[int]) -> bool:
            if new[-1] in eos:
                return True
            text = self.tokenizer.decode(new, skip_special_tokens=False)
            return any(s and s in text for s in stop)

        fed = ids[split:]  # the context's tail, fed under sparse attention before the answer
        if budget <= 0:
            new = []
        elif fed:
            with self._sparse(cache):
                (out,), _ = decode_tokens(
                    self.model, cache, fed[:1], len(fed) - 1 + budget, teacher=[fed], stop=done, nll=False
                )
            new = out[len(fed) - 1 :]
        else:  # the first new token comes from the prefill
            first = int(logits[0].argmax())
            with self._sparse(cache):
                (out,), _ = decode_tokens(self.model, cache, [first], budget - 1, stop=done, nll=False)
            new = [first, *out]
        return torch.tensor([ids + new], device=context.device)
