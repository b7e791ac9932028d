"""A P8 worker process (:mod:`kvstore.bench.figures.concurrent`): restores on cue.

    python -m kvstore.bench.figures.concurrent_worker URL WORKLOAD TOKENS BLOCK RESTORES

Opens the store, restores the workload's prompt once (warm), prints
``READY``, waits for a line on stdin, restores ``RESTORES`` times, prints
``DONE``. Not imported by the figure table, so ``-m`` runs it only once.
"""

from __future__ import annotations

import sys

from kvstore.bench.figures.store_cases import NS, fresh_caches, prompt_tokens
from kvstore.bench.workloads import synthetic_kv

__all__ = ["worker"]


def worker(url: str, workload: str, tokens: str, block_size: str, restores: str) -> None:
    """Open the store, restore once, say READY, wait for a line, restore ``restores`` times."""
    from kvstore.store import open_store

    kv = synthetic_kv(workload, int(tokens))
    prompt = prompt_tokens(kv)
    with open_store(url, block_size=int(block_size), touch_interval=0) as store:

        def restore() -> None:
            restored = store.restore(store.lookup(NS, prompt), fresh_caches(kv))
            if restored[0].offset != kv.tokens:
                raise AssertionError("[bench] a P8 worker restored less than stored")

        restore()
        print("READY", flush=True)
        sys.stdin.readline()
        for _ in range(int(restores)):
            restore()
    print("DONE", flush=True)


if __name__ == "__main__":
    worker(*sys.argv[1:])
