"""``kvstore migrate``: re-encoding stores of real records, what it keeps, what it
reports, dry runs, resuming after SIGKILL, in-place swaps, refusals."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvstore.cli import main
from kvstore.codecs import decode_record_to_mlx
from kvstore.codecs.transcode import relative_mse
from kvstore.errors import CapabilityError, StoreError
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.store.maintenance.migrate import IN_PLACE_SUFFIX, JOURNAL_KEY, migrate, plan_migration
from kvstore.store.maintenance.migrate.journal import decode_journal

from .conftest import ROOT, content, raw_items
from .stores import NS, model_for, prompts, restore_caches

Q8 = "kv:quant:8:64"


def records(path) -> dict[bytes, bytes]:
    return {k: v for k, v in raw_items(path).items() if K.split_record_key(k)}


def index_and_uses(path) -> dict[bytes, bytes]:
    """Index keys (values vary with record sizes) and last-use values, by key."""
    return {
        k: (b"" if b"/.c/" in k or b"/.t/" in k else v)
        for k, v in raw_items(path).items()
        if b"/." in k
    }


def run_cli(capsys, *argv: str) -> tuple[int, dict, str]:
    status = main([*argv, "--json", "--no-progress"])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


def dense_layers(record: bytes) -> list[tuple[mx.array, mx.array]]:
    from kvstore.codecs import get_codec

    decoded = decode_record_to_mlx(record)
    return [get_codec(s.signature).to_dense(s) for s in decoded.layers]


def test_plain_to_quant8_halves_the_store_and_restores_within_quant8_tolerance(
    make_store, tmp_path, capsys
):
    src, dst = make_store("big"), tmp_path / "q8"
    before = raw_items(src)
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8)
    assert status == 0
    assert err.splitlines()[0].startswith(f"lossy: kv:plain -> {Q8} (layers 0-1)")
    assert raw_items(src) == before  # SRC untouched
    # Same keys, index and last uses; records re-encoded; the store is consistent.
    assert records(dst).keys() == records(src).keys()
    assert index_and_uses(dst) == index_and_uses(src)
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        assert store.verify().clean
        assert store.settings.storage_policy == Q8 and store.block_size == 64
        assert store.stats(by_family=True).by_family == {Q8: out["bytes_after"]}
    # Bytes roughly halved, measured on the stored records.
    src_bytes, dst_bytes = (
        sum(map(len, records(src).values())),
        sum(map(len, records(dst).values())),
    )
    assert (out["bytes_before"], out["bytes_after"]) == (src_bytes, dst_bytes)
    assert 0.45 < dst_bytes / src_bytes < 0.6, dst_bytes / src_bytes
    # Each record holds exactly what a kv:quant:8:64 cache stores for those rows, and the
    # reported error is the measured relative MSE (token-weighted mean per layer).
    sums = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0]}
    for key, raw in records(src).items():
        new = decode_record_to_mlx(records(dst)[key])
        for i, ((k, v), snap) in enumerate(zip(dense_layers(raw), new.layers)):
            assert snap.signature == Q8
            for name, x in (("keys", k), ("values", v)):
                q, scales, biases = mx.quantize(x, 64, 8)
                assert mx.array_equal(snap.tensors[f"{name}.q"], q).item()
                assert mx.array_equal(snap.tensors[f"{name}.scales"], scales).item()
                assert mx.array_equal(snap.tensors[f"{name}.biases"], biases).item()
            dk, dv = dense_layers(records(dst)[key])[i]
            sums[i][0] += k.shape[2]
            sums[i][1] += relative_mse(k, dk) * k.shape[2]
            sums[i][2] += relative_mse(v, dv) * k.shape[2]
    for e in out["errors"]:
        tokens, sk, sv = sums[e["layer"]]
        assert e["tokens"] == tokens
        assert e["rel_mse_keys"] == pytest.approx(sk / tokens, rel=1e-6)
        assert e["rel_mse_values"] == pytest.approx(sv / tokens, rel=1e-6)
        assert 0 < e["rel_mse_keys"] < 1e-4 and 0 < e["rel_mse_values"] < 1e-4
    # A restore from DST continues the prompt with logits within quant-8 tolerance.
    model = model_for("tiny")
    prompt = prompts(2, 320, shared=160)[0]
    extension = [5, 6, 7, 8]
    reference = model(mx.array([prompt + extension]), cache=model.make_cache())[0, -4:]
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        caches, reused = restore_caches(store, NS, prompt + extension)
    assert reused == len(prompt)
    got = model(mx.array([extension]), cache=caches)[0]
    err = (mx.abs(got - reference).max() / mx.abs(reference).max()).item()
    assert err <= 1e-2, err


def test_quant8_to_quant4_and_back_to_plain(make_store, tmp_path, capsys):
    src = make_store()
    q8, q4, plain = tmp_path / "q8", tmp_path / "q4", tmp_path / "plain"
    assert run_cli(capsys, "migrate", str(src), str(q8), "--to", Q8)[0] == 0
    status, out, err = run_cli(capsys, "migrate", str(q8), str(q4), "--to", "kv:quant:4:64")
    assert status == 0 and "lossy: kv:quant:8:64 -> kv:quant:4:64" in err
    assert out["bytes_after"] < 0.7 * out["bytes_before"]
    assert all(e["rel_mse_keys"] > 1e-3 for e in out["errors"])  # 4 bits lose more
    # Dequantising loses nothing further: not lossy, no lossy line, error exactly 0.
    status, out, err = run_cli(capsys, "migrate", str(q8), str(plain), "--to", "kv:plain")
    assert status == 0 and "lossy" not in err
    assert [c["lossy"] for c in out["conversions"]] == [False]
    assert {e["rel_mse_keys"] for e in out["errors"]} == {0.0}
    for key, raw in records(plain).items():
        for (k, v), (k8, v8) in zip(dense_layers(raw), dense_layers(records(q8)[key])):
            assert mx.array_equal(k, k8).item() and mx.array_equal(v, v8).item()
    with open_store(f"lmdb://{plain}", readonly=True) as store:
        assert store.settings.storage_policy == "lossless"


def test_layers_selects_global_or_sliding_and_rotating_layers_keep_their_kind(
    make_store, tmp_path, capsys
):
    src = make_store("gemma")  # layers 0 and 1 slide over 32 tokens, layer 2 is global
    for spec, expected in [
        ("sliding", ["kv:rotating-quant:8:64"] * 2 + ["kv:plain"]),
        ("global", ["kv:rotating-plain"] * 2 + [Q8]),
        ("0,2", ["kv:rotating-quant:8:64", "kv:rotating-plain", Q8]),
        ("all", ["kv:rotating-quant:8:64"] * 2 + [Q8]),
    ]:
        dst = tmp_path / spec.replace(",", "_")
        status, out, err = run_cli(
            capsys, "migrate", str(src), str(dst), "--to", Q8, "--layers", spec
        )
        assert status == 0
        for raw in records(dst).values():
            assert [s.signature for s in decode_record_to_mlx(raw).layers] == expected
        with open_store(f"lmdb://{dst}", readonly=True) as store:
            assert store.verify().clean
            policy = Q8 if spec == "all" else "lossless"
            assert store.settings.storage_policy == policy
    # A restore of the all-layers copy continues generation within quant-8 tolerance.
    model = model_for("tiny-gemma3")
    prompt, extension = prompts(3, 90, shared=45)[0], [9, 8, 7]
    reference = model(mx.array([prompt + extension]), cache=model.make_cache())[0, -3:]
    with open_store(f"lmdb://{tmp_path / 'all'}", readonly=True) as store:
        caches, reused = restore_caches(store, NS, prompt + extension)
    assert reused == len(prompt)
    got = model(mx.array([extension]), cache=caches)[0]
    assert (mx.abs(got - reference).max() / mx.abs(reference).max()).item() <= 1e-2


def test_dry_run_writes_nothing_and_estimates_the_result(make_store, tmp_path, capsys):
    src, dst = make_store("big"), tmp_path / "dst"
    before = raw_items(src)
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8, "--dry-run")
    assert status == 0 and out["dry_run"] and out["bytes_after_estimated"]
    assert not dst.exists() and raw_items(src) == before
    assert out["destination_state"] == "absent" and out["errors"] == []
    assert out["blocks"] == len(records(src))
    status, real, _ = run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8)
    assert status == 0
    assert out["bytes_before"] == real["bytes_before"]
    assert out["bytes_after"] == pytest.approx(real["bytes_after"], rel=0.01)
    # in text form it says so
    assert main(["migrate", str(src), str(tmp_path / "d2"), "--to", Q8, "--dry-run"]) == 0
    assert "nothing was written" in capsys.readouterr().out
    assert not (tmp_path / "d2").exists()


def test_format_version_1_is_a_lossless_reencode(make_store, tmp_path, capsys):
    src, dst = make_store(), tmp_path / "v1"
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--format-version", "1")
    assert status == 0 and "lossy" not in err and out["conversions"] == []
    assert content(dst) == content(src)  # the same records, byte for byte


def journal_blocks(path) -> int | None:
    """Blocks the journal of an in-progress migration at ``path`` has committed."""
    if not (path / "data.mdb").exists():
        return None
    backend = open_backend(f"lmdb://{path}", readonly=True)
    try:
        raw = backend.get_many([JOURNAL_KEY])[0]
    finally:
        backend.close()
    return None if raw is None else decode_journal(raw).blocks


def kill_during_migration(src, dst, at_least: int) -> None:
    """Start ``kvstore migrate`` as a subprocess, SIGKILL it once DST's journal holds
    ``at_least`` blocks (one block per commit: every block is a possible stop)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "migrate",
            str(src),
            str(dst),
            "--to",
            Q8,
            "--batch-bytes",
            "1",
            "--no-progress",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while (journal_blocks(dst) or 0) < at_least:
            assert proc.poll() is None, "the migration ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("seed", [1, 2])
def test_a_migration_killed_at_a_random_point_resumes_to_the_same_result(
    seed, make_store, tmp_path, capsys
):
    src = make_store("many")
    before = raw_items(src)
    total = len(records(src))
    rng = random.Random(seed)
    dst = tmp_path / "killed"
    first = rng.randrange(1, total - 2)
    kill_during_migration(src, dst, first)
    assert raw_items(src) == before
    # DST is resumable: a journal that agrees with the blocks it holds
    done = journal_blocks(dst)
    assert done is not None and first <= done < total
    plan = plan_migration(str(src), str(dst), to=Q8)
    assert plan.destination_state == "resumable" and plan.resume.blocks == done
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        assert store.stats().blocks == done and store.verify().clean
    kill_during_migration(src, dst, rng.randrange(done + 1, total))  # and again
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8)
    assert status == 0 and 0 < out["resumed"] < total == out["blocks"]
    assert out["destination_state"] == "resumable"
    assert journal_blocks(dst) is None  # done: the journal is gone
    reference = tmp_path / "uninterrupted"
    status, ref, _ = run_cli(capsys, "migrate", str(src), str(reference), "--to", Q8)
    assert content(dst) == content(reference)
    assert out["errors"] == ref["errors"] and out["bytes_after"] == ref["bytes_after"]
    assert raw_items(src) == before


def test_dst_must_be_empty_unless_overwrite_or_a_matching_journal(make_store, tmp_path, capsys):
    src, dst = make_store(), tmp_path / "dst"
    assert run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8)[0] == 0
    assert main(["migrate", str(src), str(dst), "--to", "kv:quant:4:64"]) == 2
    assert "is not empty" in capsys.readouterr().err
    status, out, _ = run_cli(
        capsys, "migrate", str(src), str(dst), "--to", "kv:quant:4:64", "--overwrite"
    )
    assert status == 0 and out["destination_state"] == "overwrite"
    assert {s.signature for r in records(dst).values() for s in decode_record_to_mlx(r).layers} == {
        "kv:quant:4:64"
    }
    # an interrupted migration with other parameters is not resumed by mistake
    other = tmp_path / "other"
    with pytest.raises(KeyboardInterrupt):
        migrate(str(src), str(other), to=Q8, batch_bytes=1, progress=_interrupt_after(3))
    assert main(["migrate", str(src), str(other), "--to", "kv:quant:4:64"]) == 2
    assert "interrupted migration with --to kv:quant:8:64" in capsys.readouterr().err
    status, out, _ = run_cli(capsys, "migrate", str(src), str(other), "--to", Q8)
    assert status == 0 and out["resumed"] >= 2


def _interrupt_after(n: int):
    seen = [0]

    def progress(blocks: int, nbytes: int) -> None:
        seen[0] += blocks
        if seen[0] >= n:
            raise KeyboardInterrupt

    return progress


def test_corrupt_source_records_are_skipped_with_what_follows(make_store, tmp_path, capsys):
    src, dst = make_store(), tmp_path / "dst"
    with open_store(f"lmdb://{src}", readonly=True) as store:
        match = store.lookup(NS, prompts(3, 70, shared=35)[0])
    bad = match.blocks[2].key  # the third block of one prompt: 2 blocks follow it
    backend = open_backend(f"lmdb://{src}")
    value = bytearray(backend.get_many([bad])[0])
    value[-5] ^= 1
    backend.put_many([(bad, bytes(value))])
    backend.close()
    before = raw_items(src)
    status, out, _ = run_cli(capsys, "migrate", str(src), str(dst), "--to", Q8)
    assert status == 1
    assert out["skipped"] == [{"key": bad.decode(), "reason": "corrupt"}]
    assert out["left_out"] == 2 and out["pruned"] == 0  # its child and the tail after it
    assert len(records(dst)) == len(records(src)) - 3
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        assert store.verify().clean
    assert raw_items(src) == before


def test_in_place_swaps_the_lmdb_directory(make_store, tmp_path, capsys):
    src = make_store()
    reference = tmp_path / "reference"
    assert run_cli(capsys, "migrate", str(src), str(reference), "--to", Q8)[0] == 0
    status, out, err = run_cli(capsys, "migrate", f"lmdb://{src}", "--in-place", "--to", Q8)
    assert status == 0 and out["swapped"] and "lossy" in err
    assert content(src) == content(reference)
    assert not (tmp_path / (src.name + IN_PLACE_SUFFIX)).exists()
    assert sorted(p.name for p in src.parent.iterdir()) == sorted([src.name, "reference"])


def test_in_place_refuses_to_swap_a_store_written_meanwhile(make_store, tmp_path):
    src = make_store()
    before = raw_items(src)
    writer = (
        "from kvstore.store import open_store\n"
        f"with open_store('lmdb://{src}') as s: s.set_budget('1GiB')\n"
    )
    wrote = []

    def progress(blocks: int, nbytes: int) -> None:
        if not wrote:  # another process writes to SRC while it is being migrated
            subprocess.run([sys.executable, "-c", writer], cwd=ROOT, check=True)
            wrote.append(True)

    with pytest.raises(StoreError, match="was written to during the migration"):
        migrate(str(src), to=Q8, in_place=True, progress=progress)
    after = raw_items(src)
    assert {k: v for k, v in after.items() if k not in K.META_KEYS} == content(src)
    assert content(src) == {k: v for k, v in before.items() if k not in K.META_KEYS}  # not swapped
    copy_dir = tmp_path / (src.name + IN_PLACE_SUFFIX)
    assert journal_blocks(copy_dir) == len(records(src))  # the copy is there, resumable
    report = migrate(str(src), to=Q8, in_place=True)  # idle now: it resumes and swaps
    assert report.swapped and report.resumed == report.blocks
    assert not copy_dir.exists()


def test_migrate_between_other_backends(make_store):
    src = make_store()
    with (
        open_store(f"lmdb://{src}", readonly=True) as lmdb_store,
        open_store("memory://mig-src", block_size=16) as mem,
    ):
        items = list(lmdb_store.backend.scan(b"kvstore/v1/"))
        mem.backend.put_many([(k, v) for k, v in items if k not in K.META_KEYS])
        report = migrate("memory://mig-src", "memory://mig-dst", to=Q8)
        assert report.blocks == len(records(src))
        with open_store("memory://mig-dst") as dst:
            assert dst.verify().clean and dst.settings.storage_policy == Q8
            assert dst.stats().blocks == report.blocks
    with pytest.raises(CapabilityError, match="tiered store"):
        migrate(str(src), "tiered://?tiers=memory://a,memory://b", to=Q8)


def test_plain_to_turboquant_through_the_registry(make_store, tmp_path, capsys):
    src, dst = make_store("gemma"), tmp_path / "tq"
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", "kv:turboquant:4:4")
    assert status == 0 and "lossy: kv:rotating-plain -> kv:rotating-turboquant:4:4" in err
    for raw in records(dst).values():
        assert [s.signature for s in decode_record_to_mlx(raw).layers] == [
            "kv:rotating-turboquant:4:4"
        ] * 2 + ["kv:turboquant:4:4"]
    assert out["bytes_after"] < 0.4 * out["bytes_before"]


def test_the_console_script_migrates(make_store, tmp_path):
    src, dst = make_store(), tmp_path / "dst"
    script = Path(sys.executable).parent / "kvstore"
    done = subprocess.run(
        [str(script), "migrate", str(src), str(dst), "--to", Q8, "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("lossy: kv:plain -> kv:quant:8:64")
    assert "rel MSE K" in done.stdout and "->" in done.stdout
    np.testing.assert_equal(sorted(records(dst)), sorted(records(src)))


# Run in a process of its own: tracemalloc counts every thread's allocations, and a
# thread another test left running (a store's writer, a server's) would count in one
# migration's peak and not the other's (this failed once in a loaded full run).
_PEAKS = """
import gc, json, sys, tracemalloc
from kvstore.store.maintenance.migrate import migrate

small, large, out = sys.argv[1:4]
for i, src in enumerate((small, large)):  # imports and caches, uncounted
    migrate(src, f"{out}/{i}-warm", to="kv:quant:8:64")
peaks = []
for i, src in enumerate((small, large)):
    tracemalloc.start()
    try:  # a collection per block empties free lists, which tracemalloc counts as used
        migrate(
            src, f"{out}/{i}-q8", to="kv:quant:8:64", batch_bytes=1,
            progress=lambda blocks, nbytes: gc.collect(),
        )
        peaks.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
print(json.dumps(peaks))
"""


def test_memory_does_not_grow_with_the_store(make_store, tmp_path):
    """Peak Python-side allocations (records are bytes and numpy buffers, which
    tracemalloc sees) are the same for a store of 14 blocks and one of 90: a
    block at a time, never the store."""
    small, large = make_store("gemma"), make_store("many")
    assert len(records(large)) > 5 * len(records(small))
    done = subprocess.run(
        [sys.executable, "-c", _PEAKS, str(small), str(large), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout.splitlines()[-1])
    store_bytes = sum(map(len, records(large).values()))
    assert peaks[1] < 1.25 * peaks[0] and peaks[1] < store_bytes / 4, (peaks, store_bytes)


def test_to_a_per_layer_layout_text_or_file_and_inspect_shows_it(make_store, tmp_path, capsys):
    from kvstore.layout import parse_layout, write_layout_file

    src = make_store("gemma")  # layers 0 and 1 slide over 32 tokens, layer 2 is global
    layout = "default=kv:quant:4:64;1=kv:quant:8:64"
    expected = ["kv:rotating-quant:4:64", "kv:rotating-quant:8:64", "kv:quant:4:64"]
    file = write_layout_file(tmp_path / "layout.json", parse_layout(layout), note="tuned")
    for name, to in (("text", layout), ("file", str(file))):
        dst = tmp_path / name
        status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", to)
        assert status == 0, err
        for raw in records(dst).values():
            assert [s.signature for s in decode_record_to_mlx(raw).layers] == expected
        with open_store(f"lmdb://{dst}", readonly=True) as store:
            assert store.verify().clean
            assert store.settings.storage_policy == "default=kv:quant:4:64;1=kv:quant:8:64"
    key = next(iter(records(tmp_path / "text"))).decode()
    status = main(["inspect", str(tmp_path / "text"), key, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    assert out["layout"] == "0=kv:rotating-quant:4:64;1=kv:rotating-quant:8:64;2=kv:quant:4:64"
    # Layers a layout names nothing for stay as they are, and so does the storage policy.
    dst = tmp_path / "sliding-only"
    status, out, err = run_cli(capsys, "migrate", str(src), str(dst), "--to", "sliding=" + Q8)
    assert status == 0, err
    for raw in records(dst).values():
        assert [s.signature for s in decode_record_to_mlx(raw).layers] == [
            "kv:rotating-quant:8:64",
            "kv:rotating-quant:8:64",
            "kv:plain",
        ]
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        assert store.settings.storage_policy == "lossless"
    # --layers still limits which layers convert; bad layouts are one line and status 2.
    dst = tmp_path / "limited"
    status, out, err = run_cli(
        capsys, "migrate", str(src), str(dst), "--to", layout, "--layers", "global"
    )
    assert status == 0
    for raw in records(dst).values():
        assert [s.signature for s in decode_record_to_mlx(raw).layers] == [
            "kv:rotating-plain",
            "kv:rotating-plain",
            "kv:quant:4:64",
        ]
    assert main(["migrate", str(src), str(tmp_path / "x"), "--to", "7=" + Q8]) == 2
    assert "records hold 3 layers" in capsys.readouterr().err
    assert main(["migrate", str(src), str(tmp_path / "y"), "--to", "0=kv:nope:1"]) == 2
