"""Flip bits all over a small store's ``data.mdb`` and check what every entry point does.

    .venv/bin/python tools/damage/sweep.py [--positions 20000] [--workers 2] [--seed 0]
        [--out tools/damage/results] [--every-bit START:END ...] [--leaf-headers]
        [--again POSITIONS]

It builds one small LMDB store (two models' namespaces, plain and sliding-window
layers, prompts sharing prefixes, a tail superseded and a prompt deleted, so the
file has meta, branch, leaf and overflow pages and some free ones), then, for
each position (a byte and a bit, spread over every kind of page), in a worker
process, on a fresh copy of the file with that one bit flipped:

1. **use**: open the store, look up and restore every saved prompt, and compare
   each restored cache with what the intact store restores at the same length,
   bit for bit (a difference is a *wrong value*);
2. **verify**: ``kvstore verify`` (its library call), then ``verify --fix``;
3. **reuse**: open it again, re-save every prompt (a generation with the store),
   and restore each: it must be whole again and equal the intact store's.

An exception that is not a ``KVStoreError`` is *foreign*; a worker that dies of
a signal is a *crash* (the position is recorded and a fresh worker goes on).
The summary (``sweep-summary.json`` and ``sweep-summary.txt`` in ``--out``)
counts outcomes by page kind; every position's outcome goes to
``sweep-positions.jsonl.gz``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK = 16
KINDS = ("meta", "branch", "leaf", "overflow", "overflow-data", "other")
#: (namespace label, model config, cache policy); prompts are (seed, length, shared prefix).
MODELS = (
    ("plain", "tiny", None),
    ("window", "tiny-gemma3", None),
)
PROMPTS = ((1, 70, None), (2, 45, (1, 32)), (3, 90, (1, 48)), (4, 23, None))


# ---------------------------------------------------------------- the store


def _prompt(seed: int, n: int, shared: tuple[int, int] | None) -> list[int]:
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, 256, n).tolist()
    if shared is not None:
        other, length = shared
        base = np.random.default_rng(other).integers(0, 256, 200).tolist()
        tokens = base[:length] + tokens[length:]
    return tokens


class World:
    """The models, prompts and namespaces of the sweep store (built the same in every process)."""

    def __init__(self) -> None:
        from kvstore.bridge.namespace import namespace_for_model
        from kvstore.model import build_model

        self.models: dict[str, Any] = {}
        self.namespaces: dict[str, str] = {}
        for label, config, _ in MODELS:
            model = build_model(config, seed=0)
            self.models[label] = model
            self.namespaces[label] = namespace_for_model(model)
        self.prompts = [_prompt(*p) for p in PROMPTS]

    def cases(self) -> list[tuple[str, int, list[int]]]:
        return [(label, i, p) for label, _, _ in MODELS for i, p in enumerate(self.prompts)]

    def save(self, store: Any, label: str, tokens: list[int]) -> None:
        from kvstore.bridge import generate_tokens

        chunk = max(32, store.block_size)  # a store whose settings were rebuilt may differ
        generate_tokens(self.models[label], tokens, store=store, max_tokens=1, chunk_size=chunk)


#: Every timestamp the sweep store writes (settings, index entries, last uses).
BUILT_AT = 1_700_000_000.0


def build(path: Path) -> None:
    """The sweep store: every prompt of every model saved, one tail superseded, one deleted.

    It is the same bytes every time (:func:`store_digest`), so ``--again`` replays
    a position exactly: the clock is fixed (a ticking one is read a varying number
    of times by the writer thread) and every save is its own commit (``group``
    durability batches saves by how they fall in its window, and the batches
    decide which pages are freed and reused), committed before the next save
    looks up (a read transaction open during a commit keeps pages from reuse).
    """
    from kvstore.store import open_store

    world = World()
    options = {"touch_interval": 0, "clock": lambda: BUILT_AT, "durability": "sync"}
    with open_store(f"lmdb://{path}", block_size=BLOCK, **options) as store:
        for label, _, tokens in world.cases():
            for saved in (tokens[: len(tokens) - 7], tokens):  # a tail, superseded next
                world.save(store, label, saved)
                store.flush()  # committed before the next lookup's read (readers pin pages)
        extra = _prompt(9, 40, (1, 16))
        world.save(store, "plain", extra)
        store.flush()
        store.delete(world.namespaces["plain"], extra[:32])  # frees pages


def store_digest(path: Path) -> str:
    """SHA-256 of the store's ``data.mdb``: what a replay checks it damages the same file."""
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


# ---------------------------------------------------------------- one position


def _held(cache: Any) -> list[tuple[int, int, dict[str, bytes]]]:
    from kvstore.codecs import snapshot_held
    from kvstore.codecs.arrays import as_numpy

    return [
        (s.start, s.stop, {k: as_numpy(v).tobytes() for k, v in s.tensors.items()})
        for s in snapshot_held(cache)
    ]


def _same(got: list[Any], want: list[tuple[str, int, Any]]) -> bool:
    """Whether caches ``got`` hold exactly ``want`` (:func:`_summary` of the right ones)."""
    if len(got) != len(want):
        return False
    for g, (signature, offset, held) in zip(got, want):
        if (g.signature(), int(g.offset)) != (signature, offset):
            return False
        if offset and _held(g) != held:
            return False
    return True


def _summary(caches: list[Any]) -> list[tuple[str, int, Any]]:
    return [(c.signature(), int(c.offset), _held(c) if int(c.offset) else None) for c in caches]


class Worker:
    """Runs positions on copies of the base store; the intact store gives what is right."""

    def __init__(self, base: Path, scratch: Path) -> None:
        from kvstore.store import open_store

        self.base = base
        self.scratch = scratch
        self.world = World()
        self.intact = open_store(f"lmdb://{base}", readonly=True, touch_interval=0)
        self._expected: dict[tuple[str, int, int], list[tuple[str, int, Any]]] = {}

    def expected(self, label: str, i: int, tokens: list[int], n: int) -> list[tuple[str, int, Any]]:
        """What the intact store restores of prompt ``i`` cut to ``n`` tokens."""
        key = (label, i, n)
        if key not in self._expected:
            model = self.world.models[label]
            match = self.intact.lookup(self.world.namespaces[label], tokens + [7])
            restored = self.intact.restore(match.truncated(n), model.make_cache())
            self._expected[key] = _summary(restored)
        return self._expected[key]

    def full(self, label: str, i: int, tokens: list[int]) -> int:
        return self.intact.lookup(self.world.namespaces[label], tokens + [7]).tokens

    def run(self, pos: int, bit: int, first_phase: int = 0) -> dict[str, Any]:
        """One position; ``first_phase`` > 0 when an earlier worker crashed in a phase
        (the copy it damaged is then reused as the crash left it)."""
        from kvstore.errors import KVStoreError
        from kvstore.testing.lmdb_pages import flip_bit

        store_dir = self.scratch / "s"
        if not first_phase:
            shutil.rmtree(store_dir, ignore_errors=True)
            store_dir.mkdir(parents=True)
            shutil.copyfile(self.base / "data.mdb", store_dir / "data.mdb")
            flip_bit(store_dir / "data.mdb", pos, bit)
        url = f"lmdb://{store_dir}"
        out: dict[str, Any] = {"pos": pos, "bit": bit, "wrong": [], "foreign": [], "errors": []}

        def guarded(phase: str, fn: Any) -> Any:
            try:
                return fn()
            except KVStoreError as exc:
                out["errors"].append(f"{phase}: {type(exc).__name__}: {str(exc)[:200]}")
            except Exception as exc:  # noqa: BLE001 - what the sweep counts
                tb = traceback.format_exc(limit=-3)
                out["foreign"].append(f"{phase}: {type(exc).__name__}: {exc} | {tb[-600:]}")
            return None

        phases = [
            ("found", lambda: self._verify(url, repair=False)),
            ("opened", lambda: self._use(url, out)),
            ("fix", lambda: self._verify(url, repair=True)),
            ("reusable", lambda: self._reuse(url, out)),
        ]
        for i, (name, fn) in enumerate(phases):
            if i < first_phase:
                continue
            print(f"P {i}", flush=True)  # the parent learns which phase a crash was in
            value = guarded(name, fn)
            out[name] = value if name in ("found", "fix") else bool(value)
        return out

    def _use(self, url: str, out: dict[str, Any]) -> bool:
        from kvstore.errors import KVStoreError
        from kvstore.store import open_store

        with open_store(url, touch_interval=0, sync=False) as store:
            for label, i, tokens in self.world.cases():
                model = self.world.models[label]
                try:
                    match = store.lookup(self.world.namespaces[label], tokens + [7])
                    caches = store.restore(match, model.make_cache())
                except KVStoreError as exc:
                    out["errors"].append(f"use: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                n = int(caches[0].offset)
                if n > self.full(label, i, tokens) or not _same(
                    caches, self.expected(label, i, tokens, n)
                ):
                    out["wrong"].append(f"{label}#{i} at {n}")
            out["misses"] = dict(store.stats().misses)
        return True

    def _verify(self, url: str, repair: bool) -> dict[str, Any]:
        from kvstore.store.maintenance.repair import verify_store

        result = verify_store(url, repair=repair)
        found = result.found
        names = ("engine", "settings", "corrupt", "newer_format", "orphans", "dangling")
        names += ("totals_mismatch",)
        problems = {n: len(getattr(found, n)) for n in names if getattr(found, n)}
        return {"clean": found.clean, "problems": problems, "after_clean": result.clean}

    def _reuse(self, url: str, out: dict[str, Any]) -> bool:
        """Every prompt restores whole and right, re-saved first where it does not."""
        from kvstore.store import open_store

        ok = True
        with open_store(url, touch_interval=0, sync=False) as store:
            for label, i, tokens in self.world.cases():
                if not self._whole(store, label, i, tokens):
                    self.world.save(store, label, tokens)
                    if not self._whole(store, label, i, tokens):
                        out.setdefault("not_reusable", []).append(f"{label}#{i}")
                        ok = False
        return ok

    def _whole(self, store: Any, label: str, i: int, tokens: list[int]) -> bool:
        model = self.world.models[label]
        match = store.lookup(self.world.namespaces[label], tokens + [7])
        caches = store.restore(match, model.make_cache())
        want = self.full(label, i, tokens)
        return int(caches[0].offset) == want and _same(
            caches, self.expected(label, i, tokens, want)
        )


def worker_main(base: Path) -> int:
    worker = Worker(base, Path(os.environ["KVSTORE_SWEEP_SCRATCH"]))
    print("READY", flush=True)
    for line in sys.stdin:
        pos, bit, first_phase = map(int, line.split())
        result = worker.run(pos, bit, first_phase)
        print("R " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------- the parent


def every_bit(data: Path, spans: list[str]) -> list[tuple[int, int, str]]:
    """Every bit of the byte spans ``START:END`` (``--every-bit``), with each one's page kind."""
    from kvstore.testing.lmdb_pages import read_pages

    psize, pages = read_pages(data)
    out = []
    for span in spans:
        start, end = (int(x, 0) for x in span.split(":"))
        for pos in range(start, min(end, len(pages) * psize)):
            out += [(pos, bit, pages[pos // psize].kind) for bit in range(8)]
    return out


def leaf_headers(data: Path) -> list[tuple[int, int, str]]:
    """Every bit of every live leaf node's 8-byte header (``--leaf-headers``): its value's
    size, its flags and its key's size, by which LMDB finds and moves the node's bytes."""
    from kvstore.testing.lmdb_pages import leaf_nodes

    return [
        (n.offset + i, bit, "leaf") for n in leaf_nodes(data) for i in range(8) for bit in range(8)
    ]


def positions(data: Path, count: int, seed: int) -> list[tuple[int, int, str]]:
    """``count`` (byte, bit, page kind) spread evenly over the kinds of page present."""
    from kvstore.testing.lmdb_pages import read_pages

    psize, pages = read_pages(data)
    by_kind: dict[str, list[int]] = collections.defaultdict(list)
    for page in pages:
        by_kind[page.kind].append(page.offset)
    rng = random.Random(seed)
    kinds = [k for k in KINDS if by_kind.get(k)]
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        page = rng.choice(by_kind[kind])
        out.append((page + rng.randrange(psize), rng.randrange(8), kind))
    rng.shuffle(out)
    return out


class Pool:
    """Worker processes fed one position at a time, one thread per worker. A worker
    that dies is a crash: a fresh worker takes the position on from the next phase
    (the damaged copy stays in that slot's scratch directory)."""

    def __init__(self, base: Path, n: int) -> None:
        self.base = base
        self.scratch = [Path(tempfile.mkdtemp(prefix=f"kvstore-sweep-{i}-")) for i in range(n)]
        self._lock = threading.Lock()

    def _start(self, i: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--base", str(self.base)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "KVSTORE_SWEEP_SCRATCH": str(self.scratch[i])},
        )
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a sweep worker failed to start (exit {proc.wait()})")
            if line.startswith("READY"):
                return proc

    def run(self, todo: list[tuple[int, int, str]], sink: Any) -> None:
        pending = list(reversed(todo))
        threads = [
            threading.Thread(target=self._slot, args=(i, pending, sink), daemon=True)
            for i in range(len(self.scratch))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _slot(self, i: int, pending: list[tuple[int, int, str]], sink: Any) -> None:
        proc: subprocess.Popen[str] | None = None
        while True:
            with self._lock:
                if not pending:
                    break
                pos, bit, kind = pending.pop()
            phase, crashes = 0, []
            while True:
                proc = proc or self._start(i)
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{pos} {bit} {phase}\n")
                proc.stdin.flush()
                result = None
                while True:
                    line = proc.stdout.readline()
                    if line.startswith("P "):
                        phase = int(line.split()[1])
                    elif line.startswith("R ") or not line:
                        result = json.loads(line[2:]) if line else None
                        break
                if result is not None:
                    break
                code = proc.wait()  # the worker died in ``phase``
                name = signal.Signals(-code).name if code < 0 else f"exit {code}"
                crashes.append({"phase": phase, "signal": name})
                proc, phase = None, phase + 1
                if phase >= 4:
                    result = {"pos": pos, "bit": bit}
                    break
            result["kind"] = kind
            if crashes:
                result["crashes"] = crashes
            with self._lock:
                sink(result)
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()

    def close(self) -> None:
        for d in self.scratch:
            shutil.rmtree(d, ignore_errors=True)


def summarise(results: list[dict[str, Any]], seconds: float, base: Path) -> dict[str, Any]:
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in results:
        c = by_kind[r["kind"]]
        c["positions"] += 1
        c["crashes"] += bool(r.get("crashes"))
        for crash in r.get("crashes", ()):
            c[f"crash in phase {crash['phase']}"] += 1
        if "wrong" not in r:
            c["not repairable"] += 1
            continue
        c["wrong values"] += bool(r["wrong"])
        c["foreign exceptions"] += bool(r["foreign"])
        c["opened and used"] += r.get("opened", False)
        c["refused with a KVStoreError"] += not r.get("opened", False)
        found = r.get("found") or {}
        c["verify found damage"] += bool(found) and not found.get("clean", True)
        c["repaired, fully reusable"] += r.get("reusable", False)
        c["not repairable"] += not r.get("reusable", False)
    total: collections.Counter[str] = collections.Counter()
    for c in by_kind.values():
        total.update(c)
    return {
        "positions": len(results),
        "seconds": round(seconds, 1),
        "store_bytes": (base / "data.mdb").stat().st_size,
        "store_sha256": store_digest(base),
        "total": dict(total),
        "by_page_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
    }


ROWS = (
    "positions",
    "opened and used",
    "refused with a KVStoreError",
    "verify found damage",
    "repaired, fully reusable",
    "wrong values",
    "foreign exceptions",
    "crashes",
    "not repairable",
)


def table(summary: dict[str, Any]) -> str:
    """The summary as a text table: one row per outcome, one column per page kind."""
    kinds = list(summary["by_page_kind"])
    columns = [*kinds, "total"]
    counts = {**summary["by_page_kind"], "total": summary["total"]}
    width = max(len(r) for r in ROWS)
    lines = [" ".join([" " * width, *(f"{c:>13}" for c in columns)])]
    for row in ROWS:
        cells = (f"{counts[c].get(row, 0):>13}" for c in columns)
        lines.append(" ".join([f"{row:<{width}}", *cells]))
    return "\n".join(lines)


def write_summary(out: Path, summary: dict[str, Any], args: Any, complete: bool) -> None:
    summary = {**summary, "complete": complete, "seed": args.seed, "workers": args.workers}
    (out / "sweep-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    listed = args.every_bit or args.leaf_headers
    sampled = "" if listed else f" --positions {args.positions} --seed {args.seed}"
    command = (
        f".venv/bin/python tools/damage/sweep.py{sampled} --workers {args.workers}"
        + "".join(f" --every-bit {span}" for span in args.every_bit or ())
        + (" --leaf-headers" if args.leaf_headers else "")
        + ("" if args.again is None else f" --again {args.again}")
    )
    state = "" if complete else f" (stopped early: {summary['positions']} done)"
    head = (
        f"{command}{state}\n{summary['positions']} positions in {summary['seconds']} s, "
        f"store {summary['store_bytes']} bytes, sha256 {summary['store_sha256']}\n"
        + (f"{summary['replay']}\n" if summary.get("replay") else "")
        + "\n"
    )
    (out / "sweep-summary.txt").write_text(head + table(summary) + "\n")


def failed_positions(path: Path) -> list[tuple[int, int, str]]:
    """The positions of an earlier sweep that crashed, raised a foreign exception, gave a
    wrong value or were not repairable (the store is built the same every time)."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r.get("crashes") or r.get("foreign") or r.get("wrong") or not r.get("reusable"):
                out.append((r["pos"], r["bit"], r["kind"]))
    return out


def replay_check(again: Path, digest: str) -> str:
    """Whether ``--again`` damages the very file the earlier sweep did: one line saying so.
    (The earlier run's ``sweep-summary.json`` beside its positions has the store's hash;
    code that changed what a save writes builds another file, so its positions hit other bytes.)"""
    try:
        earlier = json.loads((again.parent / "sweep-summary.json").read_text())
    except (OSError, ValueError):
        earlier = {}
    was = earlier.get("store_sha256")
    if was is None:
        return f"replay of {again}: that run recorded no store hash (not comparable byte for byte)"
    if was != digest:
        return f"replay of {again}: NOT the same store (was {was}): positions hit other bytes"
    return f"replay of {again}: the same store, byte for byte"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "tools" / "damage" / "results")
    parser.add_argument(
        "--again",
        type=Path,
        default=None,
        help="a sweep-positions.jsonl.gz: run again only its positions that failed",
    )
    parser.add_argument(
        "--every-bit",
        action="append",
        metavar="START:END",
        help="flip every bit of these bytes of data.mdb instead (e.g. 16:160, a meta page's)",
    )
    parser.add_argument(
        "--leaf-headers",
        action="store_true",
        help="flip every bit of every leaf node's header (value size, flags, key size) instead",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.base)
    work = Path(tempfile.mkdtemp(prefix="kvstore-sweep-base-"))
    try:
        base = work / "store"
        build(base)
        todo = positions(base / "data.mdb", args.positions, args.seed)
        replay = ""
        if args.every_bit:
            todo = every_bit(base / "data.mdb", args.every_bit)
        if args.leaf_headers:
            todo = leaf_headers(base / "data.mdb")
        if args.again is not None:
            todo = failed_positions(args.again)
            replay = replay_check(args.again, store_digest(base))
            print(replay, file=sys.stderr)
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()

        args.out.mkdir(parents=True, exist_ok=True)

        def sink(result: dict[str, Any]) -> None:
            results.append(result)
            if len(results) % 500 == 0:
                print(f"{len(results)}/{len(todo)} positions", file=sys.stderr, flush=True)
                # A long run that is stopped still leaves what it measured.
                partial = summarise(results, time.perf_counter() - t0, base)
                partial["replay"] = replay
                write_summary(args.out, partial, args, complete=False)

        pool = Pool(base, args.workers)
        try:
            pool.run(todo, sink)
        finally:
            pool.close()
        summary = summarise(results, time.perf_counter() - t0, base)
        summary["replay"] = replay
        write_summary(args.out, summary, args, complete=True)
        with gzip.open(args.out / "sweep-positions.jsonl.gz", "wt") as f:
            for r in sorted(results, key=lambda r: (r["pos"], r["bit"])):
                f.write(json.dumps(r) + "\n")
        print(table(summary))
        bad = summary["total"]
        failed = any(bad.get(k) for k in ("wrong values", "foreign exceptions", "crashes"))
        return 1 if failed or bad.get("not repairable") else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
