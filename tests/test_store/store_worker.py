"""Subprocess side of the multi-process store tests.

Run as ``python -m tests.test_store.store_worker MODE ARGS...``.

Prompts are drawn from :func:`prompt` so that the parent can rebuild any of
them from ``(seed, i)`` and check what a worker acknowledged.
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.abc.placement import Placement
from kvstore.abc.store import PendingRecord, RecordEncoder
from kvstore.errors import StoreFullError
from kvstore.store import open_store
from kvstore.store.engines import lmdb_values, writeback
from kvstore.testing.store import check_match, check_views, encoder_for, verify_record

NS = "procs"
BLOCK = 16
#: The churner's budget: a few prompts' records (~9 KiB each), so every save evicts.
CHURN_BUDGET = 96 << 10


def prompt(seed: int, i: int) -> list[int]:
    """Prompt ``i`` of stream ``seed``: shares prefixes with others of any stream (alphabet 3)."""
    rng = random.Random(seed * 100_003 + i)
    shared = random.Random(i % 5).choices(range(3), k=40)  # five common system prompts
    return shared[: rng.randrange(0, 41)] + rng.choices(range(3), k=rng.randrange(1, 60))


def open_(path: str, **options):
    options.setdefault("block_size", BLOCK)
    return open_store(f"lmdb://{path}", verify=verify_record, touch_interval=0.05, **options)


def save(store, tokens, filler: int = 0):
    return store.put_blocks(NS, tokens, encoder_for(tokens, filler=filler))


def say(*words: object) -> None:
    # One write per line: print() writes each word and separator on its own when the
    # output is a pipe, and a SIGKILL between them leaves a cut "ACK" (a CI failure).
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def placed(encode: RecordEncoder) -> RecordEncoder:
    """``encode``'s records handed over as a save's arena hands them: pending, each
    written on a pool a part of 4 KiB at a time (:mod:`kvstore.abc.placement`), so a
    store with a value file writes them there while they are being written."""
    pool = ThreadPoolExecutor(2)

    def encoder(spans):
        records = []
        for raw in encode(spans):
            data, placement = memoryview(bytes(raw)), Placement()

            def write(data: memoryview = data, placement: Placement = placement) -> memoryview:
                for at in range(0, data.nbytes, 4096):
                    placement.written(at, data[at : at + 4096])
                return data

            records.append(PendingRecord(pool.submit(write), data.nbytes, placement))
        return records

    return encoder


def writer(path: str, seed: int, filler: str, pump: str = "0", values: str = "inline") -> None:
    """Save prompts forever, acknowledging each once put_blocks returned (for the SIGKILL test).
    With ``pump`` "1", every commit has its writeback started early, however small
    (:mod:`kvstore.store.engines.writeback`); with ``values`` "file" (the store's setting),
    every record of 4 KiB or more goes to the value file
    (:mod:`kvstore.store.engines.lmdb_values`); "placed": there too, each record written
    into it while it is being written (:func:`placed`)."""
    if pump == "1":
        writeback.MIN_BYTES = 0
    lmdb_values.VALUE_MIN = 4096  # where the store's values setting is "file"
    store = open_(path, map_size=1 << 20, values="inline" if values == "inline" else "file")
    say("READY")
    for i in range(10**9):
        tokens = prompt(int(seed), i)
        encode = encoder_for(tokens, filler=int(filler))
        store.put_blocks(NS, tokens, placed(encode) if values == "placed" else encode)
        say("ACK", i)


def churner(path: str, seed: str) -> None:
    """Save prompts forever into a store kept to a small budget, every record in the value
    file, acknowledging each with the file's size then (for the SIGKILL test): each save
    evicts, and the file's end, freed, is cut off it by a later save's commit."""
    lmdb_values.VALUE_MIN = 4096
    store = open_(path, map_size=1 << 20, values="file", max_bytes=CHURN_BUDGET)
    say("READY")
    for i in range(10**9):
        tokens = prompt(int(seed), i)
        store.put_blocks(NS, tokens, encoder_for(tokens, filler=8192))
        say("ACK", i, (Path(path) / lmdb_values.FILE_NAME).stat().st_size)


def check_still_held(store, match, tokens) -> None:
    """:func:`check_match` of the blocks of ``match`` a read still finds: the store holds
    1 MiB, and another process may evict blocks between a lookup and the read (a read
    then serves the blocks before the first one gone, as it should). The rows are
    checked in that same read: a second read could find fewer still."""
    with store.read(match.blocks) as views:
        if not views:
            return
        if len(views) < len(match.blocks):
            match = match.truncated(match.blocks[len(views)].start)
        check_views(views, match, tokens)


def worker(path: str, seed: str, count: str) -> None:
    """Save ``count`` prompts and restore prompts of every stream (the 4-process test)."""
    store = open_(path, map_size=1 << 20)
    rng = random.Random(int(seed))
    for i in range(int(count)):
        tokens = prompt(int(seed), i)
        save(store, tokens, filler=rng.randrange(0, 40_000))
        check_still_held(store, store.lookup(NS, tokens), tokens)
        other = prompt(rng.randrange(4), rng.randrange(int(count)))
        match = store.lookup(NS, other)
        if match.hit:  # whatever is found must be exactly right
            check_still_held(store, match, other)
    store.close()
    say("DONE", seed)


def hold(path: str) -> None:
    """Hold the write lock (one open write transaction) until stdin closes."""
    store = open_(path)

    def wait(txn):
        say("HOLDING")
        sys.stdin.read()

    store.backend.transact(wait)
    store.close()


def read_hold(path: str, first: str) -> None:
    """Read the prompt of 48 tokens from ``first`` on and hold that read until stdin
    closes; then say whether the bytes read are still what was saved (SAME)."""
    lmdb_values.VALUE_MIN = 4096
    store = open_(path)
    tokens = [int(first) + i for i in range(3 * BLOCK)]
    match = store.lookup(NS, tokens)
    with store.read(match.blocks) as views:
        say("READING", len(views))
        sys.stdin.read()
        check_views(views, match, tokens)
        say("SAME")
    store.close()


def grow(path: str, megabytes: str) -> None:
    """Write enough to make the map grow while another process has the store open."""
    store = open_(path)
    save(store, list(range(3 * BLOCK)), filler=int(megabytes) << 20)
    say("GREW", store.backend.stats()["map_size"])
    store.close()


def fill(path: str, values: str) -> None:
    """Save until the (small) filesystem is full; then check the store is intact (its
    1 MiB records in LMDB's pages, or in the value file)."""
    store = open_(path, map_size=1 << 30, values=values)
    acked = []
    try:
        for i in range(10_000):
            save(store, prompt(7, i), filler=1 << 20)
            acked.append(i)
    except StoreFullError as exc:
        say("FULL", type(exc.__cause__).__name__, len(acked))
    before = store.stats().blocks
    report = store.verify()
    assert report.clean, report
    for i in acked:
        check_match(store, store.lookup(NS, prompt(7, i)), prompt(7, i))
    store.close()
    store = open_(path)
    assert store.stats().blocks == before and store.verify().clean
    store.delete(NS)  # pages freed by deletes are reused
    save(store, prompt(7, 0))
    say("OK")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {
        "writer": writer,
        "churner": churner,
        "worker": worker,
        "hold": hold,
        "read_hold": read_hold,
        "grow": grow,
        "fill": fill,
    }[mode](*args)
