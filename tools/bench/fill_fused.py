"""What a CPU restore's copies and checksums cost, ordered four ways (P1's next step).

A restore copies every record's rows out of the store's map into the caches' arrays
and hashes every record's payload. Today the copies go array by array on the copy
threads while other threads hash whole records, so each byte is read from memory
twice. This probe times, on a file mapped as LMDB maps its own (page cache, read
only) and arrays from the kept heap, for a llama-8B-shaped KV of ``--tokens``:

* the copies alone, array by array (each array's block from every record) and
  record by record (each record's tensors into every array), on ``--threads``;
* each of those with the records hashed on one more thread (xxh3-64, as the checks);
* the hash alone;
* copy and hash fused, record by record: each tensor copied and then hashed while it
  is still in the cache.

Nothing in the library is used except its glibc setting (``keep_freed_memory``)::

    .venv/bin/python tools/bench/fill_fused.py --tokens 2048
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvstore.codecs.host_memory import keep_freed_memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block", type=int, default=256, help="tokens a record holds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    keep_freed_memory()
    heads, dim, block = 8, 128, args.block
    records, tensors = args.tokens // block, 2 * args.layers
    tensor_bytes = heads * block * dim * 2
    record_bytes = tensors * tensor_bytes
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "values")
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(records):
                f.write(rng.integers(0, 255, record_bytes, dtype=np.uint8).tobytes())
        fd = os.open(path, os.O_RDONLY)
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        src = np.frombuffer(mapped, np.uint8)
        arrays = [np.zeros((heads, args.tokens, dim), np.uint16) for _ in range(tensors)]

        def part(r: int, t: int) -> np.ndarray:
            start = r * record_bytes + t * tensor_bytes
            return src[start : start + tensor_bytes].view(np.uint16).reshape(heads, block, dim)

        def rows(r: int, t: int) -> np.ndarray:
            return arrays[t][:, r * block : (r + 1) * block, :]

        def by_array(t: int) -> None:
            for r in range(records):
                np.copyto(rows(r, t), part(r, t))

        def by_record(r: int) -> None:
            for t in range(tensors):
                np.copyto(rows(r, t), part(r, t))

        def hash_all() -> list[int]:
            return [
                xxhash.xxh3_64_intdigest(src[r * record_bytes : (r + 1) * record_bytes])
                for r in range(records)
            ]

        def fused(r: int) -> int:
            hasher = xxhash.xxh3_64()
            for t in range(tensors):
                source = part(r, t)
                np.copyto(rows(r, t), source)
                hasher.update(source)
            return hasher.intdigest()

        copies = ThreadPoolExecutor(args.threads)
        checks = ThreadPoolExecutor(1)
        want = hash_all()

        def with_checks(copy: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                pending = checks.submit(hash_all)
                copy()
                assert pending.result() == want

            return run

        def arraywise() -> None:
            list(copies.map(by_array, range(tensors)))

        def recordwise() -> None:
            list(copies.map(by_record, range(records)))

        def fusedwise() -> None:
            assert list(copies.map(fused, range(records))) == want

        cases: dict[str, Callable[[], object]] = {
            "copies, array by array": arraywise,
            "copies, record by record": recordwise,
            "copies array by array + hash beside": with_checks(arraywise),
            "copies record by record + hash beside": with_checks(recordwise),
            "hash alone, one thread": hash_all,
            "copy and hash fused, record by record": fusedwise,
        }
        mib = records * record_bytes / 2**20
        print(
            f"{records} records of {record_bytes >> 20} MiB ({mib:.0f} MiB), {args.threads} threads"
        )
        for label, fn in cases.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - start))
            print(
                f"  {label:<40} {statistics.median(times):7.1f} ms "
                f"[{min(times):.1f}-{max(times):.1f}]"
            )
        copies.shutdown()
        checks.shutdown()
        os.close(fd)  # the mapping goes with the process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
