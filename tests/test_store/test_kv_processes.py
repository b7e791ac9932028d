"""Real caches across processes: end to end, SIGKILLed writers, four processes at once.

The workers (``kv_worker``) are fresh interpreters: nothing is shared with
this process but the LMDB store on disk.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from kvstore.bridge import generate_tokens
from kvstore.bridge.namespace import namespace_for_model
from kvstore.codecs import snapshot
from kvstore.store import open_store

from .kv_helpers import BLOCK, CHUNK, FAMILIES, log_probs_recorder, model_for, token_by_token
from .kv_worker import check_restore, e2e_cases, long_prompt, shared_prompt
from .test_lmdb import ROOT

WORKER = [sys.executable, "-m", "tests.test_store.kv_worker"]
#: Cases whose chunk ends agree with the reference run: logits equal bit for bit.
EXACT = {"plain", "quant", "window", "window-quant", "turboquant", "window-turboquant"}


#: Largest first-step log-prob error a lossy storage policy may cause (tiny model).
LOSSY_TOLERANCE = {"lossy": 0.05, "lossy-turboquant": 0.5}


def spawn(*args, **kw):
    return subprocess.Popen(
        [*WORKER, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw
    )


def run_worker(*args) -> dict:
    proc = spawn(*args, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


def reference(family: str, tokens: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """The same generation with no store at all."""
    config, policy = FAMILIES[family]
    seen, sampler = log_probs_recorder()
    out, _ = generate_tokens(
        model_for(config),
        tokens,
        policy=policy,
        max_tokens=4,
        chunk_size=CHUNK,
        block_size=BLOCK,
        sampler=sampler,
    )
    return out, seen


def test_a_second_process_continues_from_the_first_ones_store_as_if_it_had_no_store(tmp_path):
    first = run_worker("e2e", "first", tmp_path)
    report = tmp_path / "first.json"
    report.write_text(json.dumps(first))
    second = run_worker("e2e", "second", tmp_path, report)
    cases = e2e_cases({k: v["tokens"] for k, v in first.items()})
    assert {c[0] for c in cases} == set(second)
    for name, family, _, _, tokens in cases:
        got = second[name]
        assert got["error"] is None, (name, got["error"])
        assert first[name]["reused"] == 0, name  # process A found an empty store
        want_tokens, want_logprobs = reference(family, tokens)
        got_logprobs = [np.array(row, np.float32) for row in got["logprobs"]]
        if name.startswith("lossy"):  # re-encoded in the store: close, not equal
            assert got["reused"] == 96
            err = np.abs(got_logprobs[0] - want_logprobs[0].reshape(-1)).max()
            assert 0 < err < LOSSY_TOLERANCE[name], (name, err)  # re-encoded, and close
            continue
        assert got["tokens"] == want_tokens, name
        assert got["reused"] > 0, name
        for a, b in zip(got_logprobs, want_logprobs, strict=True):
            b = b.reshape(-1)
            if name in EXACT:
                assert np.array_equal(a, b), name
            else:
                assert np.allclose(a, b, atol=1e-4), (name, np.abs(a - b).max())
    # Process B reused what process A stored, wherever the prompts agree.
    assert second["plain"]["reused"] == 96 and second["window"]["reused"] == 64
    assert second["window-70"]["reused"] == 70
    assert second["plain-turn"]["reused"] == 100 + 3


def read_acks(text: str) -> list[int]:
    """The acknowledged lengths: whole ``ACK n`` lines only (a kill may cut the last one)."""
    complete = text.split("\n")[:-1]
    return [int(line.split()[1]) for line in complete if line.startswith("ACK ")]


@pytest.mark.parametrize("mode", ["writer", "behind"])
def test_sigkill_during_saves_of_real_caches_loses_nothing_acknowledged(tmp_path, mode):
    """``writer`` saves synchronously; ``behind`` hands saves off to the writer thread
    and acknowledges them after each flush: a kill loses at most what was not flushed."""
    url = f"lmdb://{tmp_path / 's'}"
    model = model_for("tiny")
    namespace = namespace_for_model(model)
    rng = random.Random(2025)
    acknowledged: dict[tuple[int, int], None] = {}  # (writer seed, prefix length)
    full = {}  # writer seed -> the caches of its whole prompt
    for kill in range(20 if mode == "writer" else 10):
        writer = spawn(mode, url, kill)
        assert writer.stdout.readline().strip() == "READY"
        seen = [writer.stdout.readline() for _ in range(rng.randrange(1, 3))]
        time.sleep(rng.uniform(0, 0.005))  # land somewhere inside one of the next saves
        writer.send_signal(signal.SIGKILL)
        rest, _ = writer.communicate(timeout=60)
        assert writer.returncode == -signal.SIGKILL and "END" not in rest, kill
        acknowledged.update(((kill, n), None) for n in read_acks("".join(seen) + rest))
        full[kill] = token_by_token(model, long_prompt(kill))

        with open_store(url, block_size=BLOCK, touch_interval=0) as store:
            report = store.verify()
            assert report.clean, (kill, report)
            for seed, length in acknowledged:
                tokens = long_prompt(seed)[:length]
                restored = store.restore(store.lookup(namespace, tokens), model.make_cache())
                assert restored[0].offset == length - 1, (kill, seed, length)
                # Bit-exact: rows computed token by token depend on the prefix alone.
                for got, want in zip(restored, full[seed], strict=True):
                    a, b = snapshot(got), snapshot(want, 0, length - 1)
                    for name in a.tensors:
                        assert mx.array_equal(a.tensors[name], b.tensors[name]).item()
    assert len(acknowledged) >= 10, len(acknowledged)


def test_four_processes_save_and_restore_overlapping_prefixes_of_a_model(tmp_path):
    url, count = f"lmdb://{tmp_path / 's'}", 12
    procs = [spawn("mixer", url, seed, count, stderr=subprocess.PIPE) for seed in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.startswith("DONE")
    model = model_for("tiny")
    namespace = namespace_for_model(model)
    with open_store(url, block_size=BLOCK) as store:
        assert store.verify().clean
        for seed in range(4):
            for i in range(count):
                tokens = shared_prompt(seed, i)
                assert check_restore(store, namespace, model, tokens) == len(tokens) - 1


@pytest.mark.parametrize("tokens", [[1, 2, 3], shared_prompt(0, 0)])
def test_token_by_token_caches_agree_with_themselves(tokens):
    """The process tests' premise: computing a prefix twice gives identical rows."""
    from .kv_helpers import assert_same_caches

    model = model_for("tiny")
    assert_same_caches(token_by_token(model, tokens), token_by_token(model, tokens))
