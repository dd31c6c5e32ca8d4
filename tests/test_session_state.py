"""A long-lived sparse_decoding session gives the same logits as a fresh session per prompt.

Each case is a sequence of forwards on one prompt (prefill, decode steps, crops, rollbacks, generate()). It runs
once in a fresh session and once in a long-lived session that first decoded another prompt (leaving selections,
centroids, H2O history and a reuse counter mid-way behind) and then the cases before it, one such session per
configuration; the logits must agree to float32 round-off (the long-lived session may have summed a block's
centroid in another order: :func:`conftest.logits_tolerance` over the longest context, 300).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import logits_tolerance, prompt, tiny_model
from test_attention import Oracle
from transformers import DynamicCache

from sparsedecode import SparseConfig, SparseDecodeError, compare, sparse_decoding
from sparsedecode.protocol.paired import dense_reference
from sparsedecode.session.kv_cache import GrowingCache, crop_cache

VOCAB = 96


def step(model, cache, token: int) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True).logits[0, -1].float()


def feed(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids.to(next(model.parameters()).device), cache=cache, use_cache=True).logits[0, -1].float()


def decode(model, cache, logits: torch.Tensor, steps: int, out: list) -> torch.Tensor:
    for _ in range(steps):
        logits = step(model, cache, int(logits.argmax()))
        out.append(logits)
    return logits


def new_cache(model, kind: str):
    return GrowingCache(config=model.config) if kind == "growing" else DynamicCache(config=model.config)


def earlier_blocks_changed(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The same prompt with tokens 3..40 replaced: only early distant blocks differ (the same last keys)."""
    changed = ids.clone()
    changed[0, 3:41] = (changed[0, 3:41] + 7) % (vocab - 1) + 1
    return changed


def case_ops(
    name: str, cache_kind: str = "dynamic", *, length: int = 200, steps: int = 20, vocab: int = VOCAB, warm: int = 230
):
    """The forwards of one case as a function ``model -> list of float32 logits`` (1-D, one per model call kept)."""

    def new_prompt(model):
        out: list[torch.Tensor] = []
        cache = new_cache(model, cache_kind)
        decode(model, cache, feed(model, cache, prompt(length, seed=2, vocab=vocab)), steps, out)
        return out

    def grows_past_support(model):  # starts at or below S = 97 and crosses it while decoding
        out: list[torch.Tensor] = []
        cache = new_cache(model, cache_kind)
        decode(model, cache, feed(model, cache, prompt(90, seed=3, vocab=vocab)), steps + 10, out)
        return out

    def earlier_blocks_differ(model):  # the warm-up prompt with only its early blocks changed
        out: list[torch.Tensor] = []
        cache = new_cache(model, cache_kind)
        ids = earlier_blocks_changed(prompt(warm, seed=7, vocab=vocab), vocab)
        decode(model, cache, feed(model, cache, ids), steps, out)
        return out

    def crops(model):  # crop back past completed blocks, force other tokens, decode again
        out: list[torch.Tensor] = []
        cache = new_cache(model, cache_kind)
        logits = decode(model, cache, feed(model, cache, prompt(length, seed=4, vocab=vocab)), steps // 2, out)
        crop_cache(cache, length - 15)
        for token in range(5, 20):
            out.append(step(model, cache, token))
        crop_cache(cache, length - 3)
        logits = out[-1]
        decode(model, cache, logits, steps // 2, out)
        return out

    def rollbacks(model):  # the lossless loop: draft k tokens, crop them, verify densely, keep an accepted prefix
        out: list[torch.Tensor] = []
        cache = new_cache(model, cache_kind)
        length_now = length
        logits = feed(model, cache, prompt(length, seed=5, vocab=vocab))
        token = int(logits.argmax())
        for round_ in range(5):
            drafts, t = [], token
            for _ in range(3):
                logits = step(model, cache, t)
                out.append(logits)
                t = int(logits.argmax())
                drafts.append(t)
            crop_cache(cache, length_now)
            verified = model(input_ids=torch.tensor([[token, *drafts]]), cache=cache, use_cache=True).logits[0]
            out.extend(verified.float())
            accepted = round_ % 3  # a fixed acceptance pattern, so both sessions take the same path
            length_now += accepted + 1
            crop_cache(cache, length_now)
            token = int(verified[accepted].argmax())
        decode(model, cache, out[-1], 4, out)
        return out

    def generate(model):  # model.generate inside the session, twice (two prompts)
        out: list[torch.Tensor] = []
        for seed, size, new in ((8, length, steps), (9, 92, steps + 20)):  # the second one crosses S
            result = model.generate(
                prompt(size, seed=seed, vocab=vocab),
                max_new_tokens=new,
                min_new_tokens=new,  # no early end of sequence: both sessions run every step
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
            out.extend(logits[0].float() for logits in result.logits)
        return out

    return {
        "new-prompt": new_prompt,
        "grows-past-support": grows_past_support,
        "earlier-blocks-differ": earlier_blocks_differ,
        "crops": crops,
        "rollbacks": rollbacks,
        "generate": generate,
    }[name]


def warm_up(model, *, length: int = 230, steps: int = 13, vocab: int = VOCAB):
    """Another prompt decoded sparsely (an odd number of steps: with R = 4 the reuse counter is left mid-way)."""
    cache = DynamicCache(config=model.config)
    decode(model, cache, feed(model, cache, prompt(length, seed=7, vocab=vocab)), steps, [])
    return cache


def long_lived_and_fresh_cases(model, cfg: SparseConfig, cases: dict, **warm) -> tuple[dict, dict, dict]:
    """Every case in one long-lived session (warmed up once; each case then also finds what the cases before it
    left behind), and each case again in a fresh session of its own. The oracle's steps are counted per case."""
    long_lived, fresh, oracle_steps = {}, {}, {}
    oracle = None
    with torch.no_grad():
        with sparse_decoding(model, cfg) as session:
            if not cfg.selector.uses_history:
                oracle = Oracle(cfg)
                session.observers.append(oracle)
            warm_up(model, **warm)
            for name, ops in cases.items():
                before = oracle.steps if oracle else 0
                long_lived[name] = torch.stack(ops(model))
                oracle_steps[name] = (oracle.steps if oracle else 0) - before
        for name, ops in cases.items():
            with sparse_decoding(model, cfg):
                fresh[name] = torch.stack(ops(model))
    return long_lived, fresh, {"oracle": oracle, "steps": oracle_steps}


CASES = ("new-prompt", "grows-past-support", "earlier-blocks-differ", "crops", "rollbacks", "generate")
SETTINGS = [("mean-pooled", "torch"), ("mean-pooled", "auto"), ("quest", "torch"), ("h2o", "auto")]


@pytest.mark.parametrize("reuse", [1, 4])
@pytest.mark.parametrize("selector, kernel", SETTINGS)
def test_long_lived_session_equals_fresh_sessions(arch, selector, kernel, reuse):
    """Every case of CASES, in one long-lived session per configuration (not one per case)."""
    model = tiny_model(arch)
    cfg = SparseConfig(support=97, reuse=reuse, selector=selector, kernel=kernel)
    long_lived, fresh, oracle = long_lived_and_fresh_cases(model, cfg, {case: case_ops(case) for case in CASES})
    assert list(long_lived) == list(CASES)
    for case in CASES:
        assert long_lived[case].shape == fresh[case].shape, case
        tolerance = logits_tolerance(fresh[case], model, positions=300)
        torch.testing.assert_close(long_lived[case], fresh[case], atol=tolerance, rtol=0, msg=case)
        assert torch.equal(long_lived[case].argmax(-1), fresh[case].argmax(-1)), case
        if oracle["oracle"] is not None:  # every sparse step: refreshes are fresh selections, reuse repeats the last
            assert oracle["steps"][case] > 0, case
    if oracle["oracle"] is not None:
        assert oracle["oracle"].max_error_ratio < 1, oracle["oracle"].max_error


@pytest.mark.parametrize("cache_kind", ["dynamic", "growing"])
def test_in_place_and_concatenating_caches_alike(cache_kind):
    model = tiny_model("llama")
    cases = {case: case_ops(case, cache_kind) for case in ("new-prompt", "crops", "rollbacks")}
    for reuse in (1, 4):
        cfg = SparseConfig(support=97, reuse=reuse)
        long_lived, fresh, oracle = long_lived_and_fresh_cases(model, cfg, cases)
        for case in cases:
            tolerance = logits_tolerance(fresh[case], model, positions=300)
            torch.testing.assert_close(long_lived[case], fresh[case], atol=tolerance, rtol=0, msg=case)
        assert oracle["oracle"].max_error_ratio < 1, oracle["oracle"].max_error


def test_two_caches_interleaved_in_one_session_stay_apart(arch):
    """Steps alternate between two caches whose lengths make each step look like the other's successor."""
    model = tiny_model(arch)
    cfg = SparseConfig(support=97)
    a_ids, b_ids = prompt(200, seed=11), prompt(201, seed=12)

    def alone(ids):
        out: list[torch.Tensor] = []
        with sparse_decoding(model, cfg):
            cache = DynamicCache(config=model.config)
            decode(model, cache, feed(model, cache, ids), 12, out)
        return torch.stack(out)

    oracle = Oracle(cfg)
    with torch.no_grad(), sparse_decoding(model, cfg) as session:
        session.observers.append(oracle)
        caches = [DynamicCache(config=model.config), GrowingCache(config=model.config)]
        logits = [feed(model, caches[0], a_ids), feed(model, caches[1], b_ids)]
        out: list[list[torch.Tensor]] = [[], []]
        for _ in range(12):
            for i in (0, 1):
                logits[i] = step(model, caches[i], int(logits[i].argmax()))
                out[i].append(logits[i])
        expected = [alone(a_ids), alone(b_ids)]
    for got, want in zip(out, expected):
        torch.testing.assert_close(torch.stack(got), want, atol=logits_tolerance(want, model, positions=213), rtol=0)
    assert oracle.steps == 2 * 24 and oracle.max_error_ratio < 1, oracle.max_error


def test_blocks_are_kept_exactly_when_the_cache_continues():
    """No block statistic is recomputed while one cache simply grows; after a crop only the blocks past it are."""
    model = tiny_model("llama")
    with torch.no_grad(), sparse_decoding(model, SparseConfig(support=97)) as session:
        cache = DynamicCache(config=model.config)
        logits = decode(model, cache, feed(model, cache, prompt(300)), 20, [])
        state = session.layers[0]
        blocks = (320 - 64 - 1) // 16  # complete distant blocks at the last step (N = 320)
        assert state.centroids.computed == state.centroids.count == blocks
        crop_cache(cache, 200)  # blocks wholly inside [0, 200) stay: (200 - 1) // 16 of them
        decode(model, cache, logits, 120, [])
        assert state.centroids.count == blocks
        assert state.centroids.computed == blocks + blocks - (200 - 1) // 16


def test_dense_steps_end_the_reuse_chain():
    """R = 4: a prompt that crosses S selects afresh at its first sparse step, whatever came before."""
    model = tiny_model("qwen2")
    cfg = SparseConfig(support=97, reuse=4)
    seen: list[tuple[int, int]] = []
    with torch.no_grad(), sparse_decoding(model, cfg) as session:
        session.observers.append(lambda view: seen.append((view.layer, view.step)))
        warm_up(model)
        del seen[:]
        cache = DynamicCache(config=model.config)
        decode(model, cache, feed(model, cache, prompt(90, seed=3)), 20, [])
    assert [s for layer, s in seen if layer == 0] == list(range(1, 14)), "the chain restarts at 1 after dense steps"


def test_h2o_without_its_prefill_refuses_then_adopts_a_history():
    model = tiny_model("llama")
    ids = prompt(200)
    cfg = SparseConfig(support=97, selector="h2o")
    with torch.no_grad():
        outside = DynamicCache(config=model.config)
        first = feed(model, outside, ids)  # outside any session: no H2O history for the prompt
        with sparse_decoding(model, cfg), pytest.raises(SparseDecodeError, match="h2o needs"):
            step(model, outside, int(first.argmax()))
        cache = DynamicCache(config=model.config)
        feed(model, cache, ids)  # prefilled outside again
        with sparse_decoding(model, cfg) as recorder:
            feed(model, DynamicCache(config=model.config), ids)
        history = recorder.attention_history()
        adopted: list[torch.Tensor] = []
        with sparse_decoding(model, cfg) as session:
            session.adopt_history(cache, history)
            decode(model, cache, first, 10, adopted)
        inside: list[torch.Tensor] = []
        with sparse_decoding(model, cfg):
            own = DynamicCache(config=model.config)
            decode(model, own, feed(model, own, ids), 10, inside)
    inside = torch.stack(inside)  # the same history, adopted or recorded: float32 round-off of reordered sums at most
    tolerance = logits_tolerance(inside, model, positions=210)
    torch.testing.assert_close(torch.stack(adopted), inside, atol=tolerance, rtol=0)


def test_compare_gives_h2o_the_prefill_history():
    """compare() (prefill outside the sparse sessions) equals decoding with the prefill inside an h2o session."""
    model = tiny_model("qwen2")
    ids = prompt(220)
    cfg = SparseConfig(support=97, selector="h2o")
    result = compare(model, None, ids, cfg, tokens=12)
    with torch.no_grad(), sparse_decoding(model, cfg):
        cache = DynamicCache(config=model.config)
        first = feed(model, cache, ids)
        tokens = [int(first.argmax())]
        for _ in range(11):
            tokens.append(int(step(model, cache, tokens[-1]).argmax()))
    assert result.sparse_tokens == tokens


@pytest.mark.parametrize("selector", ["oracle-tokens", "mean-pooled", "h2o"])
def test_distinct_distant_positions_are_counted_once(selector):
    """Positions read at dense steps and again at sparse steps count once: never more than exist."""
    model = tiny_model("llama")
    tokens = 60
    result = compare(model, None, prompt(80), SparseConfig(support=97, selector=selector), tokens=tokens)
    final = 80 + tokens - 1  # positions at the last decode step, the current one included
    possible = final - 64 - 1
    assert result.sparse_steps > 0 and result.dense_fallback_steps > 0
    assert result.mean_unique_distant_positions_per_kv <= possible
    with torch.no_grad(), sparse_decoding(model, SparseConfig(support=97, selector=selector)) as session:
        session.track_reads = True
        cache = DynamicCache(config=model.config)
        decode(model, cache, feed(model, cache, prompt(80)), tokens - 1, [])
        unique = session.unique_distant_positions()
    assert unique.max() <= possible
    assert unique.min() >= 97 - 64 - 1, "the dense steps alone read every distant position up to N = S"


# --- the real model (SmolLM2-135M): the "must show" of the issue, on short contexts ---


@pytest.mark.realmodel
@pytest.mark.parametrize("reuse", [1, 4])
def test_long_lived_session_equals_fresh_sessions_on_real_model(smollm2, reuse):
    smollm2 = smollm2[0]
    vocab = smollm2.config.vocab_size
    cfg = SparseConfig(support=97, reuse=reuse)
    warm = dict(length=160, steps=9, vocab=vocab)  # short contexts: S = 97 of 150-200 positions
    cases = {case: case_ops(case, length=150, steps=10, vocab=vocab, warm=warm["length"]) for case in CASES}
    long_lived, fresh, oracle = long_lived_and_fresh_cases(smollm2, cfg, cases, **warm)
    for case in CASES:
        assert torch.equal(long_lived[case].argmax(-1), fresh[case].argmax(-1)), case
        tolerance = logits_tolerance(fresh[case], smollm2, positions=200)  # float32 round-off over 30 layers
        torch.testing.assert_close(long_lived[case], fresh[case], atol=tolerance, rtol=0, msg=case)
        assert oracle["steps"][case] > 0, case
    assert oracle["oracle"].max_error_ratio < 1, oracle["oracle"].max_error


def test_generate_gives_h2o_the_prefill_history():
    from sparsedecode.decoding.generate import generate

    model = tiny_model("llama")
    ids = prompt(200)
    cfg = SparseConfig(support=97, selector="h2o")
    sparse = generate(model, ids, cfg, 12, mode="sparse")
    with torch.no_grad(), sparse_decoding(model, cfg):
        cache = DynamicCache(config=model.config)
        tokens = [int(feed(model, cache, ids).argmax())]
        for _ in range(11):
            tokens.append(int(step(model, cache, tokens[-1]).argmax()))
    assert sparse.tokens == tokens
    dense = generate(model, ids, None, 12, mode="dense")
    assert generate(model, ids, cfg, 12, mode="lossless", draft_tokens=3).tokens == dense.tokens


def test_reset_forgets_everything_and_the_next_step_selects_afresh():
    model = tiny_model("llama")
    seen: list[int] = []
    with torch.no_grad(), sparse_decoding(model, SparseConfig(support=97, reuse=4)) as session:
        session.observers.append(lambda view: seen.append(view.step) if view.layer == 0 else None)
        session.track_reads = True
        cache = DynamicCache(config=model.config)
        logits = decode(model, cache, feed(model, cache, prompt(200)), 6, [])
        session.reset()
        assert session.centroid_bytes() >= 0 and session.unique_distant_positions().numel() == 0
        decode(model, cache, logits, 3, [])
        state = session.layers[0]
    assert seen == [1, 2, 3, 4, 5, 6, 1, 2, 3], "after reset the chain starts again"
    # selections at N = 201 (steps 1 and 5 see 8 complete blocks) and, after the reset, at N = 207: 8 blocks again
    assert state.centroids.computed == (201 - 64 - 1) // 16 + (207 - 64 - 1) // 16


def test_dense_passes_stay_dense_inside_a_session_the_caller_has_open():
    """generate(mode="dense"), dense_reference and compare's own reference are dense even inside an open sparse
    session on the same model (they used to run under it, and a support covering the context then "diverged")."""
    from sparsedecode import generate

    model = tiny_model("llama")
    ids = prompt(150)
    dense = generate(model, ids, None, 30, mode="dense").tokens
    batch = [prompt(150), prompt(120, seed=3)]
    dense_batch = [g.tokens for g in generate(model, batch, None, 30, mode="dense")]
    with sparse_decoding(model, SparseConfig(support=97)) as outer:
        assert generate(model, ids, None, 30, mode="dense").tokens == dense
        assert [g.tokens for g in generate(model, batch, None, 30, mode="dense")] == dense_batch
        assert dense_reference(model, ids, tokens=30).tokens == dense
        covering = compare(model, None, ids, SparseConfig(support=193), 30)  # S >= context + T - 1: dense
        assert covering.dense_tokens == dense and covering.survives and covering.first_divergence == 30
        assert outer.sparse_steps == 0
        # the outer session still serves the caller's own decoding
        assert generate(model, ids, SparseConfig(support=97), 30, mode="sparse").tokens != dense
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            decode(model, cache, feed(model, cache, ids), 29, [])
        assert outer.sparse_steps > 0


@pytest.mark.parametrize("cfg", [SparseConfig(support=97, reuse=4), SparseConfig(support=97, selector="h2o")])
def test_library_calls_leave_a_session_the_caller_has_open_undisturbed(cfg):
    """The caller decodes on its own cache in its own session, calls the library in between, then goes on: its
    logits are those of the same decoding without the call (a dense prefill used to run through the caller's
    session, restarting its reuse chain and replacing its H2O history)."""
    from sparsedecode import generate

    model = tiny_model("llama")
    ids, other = prompt(150), prompt(140, seed=7)
    calls = {
        "generate dense": lambda: generate(model, other, None, 6, mode="dense"),
        "generate dense, batch": lambda: generate(model, [other, ids], None, 6, mode="dense"),
        "generate sparse": lambda: generate(model, other, SparseConfig(support=97), 6, mode="sparse"),
        "generate lossless": lambda: generate(model, other, SparseConfig(support=97), 6, mode="lossless"),
        "dense_reference": lambda: dense_reference(model, other, tokens=6),
        "compare": lambda: compare(model, None, other, SparseConfig(support=113), 6),
        "compare, batch": lambda: compare(model, None, [other, ids], SparseConfig(support=113), 6),
    }

    def own_decoding(between) -> torch.Tensor:
        out: list[torch.Tensor] = []
        with torch.no_grad(), sparse_decoding(model, cfg):
            cache = DynamicCache(config=model.config)
            logits = decode(model, cache, feed(model, cache, ids), 3, out)
            between()
            decode(model, cache, logits, 9, out)
        return torch.stack(out)

    expected = own_decoding(lambda: None)
    for name, call in calls.items():
        torch.testing.assert_close(own_decoding(call), expected, atol=0, rtol=0, msg=name)  # the same arithmetic


@pytest.mark.parametrize("batched", [False, True])
def test_a_reference_left_mid_decode_by_an_interrupt_is_taken_back(batched):
    """An interrupt during compare leaves the reference's cache as it found it, and a reference whose cache grew
    anyway (the caller decoded on it) is brought back to the prompt before use: the next compare is unchanged."""
    model = tiny_model("llama")
    ids = [prompt(150), prompt(130, seed=5)] if batched else prompt(150)
    cfg = SparseConfig(support=97)
    ref = dense_reference(model, ids, tokens=20)  # one prompt or several
    expected = compare(model, None, ids, cfg, 20, reference=ref)

    def interrupt(stage, done, total):
        if stage == "sparse decode" and done == 5:
            raise KeyboardInterrupt

    length = ref.cache.get_seq_length()
    with pytest.raises(KeyboardInterrupt):
        compare(model, None, ids, cfg, 20, reference=ref, progress=interrupt)
    assert ref.cache.get_seq_length() == length
    if not batched:
        with torch.no_grad():
            decode(model, ref.cache, feed(model, ref.cache, prompt(3, seed=9)), 4, [])
        assert ref.cache.get_seq_length() == length + 7
    again = compare(model, None, ids, cfg, 20, reference=ref)
    for a, b in zip(again if batched else [again], expected if batched else [expected]):
        assert a.sparse_tokens == b.sparse_tokens and a.teacher_forced_match == b.teacher_forced_match
        # the same arithmetic gives the same NLLs; 1e-9 percent points is float64 round-off of exp and the ratio
        assert a.delta_ppl_percent == pytest.approx(b.delta_ppl_percent, abs=1e-9)


def test_sessions_exited_out_of_order_leave_the_open_one_in_force():
    """Found by probing: exiting a session by hand while one entered after it stayed open restored the mapping from
    before the first, dropping the open session (its model decoded dense); exiting the second then revived the
    first's layers."""
    from sparsedecode.session.session import ACTIVE_SESSIONS

    first_model, second_model = tiny_model("llama"), tiny_model("qwen2")
    cfg, ids = SparseConfig(support=97), prompt(200)
    first, second = sparse_decoding(first_model, cfg), sparse_decoding(second_model, cfg)
    first.__enter__()
    open_one = second.__enter__()
    first.__exit__(None, None, None)
    second_model.generate(ids, max_new_tokens=6, do_sample=False)
    assert open_one.sparse_steps == 5 * 2 and open_one.dense_steps == 0
    second.__exit__(None, None, None)
    assert not ACTIVE_SESSIONS.get()  # nothing of the closed sessions left in force


def test_h2os_prefill_history_is_dense_to_the_prompts_last_token(monkeypatch):
    """Found by probing: a prompt whose last prefill chunk held one token took that token for a sparse h2o step (N
    past the recorder's support), so the history every h2o run adopts was not the dense prefill's."""
    from sparsedecode.session import hf

    model, ids = tiny_model("llama"), prompt(201)
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 4096)
    whole = hf.prefill_history(model, ids)  # one forward
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 100)  # chunks of 100, 100 and 1
    chunked = hf.prefill_history(model, ids)
    for layer, history in whole.items():
        torch.testing.assert_close(chunked[layer], history, rtol=1e-5, atol=1e-5)


def test_a_forward_the_session_does_not_see_drops_its_proof_under_inference_mode():
    """Found by probing: under torch.inference_mode (no version counters) a crop and re-extension of a static cache
    through dense_attention, to the same length with other tokens, kept the centroids of the overwritten keys."""
    from transformers import StaticCache

    from sparsedecode.session import dense_attention

    model, cfg = tiny_model("llama"), SparseConfig(support=21, window=8, block_size=4)
    ids, tokens = prompt(60), prompt(40, seed=5)

    def step(cache, token):
        return model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]

    with torch.inference_mode(), sparse_decoding(model, cfg):
        cache = StaticCache(config=model.config, max_cache_len=128)
        model(input_ids=ids, cache=cache, use_cache=True)
        for i in range(4):
            step(cache, tokens[:, i : i + 1])
        cache.crop(-40)  # back to 24 positions
        with dense_attention(model):
            model(input_ids=tokens * 0 + 7, cache=cache, use_cache=True)  # back to 64 positions, other keys
        fresh = copy.deepcopy(cache)
        logits = step(cache, tokens[:, 20:21])
    with torch.inference_mode(), sparse_decoding(model, cfg):
        expected = step(fresh, tokens[:, 20:21])
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("selector", ["mean-pooled", "quest", "h2o"])
def test_a_session_under_autograd_keeps_no_graph_in_its_state(selector):
    """Found probing decoding with gradients enabled: the block statistics (centroids, Quest's minimum and maximum)
    and H2O's history were computed from keys and attention that require gradients, so the session's state held the
    autograd graph of the prefill and of every step (a forward's activations) as long as the session object lived,
    and H2O's history chained every step's graph. Selection ranks by them and needs no gradient: the state holds
    values only, and the tokens are those of the same session under ``torch.no_grad``."""
    ids = prompt(150)
    tokens = {}
    for grad in (False, True):
        model = tiny_model("llama").requires_grad_(True)
        cfg = SparseConfig(support=33, window=8, block_size=8, selector=selector)
        with torch.set_grad_enabled(grad), sparse_decoding(model, cfg) as session:
            cache = DynamicCache(config=model.config)
            logits = model(ids, cache=cache, use_cache=True).logits
            tokens[grad] = []
            for _ in range(3):
                tokens[grad].append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([[tokens[grad][-1]]]), cache=cache, use_cache=True).logits
        assert session.sparse_steps > 0
        held = [t for state in session.layers.values() for t in (*state.centroids._stats.values(), state.history)]
        assert not any(t.requires_grad for t in held if t is not None)
    assert tokens[True] == tokens[False]


def test_a_cropped_growing_cache_keeps_its_proof_under_inference_mode():
    """Found by probing: under torch.inference_mode a view keeps no ``_base``, so a GrowingCache cropped (as lossless
    drafting crops it every round) was taken for other memory and the layers' state (block statistics, H2O's history)
    was dropped; its views name their buffer, so the positions the crop keeps are proven unchanged, as under no_grad."""
    model, ids = tiny_model("llama"), prompt(150)
    with torch.inference_mode(), sparse_decoding(model, SparseConfig(support=97)) as session:
        cache = GrowingCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        for position in range(150, 153):
            model(input_ids=ids[:, :1], cache=cache, use_cache=True, position_ids=torch.tensor([[position]]))
        crop_cache(cache, 151)
        state = session.layers[0]
        state.look(cache)
        assert state.unchanged == 151
