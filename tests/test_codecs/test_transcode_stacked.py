"""transcode_stacked: the layers of a lossy restore converted in one go, each layer's
rows the same bits as converted alone; and where they cannot be stacked, nothing
converted (``None``), so the caller converts them one by one."""

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.codec import Snapshot
from kvstore.caches import QuantizedKVCache, TurboQuantKVCache
from kvstore.codecs import snapshot, transcode, transcode_stacked
from kvstore.testing.codec import fill_cache


def layers_of(make, count=3, tokens=37):
    """``count`` snapshots of one family and range, each of other rows."""
    out = []
    for seed in range(count):
        cache = make()
        fill_cache(cache, [tokens], seed=seed, dtype=mx.bfloat16)
        out.append(snapshot(cache))
    return out


FAMILIES = {
    "kv:quant:8:64": lambda: QuantizedKVCache(64, 8),
    "kv:quant:4:32": lambda: QuantizedKVCache(32, 4),
    "kv:turboquant:4:4": lambda: TurboQuantKVCache(4, 4),
    "kv:turboquant:3:3": lambda: TurboQuantKVCache(3, 3),
}


@pytest.mark.parametrize("signature", FAMILIES)
def test_stacked_layers_come_out_bit_for_bit_as_converted_alone(signature):
    snaps = layers_of(FAMILIES[signature])
    assert snaps[0].signature == signature
    stacked = transcode_stacked(snaps, "kv:plain")
    assert stacked is not None and len(stacked) == len(snaps)
    for alone, together in zip((transcode(s, "kv:plain") for s in snaps), stacked, strict=True):
        assert (together.signature, together.start, together.stop) == (
            alone.signature,
            alone.start,
            alone.stop,
        )
        assert together.meta == alone.meta
        assert together.tensors.keys() == alone.tensors.keys()
        for name, array in alone.tensors.items():
            got = together.tensors[name]
            assert got.shape == array.shape and got.dtype == array.dtype
            assert mx.array_equal(got, array).item(), name


def changed(snap, **what):
    fields = {
        "signature": snap.signature,
        "start": snap.start,
        "stop": snap.stop,
        "tensors": dict(snap.tensors),
        "meta": dict(snap.meta),
    }
    fields.update(what)
    return Snapshot(**fields)


def test_layers_that_do_not_stack_are_left_to_convert_one_by_one():
    a, b = layers_of(FAMILIES["kv:quant:8:64"], count=2)
    name = next(iter(a.tensors))
    cases = {
        "one layer": [a],
        "another range": [a, changed(b, start=1, stop=b.stop + 1)],
        "other meta": [a, changed(b, meta={**b.meta, "dtype": "float16"})],
        "an array in the meta": [changed(a, meta={**a.meta, "x": mx.ones(2)}), b],
        "other tensors": [a, changed(b, tensors={k: v for k, v in b.tensors.items() if k != name})],
        "another shape": [a, changed(b, tensors={**b.tensors, name: b.tensors[name][:, :1]})],
        "host arrays": [
            a,
            changed(b, tensors={k: np.array(v.astype(mx.float32)) for k, v in b.tensors.items()}),
        ],
        "a tensor not of rows": [
            changed(s, tensors={**s.tensors, "table": mx.zeros((4, 4))}) for s in (a, b)
        ],
    }
    for why, snaps in cases.items():
        assert transcode_stacked(snaps, "kv:plain") is None, why


@pytest.mark.parametrize("signature", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_tensors_given_stacked_are_decoded_as_they_are_and_others_concatenated(signature):
    snaps = layers_of(FAMILIES[signature])
    name, other = list(snaps[0].tensors)[:2]
    ready = {
        name: mx.concatenate([s.tensors[name] for s in snaps]),
        other: mx.zeros((1,)),  # not the stack's shape: concatenated instead
    }
    given = transcode_stacked(snaps, "kv:plain", ready)
    plain = transcode_stacked(snaps, "kv:plain")
    assert given is not None and plain is not None
    for a, b in zip(given, plain, strict=True):
        for key, array in b.tensors.items():
            assert mx.array_equal(a.tensors[key], array).item(), key
