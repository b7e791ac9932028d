"""Saving live caches into a prefix store and restoring them, in one process.

Real tiny models (``kvstore.model``), real LMDB. What a restore returns is
compared with what the model's own prefill of the same tokens holds: bit for
bit where the rows were computed the same way.
"""

from __future__ import annotations

import logging
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvstore.abc.store import MissReason
from kvstore.bridge import generate_tokens
from kvstore.bridge.namespace import namespace_for_model
from kvstore.caches import KVCache, QuantizedKVCache
from kvstore.codecs import snapshot, transcode
from kvstore.codecs.growing import restore_capacity
from kvstore.codecs.rows import growth_capacity
from kvstore.errors import StoreConfigError
from kvstore.model import CachePolicy
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.store.kv import restore
from kvstore.store.kv import save as save_module
from kvstore.store.kv.save import BlockEncoder
from tests.markers import needs_tested_mlx_lm

from .kv_helpers import (
    BLOCK,
    CHUNK,
    FAMILIES,
    assert_same_caches,
    held_rows,
    log_probs_recorder,
    model_for,
    prefilled,
    prompt,
)


@pytest.fixture
def lmdb_url(tmp_path):
    return f"lmdb://{tmp_path / 'store'}"


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """A restore's arrays are allocated holding all ones (NaN in every float dtype), as
    reused memory may."""
    from kvstore.codecs import fill

    real_allocated = fill._allocated

    def poisoned(*args, **kwargs):
        owned = real_allocated(*args, **kwargs)
        for _, view in owned or ():
            view.view(np.uint8).fill(0xFF)
        return owned

    monkeypatch.setattr(fill, "_allocated", poisoned)


def open_(url, **options):
    options.setdefault("block_size", BLOCK)
    options.setdefault("touch_interval", 0)
    return open_store(url, **options)


def setup(family):
    config, policy = FAMILIES[family]
    model = model_for(config)
    return model, policy, namespace_for_model(model, policy=policy)


def capture_save(store, model, tokens, policy):
    """Save ``tokens`` the way generate does (prefill capture); returns the prefill's caches."""
    generate_tokens(model, tokens, store=store, policy=policy, max_tokens=1, chunk_size=CHUNK)
    return prefilled(model, tokens, policy)


def saved_and_restored(url, family, tokens):
    """``family``'s model, the caches of ``tokens`` saved into a fresh store at ``url``,
    and those restored from it in full: ``(model, expected, restored)``."""
    model, policy, ns = setup(family)
    with open_(url) as store:
        expected = capture_save(store, model, tokens, policy)
        restored = store.restore(store.lookup(ns, [*tokens, 3]), model.make_cache(policy))
    return model, expected, restored


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_prompt_restores_bit_exactly_and_continues_alike(family, lmdb_url):
    model, policy, ns = setup(family)
    tokens = prompt(1, 70)
    with open_(lmdb_url) as store:
        expected = capture_save(store, model, tokens, policy)
        match = store.lookup(ns, tokens + [3])
        assert match.tokens == 70 and len(match.blocks) == 5
        restored = store.restore(match, model.make_cache(policy))
    assert_same_caches(restored, expected)
    more = mx.array([prompt(2, 5)])
    assert mx.array_equal(model(more, cache=restored), model(more, cache=expected)).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_caches_restored_as_views_of_shared_buffers_continue_alike_token_by_token(
    family, lmdb_url, monkeypatch
):
    # Through MLX's loader a restore's arrays are views cut from a few buffers: each
    # layer's next tokens (a window's written in place, a growing cache's appended)
    # must change that layer alone, step after step, as in caches never stored.
    from kvstore.codecs import fill
    from kvstore.codecs.one_buffer import padded_nbytes

    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    grouped = []
    real_groups = fill._buffer_groups

    def two_largest_a_buffer(specs):
        monkeypatch.setattr(fill, "BUFFER_MAX_BYTES", 2 * max(map(padded_nbytes, specs)))
        grouped.append(real_groups(specs))
        return grouped[-1]

    monkeypatch.setattr(fill, "_buffer_groups", two_largest_a_buffer)
    model, expected, restored = saved_and_restored(lmdb_url, family, prompt(1, 70))
    assert_same_caches(restored, expected)
    sizes = [len(group) for groups in grouped for group in groups]
    assert len(sizes) > 1 and max(sizes) > 1, sizes
    for t in prompt(6, 40):  # past a 32-token window: every slot rewritten
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()
    assert_same_caches(restored, expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_caches_copied_and_hashed_record_by_record_restore_bit_exactly(
    family, lmdb_url, hashed_as_copied, poisoned_allocations, monkeypatch
):
    # Each record's rows copied in the order they lie in it, its payload hashed behind
    # the copy for the store's checks: the same caches, and they continue alike. A
    # growing family's (no window) are planned from the headers, with strided copies.
    from kvstore.codecs import host_alike

    planned = []
    real = host_alike.restored_alike
    monkeypatch.setattr(
        restore, "restored_alike", lambda *a: planned.append(real(*a)) or planned[-1]
    )
    # The arrays are allocated holding all ones (NaN in every float dtype), as reused
    # memory may (poisoned_allocations): the room past the rows restored is zeroed as a
    # prefill's growth zeroes it (a cache's state holds it), and nothing else of them is
    # left over.
    model, expected, restored = saved_and_restored(lmdb_url, family, prompt(1, 70))
    assert_same_caches(restored, expected)
    assert len(hashed_as_copied) == 5  # every record hashed by its copy
    assert [p is not None for p in planned] == ([] if family.startswith("window") else [True])
    # A growing layer's room is left unwritten, by either route (host_alike, or the
    # record writes of a model with windows); TurboQuant's is zeroed as it is restored.
    growing = [c for c in restored if type(c) in (KVCache, QuantizedKVCache)]
    assert "turboquant" in family or growing
    assert all((_buffer_rows_past_offset(c) == 0xFF).all() for c in growing)
    room = [_rows_past_offset(cache) for cache in restored]
    assert all(not r.any() for r in room)
    assert family.startswith("window") or all(r.size for r in room)  # a ring is full
    for t in prompt(6, 40):
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()


@pytest.mark.parametrize("family", ["plain", "quant"])
def test_room_a_restore_leaves_unwritten_is_zeroed_before_the_whole_buffer_is_read(
    family, lmdb_url, copied_digests, poisoned_allocations
):
    # A growing family's restore leaves the room past its rows as the allocator gave it
    # (here: all ones). Its steps and its saves read only rows below offset, and never
    # zero it; whatever reads the whole buffer (keys, values, state, mlx-lm's
    # save_prompt_cache) sees zeros there, as after a prefill.
    model, expected, restored = saved_and_restored(lmdb_url, family, prompt(1, 70))
    assert_same_caches(restored, expected)  # read through a snapshot of the rows

    assert all(r.size and (r == 0xFF).all() for r in map(_buffer_rows_past_offset, restored))
    for t in prompt(6, 3):
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()
    assert all(r.size and (r == 0xFF).all() for r in map(_buffer_rows_past_offset, restored))
    restored[0].trim(2)  # rows past offset that were written stay as they are
    expected[0].trim(2)
    trimmed = _buffer_rows_past_offset(restored[0])
    assert not (trimmed[: trimmed.size // 2] == 0xFF).all()
    # Through keys: zeroed, in that layer alone; through state in the rest.
    assert restored[1].keys is not None
    assert not _buffer_rows_past_offset(restored[1]).any()
    assert not any(_rows_past_offset(cache).any() for cache in restored[1:])
    for a, b in zip(restored, expected, strict=True):  # the trimmed rows too
        assert np.array_equal(_rows_past_offset(a), _rows_past_offset(b))
        assert all(
            mx.array_equal(x, y).item()
            for (_, x), (_, y) in zip(tree_flatten(a.state[:2]), tree_flatten(b.state[:2]))
        )
    for t in prompt(7, 300):  # past the capacity: the buffers grow
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()
    assert_same_caches(restored, expected)
    assert all(not _rows_past_offset(cache).any() for cache in restored)


@pytest.mark.parametrize("family", ["window", "window-quant"])
def test_a_rings_room_a_restore_leaves_unwritten_is_zeroed_before_the_whole_buffer_is_read(
    family, lmdb_url, copied_digests, poisoned_allocations
):
    # A window not yet full restores into a ring of more rows than it holds (room for
    # the next tokens). As a growing cache's, that room is left as the allocator gave it
    # (here: all ones) and zeroed only for what reads the whole buffer; the steps fill
    # the window, wrap, and go on as the prefill's caches do.
    from kvstore.caches.rotating import RingKVCache

    model, expected, restored = saved_and_restored(lmdb_url, family, prompt(1, 20))
    assert_same_caches(restored, expected)
    rings = [cache for cache in restored if isinstance(cache, RingKVCache)]
    assert rings and all(ring.offset < ring.max_size for ring in rings)
    assert all(r.size and (r == 0xFF).all() for r in map(_buffer_rows_past_offset, rings))
    for t in prompt(6, 3):
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()
    assert all(r.size and (r == 0xFF).all() for r in map(_buffer_rows_past_offset, rings))
    assert rings[0].keys is not None  # through keys: zeroed, in that ring alone
    assert not _buffer_rows_past_offset(rings[0]).any()
    assert all((_buffer_rows_past_offset(ring) == 0xFF).all() for ring in rings[1:])
    for a, b in zip(restored, expected, strict=True):  # through state: zeros, as a prefill's
        assert np.array_equal(_rows_past_offset(a), _rows_past_offset(b))
    for t in prompt(7, 40):  # past the window: every ring wraps
        step = mx.array([[t]])
        assert mx.array_equal(model(step, cache=restored), model(step, cache=expected)).item()
    assert all(ring.offset > ring.max_size for ring in rings)
    assert_same_caches(restored, expected)


@needs_tested_mlx_lm
def test_a_restored_cache_handed_to_mlx_lm_has_no_unwritten_room(
    lmdb_url, copied_digests, poisoned_allocations, tmp_path
):
    # mlx-lm's own classes know nothing of unwritten rows: what goes to them is zeroed.
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from kvstore.mlx_lm.families import as_mlx_lm_caches

    _, _, restored = saved_and_restored(lmdb_url, "plain", prompt(1, 70))
    theirs = as_mlx_lm_caches(restored)
    assert type(theirs[0]).__module__.startswith("mlx_lm.")
    save_prompt_cache(str(tmp_path / "c.safetensors"), theirs)
    for cache in load_prompt_cache(str(tmp_path / "c.safetensors")):
        assert cache.keys.shape[2] > cache.offset
        assert not _rows_past_offset(cache).any()


def _buffer_rows_past_offset(cache) -> np.ndarray:
    """The bytes of ``cache``'s buffers in the rows past its ``offset``, not zeroed by
    reading them (``buffers()``, not ``state``)."""
    leaves = [leaf for _, leaf in tree_flatten(cache.buffers())]
    return np.concatenate(
        [np.asarray(leaf[:, :, cache.offset :]).view(np.uint8).ravel() for leaf in leaves]
    )


def _rows_past_offset(cache) -> np.ndarray:
    """The bytes of every array of ``cache``'s state in the rows past its ``offset``."""
    leaves = [leaf for _, leaf in tree_flatten(cache.state[:2])]
    return np.concatenate(
        [np.asarray(leaf[:, :, cache.offset :]).view(np.uint8).ravel() for leaf in leaves]
    )


def test_records_the_checks_hashed_first_are_only_copied(lmdb_url, hashed_as_copied, monkeypatch):
    from concurrent.futures import Future

    from kvstore.store.blocks import reading

    def at_once(check):  # every check done before the restore copies a row
        done: Future = Future()
        done.set_result(check())
        return done

    monkeypatch.setattr(reading, "in_background", at_once)
    model, expected, restored = saved_and_restored(lmdb_url, "plain", prompt(1, 70))
    assert_same_caches(restored, expected)
    assert hashed_as_copied == []


@pytest.mark.parametrize("family", ["plain", "quant"])
def test_a_match_cut_inside_a_block_copied_record_by_record_reuses_exactly_its_rows(
    family, lmdb_url, hashed_as_copied
):
    model, policy, ns = setup(family)
    first = prompt(3, 60)
    with open_(lmdb_url) as store:
        saved = capture_save(store, model, first, policy)
        match = store.lookup(ns, first[:37] + [(t + 1) % 256 for t in first[37:50]])
        restored = store.restore(match, model.make_cache(policy))
    assert {c.offset for c in restored} == {37}
    assert len(hashed_as_copied) == 3  # the third block's record cut to its first 5 rows
    for c in saved:
        c.trim(60 - 37)
    assert_same_caches(restored, saved)


@pytest.mark.parametrize("family", ["plain", "quant"])
def test_prompts_diverging_mid_block_reuse_exactly_their_common_prefix(family, lmdb_url):
    model, policy, ns = setup(family)
    first = prompt(3, 60)
    second = first[:37] + [(t + 1) % 256 for t in first[37:50]]
    with open_(lmdb_url) as store:
        saved = capture_save(store, model, first, policy)
        match = store.lookup(ns, second)
        assert match.tokens == 37
        restored = store.restore(match, model.make_cache(policy))
    assert {c.offset for c in restored} == {37}
    for c in saved:
        c.trim(60 - 37)
    assert_same_caches(restored, saved)


@pytest.mark.parametrize("keep", [0, 2])
def test_a_window_restores_at_a_prefix_that_is_not_the_saved_length(keep, lmdb_url):
    model = model_for("tiny-gemma3")  # window 32, blocks 16: layers 0-1 slide, 2 is global
    policy = CachePolicy(keep=keep)  # keep: sink tokens, restored from the first block
    ns = namespace_for_model(model, policy=policy)
    first = prompt(4, 100)
    second = first[:70] + prompt(5, 9)
    with open_(lmdb_url) as store:
        capture_save(store, model, first, policy)
        match = store.lookup(ns, second)
        assert match.tokens == 70
        restored = store.restore(match, model.make_cache(policy))
    # The sliding layers were rebuilt from the blocks covering their sinks and 38..70 only.
    expected = prefilled(model, first[:70], policy)
    for got, want in zip(restored, expected, strict=True):
        assert got.offset == want.offset == 70
        for (a0, a1, a), (b0, b1, b) in zip(held_rows(got), held_rows(want), strict=True):
            assert (a0, a1) == (b0, b1)
            # Rows before 64 came from the same chunks in both prefills: identical.
            stop = max(min(a1, 64) - a0, 0)
            for name in a:
                assert np.array_equal(a[name][:, :, :stop], b[name][:, :, :stop])
                assert np.allclose(a[name], b[name], atol=1e-5)


def test_a_layer_missing_from_stored_blocks_cuts_the_match_back(lmdb_url):
    model, policy, ns = setup("window")
    tokens = prompt(6, 96)
    caches = prefilled(model, tokens, policy)  # the windows now hold positions 33..96
    with open_(lmdb_url) as store:
        store.save(ns, tokens, caches)  # no capture: early blocks lack the sliding layers
        whole = store.restore(store.lookup(ns, tokens + [1]), model.make_cache(policy))
        assert_same_caches(whole, caches)
        short = tokens[:70] + [7, 7]
        templates = model.make_cache(policy)
        restored = store.restore(store.lookup(ns, short), templates)
    # A window at any prefix of 70 needs a block the save could not fill: nothing is reused.
    assert restored == templates and all(c.offset == 0 for c in restored)


def test_the_encoder_stores_none_for_rows_a_window_no_longer_holds():
    model, policy, _ = setup("window")
    caches = prefilled(model, prompt(7, 96), policy)
    encoder = BlockEncoder(caches, "lossless", {})
    assert [s is None for s in encoder.layers(0, BLOCK)] == [True, True, False]
    assert [s is None for s in encoder.layers(80, 96)] == [False, False, False]
    assert encoder.family == "kv:plain+kv:rotating-plain"


@pytest.mark.parametrize(
    "family, storage", [("plain", "lossless"), ("window", "lossless"), ("plain", "kv:quant:8:64")]
)
def test_the_encoders_blocks_planned_alike_are_the_records_planned_afresh(family, storage):
    """Each block's plan lends its layout to the next (the ranges differ, nothing else):
    the records are byte for byte those planned afresh; a shorter last block, or a
    window's block with other layers absent, is planned afresh."""
    from kvstore.abc.store import BlockSpan
    from kvstore.codecs import encode_record
    from kvstore.codecs.record import RecordPlan

    model, policy, _ = setup(family)
    caches = prefilled(model, prompt(7, 72), policy)
    spans = [BlockSpan(i, a, min(a + BLOCK, 72), b"") for i, a in enumerate(range(0, 72, BLOCK))]
    made: list[RecordPlan] = []
    real = save_module.plan_record

    def spied(layers, **kw):
        made.append(real(layers, **kw))
        return made[-1]

    encoder = BlockEncoder(caches, storage, {}, 72)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(save_module, "plan_record", spied)
        records = [bytes(r) for r in encoder(spans)]
    assert records == [encode_record(encoder.layers(s.start, s.stop)) for s in spans]
    lent = [plan.checked_as is not None for plan in made]
    absent = [tuple(e is None for e in plan.entries) for plan in made]
    # Lent wherever the block before has the same length and the same layers absent.
    assert lent == [False] + [
        made[i].payload_nbytes == made[i - 1].payload_nbytes and absent[i] == absent[i - 1]
        for i in range(1, len(made))
    ]
    assert lent[1] and not lent[-1]  # 16-token blocks alike; the last has 8 tokens


# ---------------------------------------------------------------- encodings


@pytest.mark.parametrize("policy_sig", ["kv:quant:8:64", "kv:quant:4:64"])
@pytest.mark.parametrize("family", ["plain", "window"])
def test_a_lossy_storage_policy_stores_quantized_and_restores_the_live_family(
    family, policy_sig, lmdb_url
):
    model, policy, ns = setup(family)
    tokens = prompt(8, 50)
    with open_(lmdb_url, storage_policy=policy_sig) as store:
        capture_save(store, model, tokens, policy)
        families = set(store.stats(by_family=True).by_family)
        restored = store.restore(store.lookup(ns, tokens + [1]), model.make_cache(policy))
    windowed = policy_sig.replace("kv:quant", "kv:rotating-quant")
    assert families == ({policy_sig} if family == "plain" else {f"{policy_sig}+{windowed}"})
    expected = prefilled(model, tokens, policy)
    for got, want in zip(restored, expected, strict=True):
        assert got.signature() == want.signature() and got.offset == 50
        for (_, _, a), (_, _, b) in zip(held_rows(got), held_rows(want), strict=True):
            for name in a:  # quantised once, dequantised into the live family
                err = np.abs(a[name].astype(np.float32) - b[name].astype(np.float32)).max()
                assert 0 < err < (0.02 if policy_sig.endswith(":8:64") else 0.3)


@pytest.mark.parametrize("policy_sig", ["kv:quant:8:64", "kv:mxfp4"])
@pytest.mark.parametrize("family", ["plain", "window"])
def test_a_lossy_policy_spread_over_cpu_streams_stores_and_restores_the_same_bits(
    family, policy_sig, tmp_path, monkeypatch
):
    # On the CPU a policy's quantize is built on a stream per layer, and a restore
    # decodes each block's layers together (codecs.host_stacks): the records and the
    # caches are those of one stream converting one piece at a time.
    model, policy, ns = setup(family)
    tokens = prompt(11, 50)
    caches = prefilled(model, tokens, policy)
    got = {}
    for streams, stacked in (("1", "0"), ("3", "1")):
        monkeypatch.setenv("KVSTORE_CPU_STREAMS", streams)
        monkeypatch.setenv("KVSTORE_STACKED_DECODE", stacked)
        with open_(f"lmdb://{tmp_path / streams}", storage_policy=policy_sig) as store:
            store.save(ns, tokens, caches)
            match = store.lookup(ns, tokens + [1])
            assert match.tokens == 50
            with store.read(match.blocks) as views:
                records = [bytes(v) for v in views]
            got[streams] = (records, store.restore(match, model.make_cache(policy)))
    assert got["1"][0] == got["3"][0]
    assert_same_caches(got["3"][1], got["1"][1])


def test_a_layer_is_transcoded_into_the_family_of_its_cache(lmdb_url):
    model, _, _ = setup("plain")
    tokens = prompt(9, 40)
    caches = prefilled(model, tokens)
    with open_(lmdb_url) as store:
        store.save("shared", tokens, caches)
        quant = [QuantizedKVCache(group_size=64, bits=8) for _ in caches]
        restored = store.restore(store.lookup("shared", tokens + [0]), quant)
    for got, plain in zip(restored, caches, strict=True):
        want = transcode(snapshot(plain, 0, 40), "kv:quant:8:64")
        got_snap = snapshot(got)
        for name, array in want.tensors.items():
            assert mx.array_equal(got_snap.tensors[name], array).item(), name


def test_restored_arrays_are_owned_and_have_room_for_the_next_token(lmdb_url):
    model, _, ns = setup("plain")
    tokens = prompt(10, 40)
    caches = prefilled(model, tokens)
    store = open_(lmdb_url)
    store.save(ns, tokens, caches)
    restored = store.restore(store.lookup(ns, tokens + [0]), model.make_cache())
    store.close()  # the store's pages are unmapped: nothing restored may point there
    assert_same_caches(restored, caches)
    for cache in restored:
        assert cache.keys.shape[2] == growth_capacity(40, cache.step)
        cache.update_and_fetch(*(mx.ones((1, 2, 1, 64)),) * 2)
        assert cache.keys.shape[2] == growth_capacity(40, cache.step)


def test_restored_arrays_share_no_memory_with_stored_values():
    model, _, ns = setup("plain")
    tokens = prompt(11, 40)
    with open_("memory://owned") as store:
        store.save(ns, tokens, prefilled(model, tokens))
        restored = store.restore(store.lookup(ns, tokens + [0]), model.make_cache())
        raw = open_backend("memory://owned")
        values = [np.frombuffer(v, np.uint8) for k, v in raw.scan(K.SCHEMA) if v is not None]
        raw.close()
    for cache in restored:
        for array in (cache.keys, cache.values):
            assert not any(np.shares_memory(np.asarray(array), v) for v in values)


# ---------------------------------------------------------------- corruption


def test_bit_flips_in_stored_values_are_counted_misses_never_wrong_kv(lmdb_url):
    model, _, ns = setup("plain")
    prompts = [prompt(20 + i, 30 + 9 * i) for i in range(4)]
    expected = {tuple(p): prefilled(model, p) for p in prompts}
    rng = random.Random(5)
    flips = 0
    for round_ in range(6):
        with open_(lmdb_url) as store:
            for p in prompts:
                store.save(ns, p, expected[tuple(p)])
        raw = open_backend(lmdb_url)
        records = [
            (k, bytearray(v))
            for k, v in raw.scan(K.SCHEMA + ns.encode() + b"/")
            if K.split_record_key(k)
        ]
        damaged = rng.sample(records, 2)
        for _, value in damaged:
            bit = rng.randrange(8 * len(value))
            value[bit // 8] ^= 1 << (bit % 8)
        raw.put_many([(k, bytes(v)) for k, v in damaged])
        raw.close()
        flips += len(damaged)
        with open_(lmdb_url) as store:
            for p in prompts:
                match = store.lookup(ns, p + [1])
                restored = store.restore(match, model.make_cache())
                n = restored[0].offset
                assert n <= len(p), round_
                if n:
                    want = prefilled(model, p)
                    for c in want:
                        c.trim(len(p) - n)
                    assert_same_caches(restored, want)
            stats = store.stats()
            assert stats.corruptions >= 1 and stats.misses.get(MissReason.CORRUPT, 0) >= 1
            store.flush()  # the corrupt blocks are removed in the background: now
        with open_(lmdb_url) as store:
            assert store.verify().clean, round_
    assert flips == 12


@pytest.mark.parametrize("policy_sig", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_flipped_bit_under_a_lossy_policy_cuts_the_restore_to_the_intact_blocks(
    policy_sig, tmp_path
):
    # On the CPU a block's layers are decoded together (codecs.host_stacks), possibly
    # before the checks find the block damaged: nothing of it may reach the caches.
    model, policy, ns = setup("plain")
    tokens = prompt(31, 5 * BLOCK + 3)
    caches = prefilled(model, tokens, policy)
    clean, damaged = (f"lmdb://{tmp_path / name}" for name in ("clean", "damaged"))
    for url in (clean, damaged):
        with open_(url, storage_policy=policy_sig) as store:
            store.save(ns, tokens, caches)
            keys = [ref.key for ref in store.lookup(ns, tokens + [1]).blocks]
    raw = open_backend(damaged)
    with raw.reader() as view:
        value = bytearray(view.get(keys[2]))
    value[-100] ^= 0x10  # in the payload's last layer
    raw.put_many([(keys[2], bytes(value))])
    raw.close()
    with open_(damaged, storage_policy=policy_sig) as store:
        got = store.restore(store.lookup(ns, tokens + [1]), model.make_cache(policy))
        assert store.stats().corruptions == 1
    assert got[0].offset == 2 * BLOCK
    with open_(clean, storage_policy=policy_sig) as store:
        match = store.lookup(ns, tokens[: 2 * BLOCK] + [1])
        assert match.tokens == 2 * BLOCK
        want = store.restore(match, model.make_cache(policy))
    assert_same_caches(got, want)


# ---------------------------------------------------------------- generate's faults


def test_a_failed_save_is_logged_and_generation_goes_on(lmdb_url, caplog):
    model, _, _ = setup("plain")
    tokens = prompt(12, 40)
    want, _ = generate_tokens(model, tokens, max_tokens=4, chunk_size=CHUNK, block_size=BLOCK)
    with open_(lmdb_url, max_bytes=1000) as store, caplog.at_level(logging.WARNING, "kvstore"):
        got, stats = generate_tokens(model, tokens, store=store, max_tokens=4, chunk_size=CHUNK)
        store.flush()  # the save was handed off (write-behind): its commit fails afterwards
    assert got == want
    assert stats.store_error is None  # generation never waited for the commit
    assert "a save handed off failed" in caplog.text and "StoreFullError" not in caplog.text
    assert "do not fit the byte budget" in caplog.text


def test_generate_reports_store_time_and_reused_tokens(lmdb_url):
    model, _, _ = setup("plain")
    tokens = prompt(13, 64)
    with open_(lmdb_url) as store:
        out, first = generate_tokens(model, tokens, store=store, max_tokens=3, chunk_size=CHUNK)
        seen, sampler = log_probs_recorder()
        turn = tokens + out + [5]  # a follow-up turn extends the conversation
        _, again = generate_tokens(
            model, turn, store=store, max_tokens=3, chunk_size=CHUNK, sampler=sampler
        )
    assert (first.reused_tokens, first.save_s > 0, first.store_error) == (0, True, None)
    # Every token that had KV is reused: the prompt and the first two generated.
    assert again.reused_tokens == 64 + 2 and again.prefilled_tokens == 2
    assert again.lookup_s > 0 and again.restore_s > 0 and len(seen) == 3


def test_save_needs_caches_holding_the_tokens(lmdb_url):
    model, _, ns = setup("plain")
    caches = prefilled(model, prompt(14, 20))
    with open_(lmdb_url) as store:
        with pytest.raises(ValueError, match="21 tokens were given but a cache holds only 20"):
            store.save(ns, prompt(14, 21), caches)
        with pytest.raises(ValueError, match="No caches"):
            store.save(ns, [1, 2], [])


def test_generate_rejects_caches_and_policy_together():
    model, _, _ = setup("plain")
    with pytest.raises(ValueError, match="caches= or policy="):
        generate_tokens(
            model, [1, 2], caches=[KVCache(), KVCache()], policy=CachePolicy(), max_tokens=1
        )


def test_turboquant_windows_generate_identically_with_the_store(lmdb_url):
    """TurboQuant caches, windowed layers included: restored codes continue exactly."""
    model = model_for("tiny-gemma3")
    policy = CachePolicy(turboquant=(3, 3))
    tokens = prompt(15, 70)
    options = {"policy": policy, "max_tokens": 3, "chunk_size": CHUNK}
    want, _ = generate_tokens(model, tokens, block_size=BLOCK, **options)
    with open_(lmdb_url) as store:
        got, first = generate_tokens(model, tokens, store=store, **options)
        again, second = generate_tokens(model, tokens, store=store, **options)
    assert got == want == again
    assert first.store_error is None and second.store_error is None
    assert first.reused_tokens == 0 and second.reused_tokens > 0


def test_a_per_layer_storage_policy_stores_each_layer_in_its_encoding(lmdb_url):
    from kvstore.codecs import decode_record_to_mlx

    model, policy, ns = setup("window")  # layers 0-1 slide, layer 2 is global
    tokens = prompt(11, 50)
    per_layer = {"default": "kv:quant:8:64", "layers": {"1": "lossless"}}
    with open_(lmdb_url, storage_policy=per_layer) as store:
        text = store.settings.storage_policy
        capture_save(store, model, tokens, policy)
        match = store.lookup(ns, tokens + [1])
        with store.read(match.blocks) as views:
            stored = [[s.signature for s in decode_record_to_mlx(v).layers] for v in views]
        restored = store.restore(match, model.make_cache(policy))
    assert text == "default=kv:quant:8:64;1=lossless"
    assert {tuple(s) for s in stored} == {
        ("kv:rotating-quant:8:64", "kv:rotating-plain", "kv:quant:8:64")
    }
    expected = prefilled(model, tokens, policy)
    assert [c.signature() for c in restored] == [c.signature() for c in expected]
    assert_same_caches(restored[1:2], expected[1:2])  # the lossless layer, bit for bit
    # Kept in the store's settings, fixed like any storage policy.
    with open_(lmdb_url) as store:
        assert store.settings.storage_policy == text
    with open_(lmdb_url, storage_policy="1=lossless;default=kv:quant:8:64") as store:
        assert store.settings.storage_policy == text  # the same layout, written otherwise
    with pytest.raises(StoreConfigError, match="storage_policy was fixed"):
        open_(lmdb_url, storage_policy="default=kv:quant:8:64")


def test_a_uniform_layout_is_the_storage_policy_stores_have_always_kept(lmdb_url):
    with open_(lmdb_url, storage_policy={"default": "kv:quant:4:64"}) as store:
        assert store.settings.storage_policy == "kv:quant:4:64"
    with open_(lmdb_url, storage_policy="kv:quant:4:64") as store:
        assert store.settings.storage_policy == "kv:quant:4:64"


@pytest.mark.parametrize(
    "bad",
    ["default=kv:plain", "0=kv:rotating-quant:4:64", "sliding=kv:quant:4:64;sliding=lossless"],
)
def test_a_per_layer_storage_policy_names_storage_policies_only(bad, lmdb_url):
    with pytest.raises(StoreConfigError, match="storage_policy"):
        open_(lmdb_url, storage_policy=bad)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_restore_leaves_room_for_the_prompts_rest_so_its_buffers_keep_steps_sizes(lmdb_url, bits):
    # mlx-lm grows a buffer whose rows are no multiple of its step by cutting it to its
    # rows and appending steps: run through a buffer sized for the 200 restored rows
    # alone (256), the prompt's 100 more made a 456-row copy of the whole cache, a size
    # no fresh prefill makes (on CUDA: a decode graph of its own). Sized for the prompt,
    # the rest is written in place, and the decode steps after grow it by whole steps.
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.testing.mlx_lm_models import build_mlx_lm_model

    model = build_mlx_lm_model("llama")
    stored = list(range(1, 201))
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([stored]), cache=caches))
    if bits is not None:
        caches = [c.to_quantized(group_size=32, bits=bits) for c in caches]
    whole = stored + list(range(300, 400))
    with open_(lmdb_url) as store:
        store.save("room", stored, caches)
        match = store.lookup("room", whole)
        template = make_prompt_cache(model)
        if bits is not None:
            template = [c.to_quantized(group_size=32, bits=bits) for c in template]
        restored = store.restore(match, template)
    assert (match.tokens, match.prompt_tokens) == (200, 300)

    def rows(cache):
        keys = cache.keys[0] if isinstance(cache.keys, (list, tuple)) else cache.keys
        return keys.shape[2]

    assert {rows(c) for c in restored} == {512}
    mx.eval(model(mx.array([whole[200:]]), cache=restored))
    assert {rows(c) for c in restored} == {512} and {c.offset for c in restored} == {300}
    for token in range(213):  # through the buffer's end: grown by one whole step
        mx.eval(model(mx.array([[token]]), cache=restored))
    assert {rows(c) for c in restored} == {768} and {c.offset for c in restored} == {513}


@pytest.mark.parametrize(
    ("rows", "room", "capacity"),
    [(200, 300, 512), (4095, 4096, 4096), (4069, 4135, 4352), (256, 256, 512), (300, 0, 512)],
)
def test_a_restores_room_is_a_cold_prefills_buffer_for_its_prompt(rows, room, capacity):
    # A cold prefill of a 4096-token prompt leaves 4096 rows: a restore of its first
    # 4095 for it sized like that runs its last token over the buffer a cold session's
    # does (a step more, on CUDA, cost that token a cuDNN graph of its own). Where the
    # prompt runs no further (all of it restored, or no prompt given), room for the
    # next token, as mlx-lm's growth leaves.
    from mlx_lm.models.cache import KVCache as MlxKVCache

    assert restore_capacity(rows, room, 256) == capacity
    cold = MlxKVCache()
    if room > rows:
        rows_of = mx.zeros((1, 1, room, 8))
        cold.update_and_fetch(rows_of, rows_of)
        assert cold.keys.shape[2] == capacity
