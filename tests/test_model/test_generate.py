"""Acceptance 2 and 4: chunked prefill equals unchunked; seeded sampling is reproducible;
generation continues from caches that already hold a prefix."""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.bridge import generate_tokens as bridge_generate_tokens
from kvstore.errors import CapabilityError
from kvstore.model import (
    CachePolicy,
    GeneratedToken,
    GenerationStats,
    build_model,
    generate,
    generate_tokens,
    make_sampler,
    prefill_chunks,
)
from kvstore.model.generate import prefill

from .conftest import PREFILL, prompt_tokens, rel_err, teacher_forced


@pytest.fixture(scope="module", params=["tiny", "tiny-gemma3"])
def model(request):
    return build_model(request.param)


@given(
    start=st.integers(0, 300),
    length=st.integers(1, 700),
    block=st.sampled_from([None, 1, 16, 256]),
    chunk_blocks=st.integers(1, 5),
    extra=st.integers(0, 15),
)
def test_chunk_plan_is_block_aligned_and_covers_the_prompt(
    start, length, block, chunk_blocks, extra
):
    chunk = (block or 1) * chunk_blocks + extra
    chunks = prefill_chunks(start, start + length, chunk, block)
    assert chunks[0][0] == start and chunks[-1][1] == start + length
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(0 < end - begin <= chunk for begin, end in chunks)
    assert all(end % (block or 1) == 0 for _, end in chunks[:-1])


def test_chunk_size_below_block_size_is_refused():
    with pytest.raises(ValueError, match="chunk_size must be >= block_size"):
        prefill_chunks(0, 10, 8, 16)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 33, 100])
def test_chunked_prefill_equals_unchunked(model, chunk_size):
    tokens = prompt_tokens()
    whole = teacher_forced(model, model.make_cache(), tokens, chunks=[(0, PREFILL)])
    chunks = prefill_chunks(0, PREFILL, chunk_size, None)
    assert rel_err(teacher_forced(model, model.make_cache(), tokens, chunks=chunks), whole) <= 1e-5


@pytest.mark.parametrize("policy", [None, CachePolicy(kv_bits=8)])
def test_block_aligned_chunks_from_a_restored_prefix_equal_unchunked(model, policy):
    tokens = prompt_tokens()
    whole = teacher_forced(model, model.make_cache(policy), tokens, chunks=[(0, PREFILL)])
    caches = model.make_cache(policy)
    prefill(model, tokens, caches, [(0, 37)])  # a prefix that ends mid-block
    chunks = prefill_chunks(37, PREFILL, 48, 16)
    assert chunks[0] == (37, 80)
    assert rel_err(teacher_forced(model, caches, tokens, chunks=chunks), whole) <= 1e-5


def test_each_chunk_is_still_in_every_cache_when_the_callback_runs(model):
    """What lets a store capture every block: at the callback, all layers have
    the chunk's rows, even the sliding layers whose window is shorter than it."""
    seen = []

    def on_chunk(end, caches):
        begin = seen[-1] if seen else 0
        seen.append(end)
        for cache in caches:
            assert cache.offset == end
            held = (
                cache.temporal_keys_and_values()[0].shape[2]
                if hasattr(cache, "temporal_keys_and_values")
                else cache.offset
            )
            assert held >= end - begin

    tokens = prompt_tokens()
    _, stats = generate_tokens(
        model,
        tokens[:PREFILL],
        max_tokens=2,
        chunk_size=64,
        block_size=16,
        on_prefill_chunk=on_chunk,
    )
    assert seen == [64, 128] and stats.prefilled_tokens == PREFILL


def greedy_reference(model, tokens, n):
    caches, out = model.make_cache(), []
    logits = model(tokens[None], cache=caches)[:, -1]
    for _ in range(n):
        out.append(int(logits.argmax(-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=caches)[:, -1]
    return out


def test_greedy_generation_is_the_argmax_chain(model):
    tokens = prompt_tokens()[:100]
    got, stats = generate_tokens(model, tokens, max_tokens=12, chunk_size=32, block_size=16)
    assert got == greedy_reference(model, tokens, 12)
    assert isinstance(stats, GenerationStats)
    assert (stats.prompt_tokens, stats.reused_tokens, stats.prefilled_tokens) == (100, 0, 100)
    assert stats.generated_tokens == 12
    assert stats.ttft_s > 0 and stats.prefill_tps > 0 and stats.decode_tps > 0


def test_stream_yields_one_type_with_the_stats_on_the_last_item(model):
    items = list(generate(model, [1, 2, 3], max_tokens=3))
    assert [type(i) for i in items] == [GeneratedToken] * 3
    assert [i.stats is None for i in items] == [True, True, False]
    assert isinstance(items[-1].stats, GenerationStats)
    assert items[-1].stats.generated_tokens == 3
    assert [i.token for i in items] == generate_tokens(model, [1, 2, 3], max_tokens=3)[0]


def test_caches_hold_prompt_and_all_streamed_tokens_but_the_last(model):
    caches = model.make_cache()
    tokens, _ = generate_tokens(model, list(range(20)), caches=caches, max_tokens=5)
    assert len(tokens) == 5 and all(c.offset == 24 for c in caches)


def test_stop_tokens_end_generation(model):
    tokens = prompt_tokens()[:50]
    free = greedy_reference(model, tokens, 8)
    got, stats = generate_tokens(model, tokens, max_tokens=8, stop_tokens={free[2]})
    assert got == free[: free.index(free[2]) + 1] and stats.generated_tokens == len(got)


def sample(model, **kwargs):
    return generate_tokens(model, list(range(40)), max_tokens=16, **kwargs)[0]


def test_seeded_sampling_is_reproducible(model):
    first = sample(model, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    mx.random.seed(12345)  # the global random state must not matter
    assert sample(model, temperature=1.0, top_p=0.95, top_k=50, seed=7) == first
    assert sample(model, sampler=make_sampler(1.0, 0.95, 50, seed=7)) == first
    others = [sample(model, temperature=1.0, top_p=0.95, top_k=50, seed=s) for s in (8, 9)]
    assert any(o != first for o in others)


def test_degenerate_filters_are_greedy(model):
    greedy = sample(model)
    assert sample(model, temperature=1.0, top_k=1, seed=0) == greedy
    assert sample(model, temperature=1.0, top_p=1e-9, seed=0) == greedy


def test_sampler_settings_are_checked():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        make_sampler(-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        make_sampler(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        make_sampler(1.0, top_k=2.5)


@pytest.mark.parametrize("prefix", [1, 37, 64, 99])
def test_continuing_from_filled_caches_equals_a_fresh_run(model, prefix):
    tokens = prompt_tokens()[:100]
    fresh, _ = generate_tokens(model, tokens, max_tokens=6)
    caches = model.make_cache()
    prefill(model, tokens, caches, [(0, prefix)])  # e.g. restored from a store
    got, stats = generate_tokens(
        model,
        tokens,
        caches=caches,
        prefix_len=prefix,
        max_tokens=6,
        chunk_size=32,
        block_size=16,
    )
    assert got == fresh
    assert (stats.reused_tokens, stats.prefilled_tokens) == (prefix, 100 - prefix)


def test_fully_cached_prompt_leaves_one_token_to_process():
    model = build_model("tiny")
    tokens = prompt_tokens()[:30]
    fresh, _ = generate_tokens(model, tokens, max_tokens=4)
    caches = model.make_cache()
    prefill(model, tokens, caches, [(0, 30)])
    got, stats = generate_tokens(model, tokens, caches=caches, max_tokens=4)
    assert got == fresh and (stats.reused_tokens, stats.prefilled_tokens) == (29, 1)


def test_fully_cached_prompt_with_a_wrapped_window_cannot_be_trimmed():
    model = build_model("tiny-gemma3")  # window 32
    tokens = prompt_tokens()[:40]
    caches = model.make_cache()
    prefill(model, tokens, caches, [(0, 40)])
    with pytest.raises(CapabilityError, match="cannot drop the last 1"):
        generate_tokens(model, tokens, caches=caches, max_tokens=1)


def test_argument_errors():
    model = build_model("tiny")
    filled = model.make_cache()
    prefill(model, prompt_tokens(), filled, [(0, 4)])
    with pytest.raises(ValueError, match=r"same number of tokens; received offsets \[0, 4\]"):
        mixed = [filled[0], model.make_cache()[1]]
        generate_tokens(model, list(range(10)), caches=mixed, max_tokens=1)
    with pytest.raises(ValueError, match="prefix_len=3 but the caches hold 4"):
        generate_tokens(model, list(range(10)), caches=filled, prefix_len=3, max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        generate_tokens(model, [1], max_tokens=0)
    with pytest.raises(ValueError, match="either sampler= or temperature"):
        generate_tokens(model, [1], max_tokens=1, sampler=make_sampler(), temperature=0.5)
    for bad in ([], [[1, 2]], [0.5, 1.5]):
        with pytest.raises(ValueError, match="non-empty 1-D sequence of token ids"):
            generate_tokens(model, bad, max_tokens=1)
    with pytest.raises(TypeError, match=r"knows no store.*kvstore\.bridge\.generate"):
        generate_tokens(model, [1], store=object(), max_tokens=1)
    with pytest.raises(TypeError, match="Unexpected keyword argument.*colour"):
        generate_tokens(model, [1], max_tokens=1, colour="blue")
    with pytest.raises(CapabilityError, match="store= takes a prefix store"):
        bridge_generate_tokens(model, [1], store=object(), max_tokens=1)


def test_mlx_lm_generate_drives_our_model(model):
    """mlx-lm compatible: stock ``generate_step`` (our make_cache, our caches) gives our tokens."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step

    tokens = prompt_tokens()[:60]
    ours, _ = generate_tokens(model, tokens, max_tokens=8)
    theirs = [int(t) for t, _ in generate_step(tokens, model, max_tokens=8, prefill_step_size=16)]
    assert theirs == ours


def test_prompt_as_list_range_numpy_or_mlx_array():
    import numpy as np

    model = build_model("tiny")
    runs = [list(range(12)), range(12), np.arange(12), mx.arange(12)]
    assert len({tuple(generate_tokens(model, p, max_tokens=3)[0]) for p in runs}) == 1
