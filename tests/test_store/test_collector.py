"""The cyclic collector is off while a restore runs (kvstore.collector), and as it
was once every restore has ended."""

from __future__ import annotations

import gc
import threading

import pytest

from kvstore.collector import collection_paused
from kvstore.store import open_store
from kvstore.store.kv import restore

from .kv_helpers import BLOCK, assert_same_caches, model_for, prefilled, prompt


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_restore_runs_with_the_collector_off_and_turns_it_back_on(
    tmp_path, monkeypatch, collector_on
):
    model = model_for("tiny")
    tokens = prompt(3, 4 * BLOCK)
    seen = []
    real = restore._restorable  # planning, whichever way the restore goes next

    def restorable(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(restore, "_restorable", restorable)
    with open_store(f"lmdb://{tmp_path}/s", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens))
        got = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert seen == [False]
        assert gc.isenabled()
        assert_same_caches(got, prefilled(model, tokens[: got[0].offset]))


def test_a_restore_that_raises_turns_the_collector_back_on(tmp_path, monkeypatch, collector_on):
    model = model_for("tiny")
    tokens = prompt(4, 2 * BLOCK)

    def restorable(*args, **kwargs):
        raise RuntimeError("planning failed")

    monkeypatch.setattr(restore, "_restorable", restorable)
    with open_store(f"lmdb://{tmp_path}/s", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens))
        with pytest.raises(RuntimeError, match="planning failed"):
            store.restore(store.lookup("ns", tokens), model.make_cache())
    assert gc.isenabled()


def test_overlapping_pauses_keep_it_off_until_the_last_ends(collector_on):
    first_in, second_out = threading.Event(), threading.Event()
    seen = []

    def first():
        with collection_paused():
            first_in.set()
            second_out.wait(10)
            seen.append(gc.isenabled())  # the second's end left it off: this one still runs

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(10)
    with collection_paused():
        assert not gc.isenabled()
    second_out.set()
    thread.join(10)
    assert not thread.is_alive()
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on):
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
