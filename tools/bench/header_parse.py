"""What parsing a restore's record headers costs, uncached (the header-fast branch).

Saves 4096 tokens of a llama-8B-shaped cache (32 layers, 8 KV heads of 128) into a
fresh LMDB store under a storage policy, reads the 16 records' headers back, and
times :func:`kvstore.codecs.record.read_header` over all 16, each repetition after
:func:`kvstore.codecs.record.forget_parsed_headers` (so every repetition is a first
restore: no header parse nor tensor table remembered). Prints the best repetition.

    .venv/bin/python -m tools.bench.header_parse [--policy kv:quant:8:64] [--repetitions 100]

On a noisy host, run it a few times (and the code before a change alternately with
it) and compare the smallest figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from kvstore.bench.workloads import KVShape, SyntheticKV
from kvstore.codecs import record
from kvstore.store import open_store

TOKENS = 4096


def headers(policy: str | None) -> list[bytes]:
    """The prefix and header bytes of each record of a 4096-token save."""
    kv = SyntheticKV(KVShape("llama8b", layers=32, kv_heads=8, head_dim=128), TOKENS)
    url = f"lmdb://{tempfile.mkdtemp()}/s"
    options = {} if policy is None else {"storage_policy": policy}
    with open_store(url, map_size=1 << 34, touch_interval=0, **options) as store:
        store.save("ns", list(range(TOKENS)), kv.ours())
        store.flush()
    store = open_store(url, readonly=True)
    match = store.lookup("ns", list(range(TOKENS + 1)))
    with store.read_checking(list(match.blocks)) as views:
        return [bytes(view[: 20 + int.from_bytes(bytes(view[8:12]), "little")]) for view in views]


def best_parse_ms(raw: list[bytes], repetitions: int) -> float:
    best = float("inf")
    for _ in range(repetitions):
        record.forget_parsed_headers()
        start = time.perf_counter()
        for header in raw:
            record.read_header(header)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None, help="a storage policy (default: lossless)")
    parser.add_argument("--repetitions", type=int, default=100)
    args = parser.parse_args(argv)
    raw = headers(args.policy)
    ms = best_parse_ms(raw, args.repetitions)
    print(
        f"{args.policy or 'lossless'}: uncached parse of {len(raw)} headers "
        f"({len(raw[0])} bytes each), best of {args.repetitions}: {ms:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
