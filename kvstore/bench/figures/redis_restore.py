"""P9: restore from a local ``redis-server`` against an LMDB restore of the same data.

Measured at the record-read level (the codec's decode is the same work for
both and is P1's business): for each workload shape, a 2048-token prompt of
checksummed records (8 blocks of 256 tokens, each ``256 x bytes-per-token``
of random bytes behind an xxh3-64 checksum) is saved into an LMDB store and
into a Redis store on a ``redis-server`` this figure starts on loopback in
the scratch directory (no persistence). Timed side by side, interleaved:

* ``redis``: ``lookup`` + ``read`` (every record fetched: one ``MGET`` of
  manifests, one pipelined batch of chunks) + the checksum of every record;
* ``lmdb``: the same calls on the LMDB store (zero-copy reads);
* ``redis GET only``: the same chunks fetched by one pipelined ``GET`` batch
  and nothing else -- the server and loopback transfer alone, so
  ``store overhead`` (its time over ``redis``) says how much of the Redis
  restore is ours rather than the server's and the socket's.

The bar (BENCHMARKS.md) is ``vs lmdb`` >= 0.25x. The row also records whether
redis-py parsed replies with hiredis (the ``redis`` extra installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import xxhash

from kvstore.bench.figures.common import MIB
from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import WORKLOADS
from kvstore.errors import CorruptEntryError

__all__ = ["FIGURE", "TOKENS", "SHAPES"]

TOKENS = 2048
#: The workload shapes P9 reads (a sliding window changes nothing at the record level).
SHAPES = ("qwen0.5b", "llama8b")
NS = "p9"
RATIOS = (
    Ratio("vs lmdb", "redis", "lmdb"),
    Ratio("store overhead", "redis", "redis GET only"),
)


def _checksummed(payload: bytes) -> bytes:
    return xxhash.xxh3_64_digest(payload) + payload


def _verify(view: memoryview) -> None:
    if xxhash.xxh3_64_digest(view[8:]) != view[:8]:
        raise CorruptEntryError("[bench] checksum mismatch")


def _restore_case(name: str, role: Any, store: Any, tokens: np.ndarray, nbytes: int) -> Case:
    def run() -> None:
        match = store.lookup(NS, tokens)
        with store.read(match.blocks) as views:
            got = sum(v.nbytes for v in views)
        if got != nbytes:
            raise AssertionError(f"[bench] {name} read {got} of {nbytes} bytes")

    return Case(name, role, run)


@contextmanager
def _stores(ctx: BenchContext, name: str, server_url: str) -> Iterator[tuple[Any, Any]]:
    from kvstore.store import open_store

    options = {"verify": _verify, "touch_interval": 0, "block_size": ctx.sizes.block_tokens}
    with ExitStack() as stack:
        lmdb = stack.enter_context(open_store(f"lmdb://{ctx.scratch / f'p9-{name}'}", **options))
        redis = stack.enter_context(
            open_store(f"{server_url}?key_prefix=p9-{name}/&socket_timeout=60", **options)
        )
        yield lmdb, redis
        redis.delete(NS)


def _records(size: int, count: int, rng: np.random.Generator) -> list[bytes]:
    return [_checksummed(rng.bytes(size)) for _ in range(count)]


def _fill(stores: tuple[Any, ...], tokens: np.ndarray, records: list[bytes]) -> int:
    """Save ``records`` as the blocks of ``tokens`` in every store; returns their bytes."""
    for store in stores:
        store.put_blocks(NS, tokens, lambda spans: records[: len(spans)])
    return sum(len(r) for r in records)


def measure(ctx: BenchContext, workload: str, server_url: str) -> Row:
    block = ctx.sizes.block_tokens
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 150_000, TOKENS + 1, dtype=np.uint32)
    with _stores(ctx, workload, server_url) as (lmdb, redis):
        records = _records(block * WORKLOADS[workload].bytes_per_token, TOKENS // block, rng)
        nbytes = _fill((lmdb, redis), tokens[:TOKENS], records)
        del records  # the stores hold them now
        backend = redis.backend
        keys = [b.key for b in redis.lookup(NS, tokens).blocks]
        manifests = [
            (k, backend.manifest(k, raw)) for k, raw in zip(keys, backend.raw_values(keys))
        ]

        def get_only() -> None:
            backend.payloads(manifests)

        cases = [
            _restore_case("redis", "ours", redis, tokens, nbytes),
            _restore_case("lmdb", "peer", lmdb, tokens, nbytes),
            Case("redis GET only", "limit", get_only),
        ]
        row = ctx.measure(
            f"{workload} {TOKENS}",
            {"workload": workload, "tokens": TOKENS, "mib": nbytes / MIB, "hiredis": _hiredis()},
            cases,
            RATIOS,
        )
    return row


def _hiredis() -> bool:
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def run(ctx: BenchContext) -> FigureResult:
    from kvstore.testing.redis_servers import RedisServer, redis_binaries

    if redis_binaries() is None:
        return FigureResult(pending="needs redis-server and redis-cli on PATH")
    try:
        import redis  # noqa: F401
    except ImportError:
        return FigureResult(pending="needs the redis extra: pip install 'mlx-kvstore[redis]'")
    shapes = [w for w in ctx.sizes.workloads if w in SHAPES] or [SHAPES[0]]
    with RedisServer(ctx.scratch / "p9-redis") as server:
        rows = [measure(ctx, w, server.url) for w in shapes]
    notes = [
        "record level: lookup + fetch + xxh3 of a 2048-token prefix; 'store overhead' near 1 "
        "means the server and loopback transfer, not kvstore, set the Redis time"
    ]
    return FigureResult(rows, notes=notes)


FIGURE = Figure(
    "P9",
    "restore throughput from a local redis-server (record level: lookup + fetch + checksum)",
    "LMDB restore of the same records (same calls, same checksum)",
    (at_least("vs lmdb", 0.25),),
    run,
)
