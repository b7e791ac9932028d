"""What bounds a restore from a local ``redis-server`` (P9): the server, the socket, or us.

    .venv/bin/python -m tools.bench.redis_transfer [--values 8] [--mib 32] [--repetitions 7]

Starts a ``redis-server`` (:class:`kvstore.testing.redis_servers.RedisServer`), stores
``--values`` values of ``--mib`` MiB, and times fetching all of them:

* ``fresh pages``: redis-py (hiredis) in one pipelined batch, in a child process whose
  allocator is left as it is, so every reply's block is mapped and faulted in afresh
  (what every Redis read did before ``b0938bf``);
* ``kept heap``: the same batch after :func:`~kvstore.codecs.host_memory.keep_freed_memory`
  (what a read does now);
* ``N connections``: the values split over N pooled connections read in N threads;
* ``socket pair``: the same bytes sent by a second process over a loopback TCP socket
  and received into one reused buffer: what the kernel alone carries.

On the CI VM (thirtieth session) 256 MiB took ~380 ms with fresh pages, ~210 kept, about
the same over 2-8 connections, and ~80-130 ms over the socket pair: redis-server 7.0
writes a client at most 64 KiB per turn of its event loop (``NET_MAX_WRITES_PER_EVENT``).
Prints the median of each in ms and GB/s.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_CHILD = """
import sys, time, redis
port, count, repetitions = map(int, sys.argv[1:])
client = redis.Redis(port=port)
keys = [f"v{i}" for i in range(count)]
times = []
for _ in range(repetitions):
    start = time.perf_counter()
    batch = client.pipeline(transaction=False)
    for key in keys:
        batch.get(key)
    batch.execute()
    times.append(time.perf_counter() - start)
print(sorted(times)[len(times) // 2])
"""


def timed(fn: Callable[[], object], repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def socket_pair(nbytes: int, chunk: bytes, repetitions: int) -> float:
    """Seconds to receive ``nbytes`` sent by another process over loopback TCP."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sender = os.fork()
    if sender == 0:  # the child sends ``nbytes`` each time it is asked
        conn, _ = listener.accept()
        for _ in range(repetitions):
            conn.recv(1)
            for _ in range(nbytes // len(chunk)):
                conn.sendall(chunk)
        os._exit(0)
    listener.close()
    buf = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as conn:

        def receive() -> None:
            conn.send(b"x")
            got = 0
            while got < nbytes:
                got += conn.recv_into(buf[got:])

        seconds = timed(receive, repetitions)
    os.waitpid(sender, 0)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args()

    import redis

    from kvstore.codecs.host_memory import keep_freed_memory
    from kvstore.testing.redis_servers import RedisServer

    nbytes = args.values * (args.mib << 20)
    value = os.urandom(args.mib << 20)
    keys = [f"v{i}" for i in range(args.values)]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root, RedisServer(Path(root)) as server:
        client = redis.Redis(port=server.port, max_connections=16)
        for key in keys:
            client.set(key, value)
        counts = [str(server.port), str(args.values), str(args.repetitions)]
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, *counts],
            capture_output=True,
            text=True,
            check=True,
        )
        results["fresh pages"] = float(child.stdout)
        keep_freed_memory()

        def fetch(part: list[str]) -> None:
            batch = client.pipeline(transaction=False)
            for key in part:
                batch.get(key)
            batch.execute()

        results["kept heap"] = timed(lambda: fetch(keys), args.repetitions)
        for n in (2, 4, 8):
            parts = [keys[i::n] for i in range(n)]
            with ThreadPoolExecutor(n) as pool:
                results[f"{n} connections"] = timed(
                    lambda: list(pool.map(fetch, parts)),  # noqa: B023
                    args.repetitions,
                )
    results["socket pair"] = socket_pair(nbytes, value, args.repetitions)
    print(f"{nbytes >> 20} MiB in {args.values} values, median of {args.repetitions}:")
    for name, seconds in results.items():
        print(f"  {name:<14} {seconds * 1e3:8.1f} ms  {nbytes / seconds / 1e9:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
