"""Many processes on one LMDB store: concurrent savers, SIGKILLed writers, readers never blocked."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvstore.testing.store import check_match

from .store_worker import NS, open_, prompt, save
from .test_lmdb import ROOT

WORKER = [sys.executable, "-m", "tests.test_store.store_worker"]


def spawn(*args, **kw):
    return subprocess.Popen(
        [*WORKER, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw
    )


def test_four_processes_saving_and_restoring_overlapping_prefixes(tmp_path):
    path, count = tmp_path / "s", 20
    procs = [spawn("worker", path, seed, count, stderr=subprocess.PIPE) for seed in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.startswith("DONE")
    store = open_(path)
    report = store.verify()
    assert report.clean, report
    for seed in range(4):
        for i in range(count):
            tokens = prompt(seed, i)
            match = store.lookup(NS, tokens)
            assert match.tokens == len(tokens) - 1, (seed, i)
            check_match(store, match, tokens)
    store.close()


def read_acks(lines):
    return [int(line.split()[1]) for line in lines if line.startswith("ACK")]


@pytest.mark.parametrize("values", ["inline", "file", "placed"])
def test_sigkill_at_random_points_during_saves_loses_nothing_acknowledged(tmp_path, values):
    # "file": every record of 4 KiB or more in the value file (lmdb_values); "placed":
    # there too, written into it part by part while it is being written (placement).
    path = tmp_path / "s"
    rng = random.Random(2024)
    acknowledged: list[list[int]] = []
    for kill in range(20):
        writer = spawn("writer", path, kill, rng.choice([0, 20_000, 200_000]), kill % 2, values)
        assert writer.stdout.readline().strip() == "READY"
        seen = []
        for _ in range(rng.randrange(0, 4)):
            seen.append(writer.stdout.readline())
        time.sleep(rng.uniform(0, 0.03))  # land somewhere inside a save
        writer.send_signal(signal.SIGKILL)
        rest, _ = writer.communicate(timeout=60)
        assert writer.returncode == -signal.SIGKILL
        acknowledged += [prompt(kill, i) for i in read_acks(seen + rest.splitlines())]

        store = open_(path)
        report = store.verify()
        assert report.clean, (kill, report)
        for tokens in acknowledged:
            match = store.lookup(NS, tokens)
            assert match.tokens == len(tokens) - 1, kill
            check_match(store, match, tokens)
        store.close()
    assert len(acknowledged) >= 20
    value_file = path / "values.kv"
    assert (value_file.exists() and value_file.stat().st_size > 4096) == (values != "inline")


def test_sigkill_while_a_budget_evicts_and_the_file_shrinks_leaves_it_clean(tmp_path):
    # Each save of the churner evicts, and later saves cut the freed end off the value
    # file: killed anywhere in that, the store verifies clean and whatever a lookup
    # finds is exactly what was saved.
    path = tmp_path / "s"
    rng = random.Random(76)
    sizes: list[int] = []
    for kill in range(12):
        churner = spawn("churner", path, kill)
        assert churner.stdout.readline().strip() == "READY"
        seen = [churner.stdout.readline() for _ in range(rng.randrange(2, 8))]
        time.sleep(rng.uniform(0, 0.03))
        churner.send_signal(signal.SIGKILL)
        rest, _ = churner.communicate(timeout=60)
        assert churner.returncode == -signal.SIGKILL
        acks = [line.split() for line in seen + rest.splitlines() if line.startswith("ACK")]
        sizes += [int(size) for _, _, size in acks]

        store = open_(path)
        report = store.verify()
        assert report.clean, (kill, report)
        found = 0
        for _, i, _ in acks:
            tokens = prompt(kill, int(i))
            match = store.lookup(NS, tokens)
            if match.hit:
                check_match(store, match, tokens)
                found += 1
        assert found, kill  # the last prompts saved are within the budget
        store.close()
    assert any(b < a for a, b in zip(sizes, sizes[1:])), sizes  # the file gave its end back


def test_readers_never_wait_for_a_writer_in_another_process(tmp_path):
    path = tmp_path / "s"
    store = open_(path)
    tokens = prompt(3, 3)
    save(store, tokens)
    holder = spawn("hold", path, stdin=subprocess.PIPE)
    done = threading.Event()
    try:
        assert holder.stdout.readline().strip() == "HOLDING"

        def lookups():
            for _ in range(50):
                check_match(store, store.lookup(NS, tokens), tokens)
            done.set()

        reader = threading.Thread(target=lookups, daemon=True)
        reader.start()
        reader.join(timeout=60)  # generous: it only has to finish while the lock is held
        assert done.is_set(), "lookups waited for the write lock held by another process"
        assert holder.poll() is None  # the lock was held the whole time
    finally:
        holder.communicate(timeout=60)  # closes its stdin: it commits and exits
    store.flush()  # the batched recency updates land once the lock is free
    store.close()
