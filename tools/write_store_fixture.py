"""Write a prefix store as this checkout's kvstore lays it out, for a fixture of that layout.

Golden records (``tools/write_golden.py``) pin the record format; this pins the store's:
a store written by an earlier kvstore must open, look up and restore unchanged with a
later one (``tests/test_store/test_old_store.py``). It is run once, with the kvstore of
the revision whose layout it pins, and its output is committed compressed::

    git worktree add /tmp/old fd945d7      # from this checkout's root
    (cd /tmp/old && PYTHONPATH=. "$OLDPWD/.venv/bin/python" \\
        "$OLDPWD/tools/write_store_fixture.py" /tmp/store)
    xz -9e -c /tmp/store/data.mdb > tests/fixtures/stores/lmdb-fd945d7/data.mdb.xz

Only the API every kvstore since the first prefix store has is used here (``open_store``,
``save``, the plain cache), so an old checkout can run it. The caches' rows are
integers over 32, exact in float16 and bfloat16, so the test rebuilds the very caches
saved (:func:`fixture_caches`) without storing them beside the fixture; the rows
repeat, so the store compresses to a few KiB.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import mlx.core as mx
import numpy as np

#: The namespace every prompt is saved under.
NAMESPACE = "fixture"
BLOCK_SIZE = 64
#: Prompt A: two full blocks and a tail. B shares A's first block, then differs.
PROMPT_A = list(range(1000, 1150))
PROMPT_B = PROMPT_A[:BLOCK_SIZE] + list(range(2000, 2050))
#: (dtype, heads, head_dim) of each layer: a block's record is ~100 KiB.
LAYERS = [("bfloat16", 2, 128), ("float16", 2, 64), ("bfloat16", 4, 64)]


def rows(layer: int, which: int, tokens: list[int], heads: int, head_dim: int) -> np.ndarray:
    """Layer ``layer``'s keys (``which`` 0) or values (1) for ``tokens``: each row a
    function of its token alone, so a shared prefix has the same rows in every prompt."""
    t = np.asarray(tokens, np.int64)[None, None, :, None]
    h = np.arange(heads, dtype=np.int64)[None, :, None, None]
    d = np.arange(head_dim, dtype=np.int64)[None, None, None, :]
    code = (t * 7 + h * 131 + d * (3 + 2 * layer) + which * 59) % 241 - 120
    return (code / 32).astype(np.float32)


def fixture_caches(tokens: list[int]) -> list[Any]:
    """The plain caches of :data:`LAYERS` holding ``tokens``' rows (the ones saved)."""
    from kvstore.caches import KVCache

    caches = []
    for layer, (dtype, heads, head_dim) in enumerate(LAYERS):
        cache = KVCache()
        keys, values = (
            mx.array(rows(layer, which, tokens, heads, head_dim)).astype(getattr(mx, dtype))
            for which in (0, 1)
        )
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the store to write (must not exist)")
    args = parser.parse_args()
    from kvstore.store import open_store

    with open_store(f"lmdb://{args.directory}", block_size=BLOCK_SIZE) as store:
        for tokens in (PROMPT_A, PROMPT_B):
            store.save(NAMESPACE, tokens, fixture_caches(tokens))
        print(store.stats(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
