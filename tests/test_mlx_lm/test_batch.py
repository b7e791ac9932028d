"""Restored caches in mlx-lm's BatchGenerator, and rows of a running batch persisted."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from kvstore.abc.cache import signature_string
from kvstore.mlx_lm import StorePromptCache, stream_generate
from kvstore.store import open_store
from tests.markers import needs_tested_mlx_lm

pytestmark = needs_tested_mlx_lm

TEXTS = ["Once upon a time there was a store. " * 3, "Caches restored from disk join batches. " * 3]


def single(model, tok, prompt, n, caches=None):
    return [
        r.token
        for r in mlx_lm_stream_generate(model, tok, prompt, max_tokens=n, prompt_cache=caches)
    ]


def run_batch(gen: BatchGenerator, wanted: dict[int, int], out: dict[int, list[int]], steps=None):
    """Step ``gen`` until every uid in ``wanted`` finished (or ``steps`` steps)."""
    done = 0
    while len([u for u in wanted if len(out.get(u, [])) >= wanted[u]]) < len(wanted):
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
        done += 1
        if steps is not None and done >= steps:
            return


KV = {"plain": {}, "affine": {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}}


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_restored_rows_admitted_into_a_running_batch_give_the_single_sequence_tokens(
    arch, kv, load
):
    model, tok = load(arch)
    prompts = [tok.encode(t) for t in TEXTS]
    with open_store("memory://", block_size=16) as store:
        warm = StorePromptCache(store, model, **KV[kv])
        for p in prompts:  # a first session stores both prompts
            list(stream_generate(model, tok, p, prompt_cache=warm, max_tokens=2))
        cache = StorePromptCache(store, model, **KV[kv])  # a fresh process: nothing in memory
        asks = [p + tok.encode(" Next?") for p in prompts]
        fetched = [cache.fetch(a) for a in asks]
        assert all(len(rest) < 8 for _, rest in fetched)  # the stored prompts were reused
        gen = BatchGenerator(model, max_tokens=8, completion_batch_size=4, prefill_batch_size=4)
        out: dict[int, list[int]] = {}
        fresh = cache.binding().fresh  # the families a miss gets (affine from the start)
        (running,) = gen.insert(
            [tok.encode("A sequence already decoding.")], max_tokens=[12], caches=[fresh()]
        )
        run_batch(gen, {running: 12}, out, steps=3)
        uids = gen.insert([rest for _, rest in fetched], caches=[c for c, _ in fetched])
        run_batch(gen, {running: 12, **{u: 8 for u in uids}}, out)
        gen.close()
    for uid, prompt, n in [(running, tok.encode("A sequence already decoding."), 12)] + [
        (uid, ask, 8) for uid, ask in zip(uids, asks)
    ]:
        want = single(model, tok, prompt, n, fresh())  # ends at an end-of-text token, if any
        assert out[uid][: len(want)] == want


@pytest.mark.parametrize("kv", KV)
def test_a_row_of_a_running_batch_extracted_and_persisted_restores_bit_exactly(kv, load):
    model, tok = load("llama")
    prompts = [tok.encode(t) for t in TEXTS]
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model, **KV[kv])
        gen = BatchGenerator(model, max_tokens=20)
        uids = gen.insert(prompts, caches=[cache.binding().fresh() for _ in prompts])
        out: dict[int, list[int]] = {}
        run_batch(gen, dict.fromkeys(uids, 5), out)
        (row, held) = gen.extract_cache([uids[1]])[uids[1]]
        held = list(held)
        cache.insert(held, row)
        gen.close()
        fresh = StorePromptCache(store, model, **KV[kv])
        restored, rest = fresh.fetch(held + [7])
        assert rest == [7]
        for a, b in zip(row, restored):
            assert a.offset == b.offset == len(held)
            assert type(a) is type(b) and signature_string(a) == signature_string(b)
            for x, y in zip(leaves(a), leaves(b)):
                assert x.dtype == y.dtype and mx.array_equal(x, y).item()


def leaves(cache):
    out = []
    for tree in cache.keys_and_values():
        out.extend(tree if isinstance(tree, (tuple, list)) else [tree])
    return out
