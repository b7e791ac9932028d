"""The other process of the plug-in tests: ``python -m tests.test_plugin.worker MODE ARGS``.

It knows the ``kv:fp8`` family only through ``PYTHONPATH`` (the plug-in's
directory and its entry points); it never imports the plug-in by name.
Prints one JSON document.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from kvstore.abc.cache import signature_string
from kvstore.bridge.namespace import namespace_for_model
from kvstore.codecs.arrays import as_numpy
from kvstore.model import CachePolicy
from kvstore.store import open_store
from tests.test_store.kv_helpers import assert_same_caches, model_for, token_by_token

BLOCK = 16
FAMILY = "kv:fp8"


def fp8_policy() -> CachePolicy:
    """The cache policy of the plug-in's family (valid once the family is found)."""
    return CachePolicy(family=FAMILY)


def digests(caches: list[Any]) -> list[str]:
    """One sha256 per layer over the rows it will still attend to, in order."""
    from kvstore.codecs import snapshot_held

    out = []
    for cache in caches:
        h = hashlib.sha256(signature_string(cache).encode())
        for snap in snapshot_held(cache):
            h.update(f"{snap.start}:{snap.stop}".encode())
            for name in sorted(snap.tensors):
                h.update(name.encode() + as_numpy(snap.tensors[name]).tobytes())
        out.append(h.hexdigest())
    return out


def restore(url: str, config: str, tokens: str) -> None:
    """Look up and restore ``tokens`` into fresh ``kv:fp8`` caches; check them against
    this process's own computation; report what was restored."""
    model = model_for(config)
    ids = json.loads(tokens)
    with open_store(url, block_size=BLOCK) as store:
        restored = store.restore(
            store.lookup(namespace_for_model(model), ids), model.make_cache(fp8_policy())
        )
    n = int(restored[0].offset)
    if n:
        assert_same_caches(restored, token_by_token(model, ids[:n], fp8_policy()))
    report = {
        "restored": n,
        "signatures": [signature_string(c) for c in restored],
        "digests": digests(restored),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"restore": restore}[mode](*args)
