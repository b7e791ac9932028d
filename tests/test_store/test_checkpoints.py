"""Issue 16: recurrent checkpoints in the prefix store (hybrid models).

A block record carries the recurrent layers' state at its end, or none; a
hybrid prompt reuses the longest stored prefix that ends with one (its
attention layers restored to that point, the rest recomputed), and what the
store reports keeps tokens reused, KV tokens matched and checkpoint bytes
apart. Across processes: a prompt sharing 280 tokens with a saved 300 restores
from the checkpoint at 256 and equals a cold run; a repeated 512-token prompt
reuses 256; a branch point saved by a second prompt serves a third; stock
mlx-lm hybrid caches store and restore bit-exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.cache import is_recurrent_cache
from kvstore.abc.store import MissReason
from kvstore.bridge import generate_tokens
from kvstore.bridge.checkpoints import CheckpointPlan, plan_positions
from kvstore.bridge.namespace import namespace_for_model
from kvstore.codecs import codec_for
from kvstore.model.generate import prefill, prefill_chunks
from kvstore.model.speculative import PromptLookup
from kvstore.store import open_store
from kvstore.store.blocks.index import IndexEntry, decode_entry, encode_entry

from .hybrid_worker import hybrid_model, prompt, run, tokens
from .test_lmdb import ROOT

WORKER = [sys.executable, "-m", "tests.test_store.hybrid_worker"]


def in_a_process(url, n, seed, shared) -> dict:
    proc = subprocess.run(
        [*WORKER, url, str(n), str(seed), str(shared)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_plan():
    # stride 8 blocks of 256; the last boundary <= P-1; the branch point; after the restore.
    assert plan_positions(256, 8, 300, 0, 0) == [256]
    assert plan_positions(256, 8, 512, 0, 511) == [256]
    assert plan_positions(256, 8, 5000, 0, 600) == [512, 2048, 4096, 4864]
    assert plan_positions(256, 8, 5000, 2048, 600) == [4096, 4864]
    assert plan_positions(256, 0, 5000, 0, 0) == [4864]
    assert plan_positions(256, 8, 200, 0, 0) == []
    assert prefill_chunks(0, 700, 512, 256, stops=[256]) == [(0, 256), (256, 700)]
    assert prefill_chunks(0, 700, 512, 256) == [(0, 512), (512, 700)]


def test_save_300_then_share_280_across_processes(tmp_path):
    url = f"lmdb://{tmp_path / 'store'}"
    first = in_a_process(url, 300, 1, 300)
    assert first["reused"] == 0 and first["error"] is None
    # Kept: 256 (the last boundary before the prompt's last token) and the end of
    # the saved sequence (300 prompt + 3 generated tokens that have KV).
    assert first["checkpoints"] == 2
    second = in_a_process(url, 310, 1, 280)
    assert second["reused"] == 256 and second["kv_matched"] == 280
    cold = run(url, 310, 1, 280, store=False)
    assert second["tokens"] == cold["tokens"]
    assert np.array_equal(np.array(second["logprobs"]), np.array(cold["logprobs"]))


def test_an_exact_repeat_of_512_tokens_reuses_256_and_says_so(tmp_path):
    url = f"lmdb://{tmp_path / 'store'}"
    first = in_a_process(url, 512, 2, 512)
    assert first["reused"] == 0
    again = run(url, 512, 2, 512)
    assert again["reused"] == 256 and again["kv_matched"] == 511
    assert again["tokens"] == first["tokens"]
    with open_store(url) as store:
        match = store.lookup(
            namespace_for_model(hybrid_model()), prompt(512, 2, 512), checkpoints=True
        )
        assert (match.tokens, match.kv_tokens, len(match.blocks)) == (256, 511, 1)
        plain = store.lookup(namespace_for_model(hybrid_model()), prompt(512, 2, 512))
        assert plain.tokens == plain.kv_tokens == 511  # a KV-only lookup knows no checkpoints


def test_a_branch_point_saved_by_the_second_prompt_serves_a_third(tmp_path):
    store = open_store(f"lmdb://{tmp_path / 'store'}")
    model = hybrid_model()
    a = prompt(1000, 3, 1000)
    b = a[:600] + tokens(77, 100)
    c = a[:550] + tokens(78, 100)
    kw = {"store": store, "max_tokens": 2}
    _, sa = generate_tokens(model, a, **kw)  # checkpoints at 768 and at the sequence end
    _, sb = generate_tokens(model, b, **kw)
    assert (sb.reused_tokens, sb.kv_matched_tokens) == (0, 600)  # nothing at or before 600
    assert store.stats().misses.get(MissReason.NO_CHECKPOINT) == 1
    _, sc = generate_tokens(model, c, **kw)
    assert (sc.reused_tokens, sc.kv_matched_tokens) == (512, 550)  # b's branch point
    cold, _ = generate_tokens(model, c, max_tokens=2)
    assert generate_tokens(model, c, **kw)[0] == cold


def test_checkpoint_bytes_are_counted_apart_and_leave_with_their_blocks(tmp_path):
    store = open_store(f"lmdb://{tmp_path / 'store'}")
    model = hybrid_model()
    ns = namespace_for_model(model)
    generate_tokens(model, prompt(700, 4, 700), store=store, max_tokens=2)
    stats = store.stats()
    per = model.make_cache()
    model(mx.array([[1]]), cache=per)
    one = sum(c.bytes_per_checkpoint() for c in per if c.bytes_per_token() == 0)
    # 512 (last boundary <= P-1) and 701 (the saved sequence's end, a tail).
    assert stats.checkpoints == 2 and stats.checkpoint_bytes == 2 * one
    assert stats.namespaces[ns].checkpoint_bytes == 2 * one
    assert stats.namespaces[ns].kv_bytes == stats.bytes - 2 * one
    assert store.verify().clean
    store.evict(max_bytes=1)
    gone = store.stats()
    assert (gone.checkpoints, gone.checkpoint_bytes, gone.blocks) == (0, 0, 0)
    assert gone.evicted_checkpoint_bytes == 2 * one and gone.evicted_bytes == stats.bytes
    generate_tokens(model, prompt(700, 4, 700), store=store, max_tokens=2)
    assert store.delete(ns) and store.stats().checkpoints == 0
    assert store.verify().clean


def test_upgrading_a_stored_block_adds_its_checkpoint(tmp_path):
    store = open_store("memory://")
    model = hybrid_model()
    ns = namespace_for_model(model)
    toks = mx.array(prompt(600, 5, 600))
    caches = model.make_cache()
    prefill(model, toks, caches, [(0, 300), (300, 600)])
    first = store.save(ns, np.asarray(toks), caches)  # only the live state, at 600
    assert (first.checkpoints, first.upgraded) == (1, 0)
    assert store.lookup(ns, np.asarray(toks[:520]), checkpoints=True).tokens == 0
    caches = model.make_cache()
    prefill(model, toks, caches, [(0, 512)])
    second = store.save(ns, np.asarray(toks[:512]), caches)  # the state at 512 now
    assert (second.checkpoints, second.upgraded, second.written) == (1, 1, ())
    assert store.lookup(ns, np.asarray(toks[:520]), checkpoints=True).tokens == 512
    assert store.stats().checkpoints == 2 and store.verify().clean


def test_speculative_decoding_checkpoints_only_verified_states(tmp_path):
    """Rounds land on block boundaries; the state taken there is the one a direct run
    of the same tokens holds (no draft token it has seen was rejected)."""
    store = open_store("memory://", block_size=16, checkpoint_stride=3)
    model = hybrid_model()
    p = prompt(40, 6, 40)
    greedy, _ = generate_tokens(model, p, max_tokens=30)
    out, stats = generate_tokens(
        model,
        p,
        store=store,
        max_tokens=30,
        draft=PromptLookup(max_ngram=2, min_ngram=1),
        num_draft_tokens=5,
    )
    assert out == greedy and stats.target_forwards > 0
    ns = namespace_for_model(model)
    seq = p + out[:-1]
    # Taken during decode: 48 (the stride's), 64 (the latest boundary); 69 is the end.
    for boundary in (48, 64, 69):
        match = store.lookup(ns, seq[:boundary] + [0], checkpoints=True)
        assert match.tokens == boundary
        restored = store.restore(match, model.make_cache())
        direct = model.make_cache()
        prefill(model, mx.array(seq), direct, [(0, boundary)])
        for a, b in zip(restored[:3], direct[:3]):
            assert mx.array_equal(a[1], b[1]).item() and mx.array_equal(a[0], b[0]).item()


def test_stock_mlx_lm_hybrid_caches_store_and_restore_bit_exactly(tmp_path):
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.testing.mlx_lm_models import build_mlx_lm_model

    model = build_mlx_lm_model("qwen3_next", seed=1)
    toks = tokens(9, 600)
    caches = make_prompt_cache(model)
    model(mx.array(toks[:512])[None], cache=caches)
    mx.eval([c.state for c in caches])
    store = open_store(f"lmdb://{tmp_path / 'store'}")
    ns = namespace_for_model(model, caches=caches)
    saved = store.save(ns, toks[:512], caches)
    assert saved.checkpoints == 1  # the live state at 512, the end of block 1
    match = store.lookup(ns, toks, checkpoints=True)
    assert (match.tokens, match.kv_tokens) == (512, 512)
    restored = store.restore(match, make_prompt_cache(model))
    for a, b in zip(caches, restored):
        if type(a).__name__ == "ArraysCache":
            assert b.offset == 512
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.cache, b.cache))
        else:
            assert mx.array_equal(a.keys[..., :512, :], b.keys[..., :512, :]).item()
    rest = mx.array(toks[512:])[None]
    assert mx.array_equal(model(rest, cache=restored), model(rest, cache=caches)).item()


def test_index_entries_keep_their_checkpoint_bytes():
    base = IndexEntry(b"d" * 32, b"p" * 32, 1, 3, 1000, 1.5, "kv:plain", True, np.arange(3))
    assert encode_entry(base)[0] == 1  # without a checkpoint: version 1, as before
    with_ckpt = IndexEntry(
        b"d" * 32, b"p" * 32, 1, 3, 1000, 1.5, "kv:plain", True, np.arange(3), 400
    )
    raw = encode_entry(with_ckpt)
    assert raw[0] == 2 and len(raw) == len(encode_entry(base)) + 8
    back = decode_entry(raw)
    assert back.checkpoint_nbytes == 400 and back.checkpointed
    assert not decode_entry(encode_entry(base)).checkpointed


def test_the_stride_is_a_store_setting(tmp_path):
    path = tmp_path / "store"
    with open_store(f"lmdb://{path}") as store:
        assert store.settings.checkpoint_stride == 8
    with open_store(f"lmdb://{path}", checkpoint_stride=2) as store:
        assert store.settings.checkpoint_stride == 2
    with open_store(f"lmdb://{path}") as store:
        assert store.settings.checkpoint_stride == 2  # stored
        model = hybrid_model()
        _, stats = generate_tokens(model, prompt(1100, 7, 1100), store=store, max_tokens=1)
        # stride 2 blocks (512, 1024), and the last boundary <= P-1 is 1024 too.
        assert store.stats().checkpoints == 3  # 512, 1024, the end at 1100


def test_a_hybrid_store_migrates_its_kv_and_keeps_its_checkpoints(tmp_path):
    from kvstore.store.maintenance.migrate import migrate

    model = hybrid_model()
    src, dst = f"lmdb://{tmp_path / 'src'}", f"lmdb://{tmp_path / 'dst'}"
    p = prompt(700, 8, 700)
    with open_store(src) as store:
        generate_tokens(model, p, store=store, max_tokens=2)
        before = store.stats()
    report = migrate(src, dst, to="kv:quant:8:64")
    assert [d.layers for d in report.directions] == [(3,)]  # the attention layer only
    with open_store(dst) as store:
        after = store.stats()
        assert (after.checkpoints, after.checkpoint_bytes) == (
            before.checkpoints,
            before.checkpoint_bytes,
        )
        assert after.bytes < before.bytes and store.verify().clean
        _, stats = generate_tokens(model, p + [1, 2], store=store, max_tokens=1)
        assert (stats.reused_tokens, stats.kv_matched_tokens) == (512, 700)


def test_verify_checks_and_repairs_the_checkpoint_totals(tmp_path):
    import struct

    from kvstore.store import keys as K

    store = open_store(f"lmdb://{tmp_path / 'store'}")
    model = hybrid_model()
    ns = namespace_for_model(model)
    generate_tokens(model, prompt(600, 9, 600), store=store, max_tokens=2)
    good = store.stats()
    assert good.checkpoints == 2 and store.verify().clean
    # Totals that forgot the checkpoints (as a writer that knew none would leave them).
    store.backend.put_many(
        [(K.totals_key(ns.encode()), struct.pack("<QQ", good.blocks, good.bytes))]
    )
    report = store.verify()
    assert not report.clean and any("checkpoints" in m for m in report.totals_mismatch)
    store.verify(repair=True)
    fixed = store.stats()
    assert (fixed.checkpoints, fixed.checkpoint_bytes) == (good.checkpoints, good.checkpoint_bytes)
    assert store.verify().clean


def _prefilled(model, toks, chunks, at=()):
    """Caches after ``chunks`` of ``toks``, and the recurrent checkpoints taken at ``at``."""
    plan = CheckpointPlan(256, 0, len(toks), 0, 0)
    caches = model.make_cache()
    taken = set(at)
    prefill(
        model,
        mx.array(toks),
        caches,
        chunks,
        lambda end, cs: plan.take(end, cs) if end in taken else None,
    )
    return caches, plan.snapshots


def _move_on(model, caches, rows_from):
    """Run more tokens (the recurrent states move on), then overwrite every attention
    layer's rows from ``rows_from`` in place."""
    model(mx.array(tokens(11, 40))[None], cache=caches)
    for c in caches:
        if not is_recurrent_cache(c):
            n = c.offset - rows_from
            c.trim(n)
            shape = (1, c.keys.shape[1], n, c.keys.shape[3])
            c.update_and_fetch(mx.ones(shape, c.keys.dtype), mx.ones(shape, c.keys.dtype))
    mx.eval([c.state for c in caches])


def _held(store, gate):
    """Make ``store``'s commits of saves handed off wait for ``gate``."""
    real = store.put_blocks_many

    def held(saves):
        gate.wait(60)
        return real(saves)

    store.put_blocks_many = held


def _assert_same(restored, direct):
    """Bit for bit: every layer's rows (attention) or state (recurrent), as its codec sees them."""
    for a, b in zip(restored, direct, strict=True):
        assert a.offset == b.offset
        start = a.offset if is_recurrent_cache(a) else 0
        sa = codec_for(a).snapshot(a, start, a.offset).tensors
        sb = codec_for(b).snapshot(b, start, b.offset).tensors
        assert sa.keys() == sb.keys()
        assert all(mx.array_equal(sa[k], sb[k]).item() for k in sa)


def _records_of(store, keys):
    return [None if r is None else bytes(r) for r in store.backend.get_many(list(keys))]


def test_a_hybrid_save_handed_off_stores_the_checkpoints_a_save_would(tmp_path):
    """save_behind + flush: the same records (checkpoints in them) as save, taken at
    the hand-off although the caches move on before the commit, and a restore
    from them equals a direct run bit for bit."""
    model = hybrid_model()
    ns = namespace_for_model(model)
    toks = prompt(600, 10, 600)
    caches, captured = _prefilled(model, toks, [(0, 512), (512, 600)], at=[512])
    kw = {"block_size": 256}
    with (
        open_store(f"lmdb://{tmp_path / 'behind'}", **kw) as behind,
        open_store(f"lmdb://{tmp_path / 'sync'}", **kw) as sync,
    ):
        want = sync.save(ns, toks, caches, captured=captured)
        gate = threading.Event()
        _held(behind, gate)
        handle = behind.save_behind(ns, toks, caches, captured=captured)
        _move_on(model, caches, 0)  # before the writer reads anything
        gate.set()
        behind.flush()
        got = handle.result(timeout=60)
        assert (want.checkpoints, want.written) == (2, got.written)  # 512 and the end, 600
        assert (got.checkpoints, got.checkpoint_bytes) == (want.checkpoints, want.checkpoint_bytes)
        assert _records_of(behind, got.written) == _records_of(sync, want.written)
        assert behind.stats().checkpoint_bytes == sync.stats().checkpoint_bytes > 0
        for n in (520, 601):  # from the checkpoint at 512, and at the end
            match = behind.lookup(ns, toks[: n - 1] + [0], checkpoints=True)
            at = 512 if n == 520 else 600
            assert match.tokens == at
            restored = behind.restore(match, model.make_cache())
            direct, _ = _prefilled(model, toks, [(0, 512), (512, 600)][: 1 if at == 512 else 2])
            _assert_same(restored, direct)
            probe = mx.array([[7, 8, 9]])
            assert mx.array_equal(model(probe, cache=restored), model(probe, cache=direct)).item()
        assert behind.verify().clean


def test_a_save_handed_off_upgrades_a_stored_block_with_its_checkpoint(tmp_path):
    """The block a checkpoint upgrades is stored already (before the hand-off's new
    rows): its attention rows are copied at the hand-off too."""
    model = hybrid_model()
    ns = namespace_for_model(model)
    toks = prompt(600, 12, 600)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=256) as store:
        caches, _ = _prefilled(model, toks, [(0, 300), (300, 600)])
        assert store.save(ns, toks, caches).checkpoints == 1  # only the live state, at 600
        caches, _ = _prefilled(model, toks, [(0, 512)])
        gate = threading.Event()
        _held(store, gate)
        handle = store.save_behind(ns, toks[:512], caches)
        _move_on(model, caches, 256)  # the rows of block [256, 512) too
        gate.set()
        got = handle.result(timeout=60)
        assert (got.checkpoints, got.upgraded, got.written) == (1, 1, ())
        match = store.lookup(ns, toks[:520], checkpoints=True)
        assert match.tokens == 512
        restored = store.restore(match, model.make_cache())
        direct, _ = _prefilled(model, toks, [(0, 512)])
        _assert_same(restored, direct)
        assert store.stats().checkpoints == 2 and store.verify().clean
