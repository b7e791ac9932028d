"""converted_by_block: a lossy restore's layers decoded on the host a block at a time,
every layer of a kind in one conversion, each layer's rows the same bits as converted
alone; and what it does not stack (layers unlike the rest) left as it was,
for the caller to convert one by one."""

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.codec import Snapshot
from kvstore.caches import MXFP4KVCache, QuantizedKVCache, TurboQuantKVCache
from kvstore.codecs import host_stacks, snapshot, transcode
from kvstore.codecs.arrays import as_numpy_all
from kvstore.codecs.host_stacks import converted_by_block, packed
from kvstore.testing.codec import fill_cache

BLOCK = 16

FAMILIES = {
    "kv:quant:8:64": lambda: QuantizedKVCache(64, 8),
    "kv:quant:4:32": lambda: QuantizedKVCache(32, 4),
    "kv:mxfp4": MXFP4KVCache,
    "kv:turboquant:4:4": lambda: TurboQuantKVCache(4, 4),
}


def on_host(snap: Snapshot) -> Snapshot:
    """``snap`` with numpy tensors, as a restore reads them out of a record."""
    names = list(snap.tensors)
    views = as_numpy_all([snap.tensors[n] for n in names])
    return Snapshot(snap.signature, snap.start, snap.stop, dict(zip(names, views)), snap.meta)


def layer_blocks(make, seed: int, tokens: int = 3 * BLOCK + 5) -> list[Snapshot]:
    """One layer's snapshot of each block (the last one short), on the host."""
    cache = make()
    fill_cache(cache, [tokens], seed=seed, dtype=mx.bfloat16)
    starts = range(0, tokens, BLOCK)
    return [on_host(snapshot(cache, s, min(s + BLOCK, tokens))) for s in starts]


def assert_as_alone(got: list[Snapshot], stored: list[Snapshot]) -> None:
    for snap, original in zip(got, stored, strict=True):
        alone = transcode(original, "kv:plain")
        assert (snap.signature, snap.start, snap.stop, snap.meta) == (
            alone.signature,
            alone.start,
            alone.stop,
            alone.meta,
        )
        assert snap.tensors.keys() == alone.tensors.keys()
        for name, array in alone.tensors.items():
            assert snap.tensors[name].shape == array.shape, name
            assert snap.tensors[name].dtype == array.dtype, name
            assert mx.array_equal(snap.tensors[name], array).item(), name


def counted(monkeypatch) -> list[int]:
    """How many snapshots each stacked conversion took, in order."""
    calls: list[int] = []
    real = host_stacks.transcode_stacked

    def counting(snaps, *args, **kwargs):
        calls.append(len(snaps))
        return real(snaps, *args, **kwargs)

    monkeypatch.setattr(host_stacks, "transcode_stacked", counting)
    return calls


@pytest.mark.parametrize("signature", ["kv:quant:8:64", "kv:quant:4:32", "kv:mxfp4"])
def test_a_blocks_layers_decode_together_bit_for_bit_as_alone(signature, monkeypatch):
    calls = counted(monkeypatch)
    stored = [layer_blocks(FAMILIES[signature], seed) for seed in range(3)]
    assert stored[0][0].signature == signature and packed(signature)
    layers = [list(blocks) for blocks in stored]
    left = converted_by_block(layers, lambda i: "kv:plain", [0, 1, 2])
    assert left == []
    for got, original in zip(layers, stored, strict=True):
        assert_as_alone(got, original)
    assert calls == [3, 3, 3, 3]  # one conversion per block, of its three layers


@pytest.mark.parametrize("streams", ["1", "2"])
def test_turboquant_layers_stack_too_bit_for_bit(monkeypatch, streams):
    # Not spread over streams (packed is False): its decode spreads its own waves.
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", streams)
    assert not packed("kv:turboquant:4:4") and not packed("kv:plain")
    calls = counted(monkeypatch)
    stored = [layer_blocks(FAMILIES["kv:turboquant:4:4"], seed) for seed in range(2)]
    layers = [list(blocks) for blocks in stored]
    assert converted_by_block(layers, lambda i: "kv:plain", [0, 1]) == []
    for got, original in zip(layers, stored, strict=True):
        assert_as_alone(got, original)
    assert calls == [2, 2, 2, 2]


def test_each_kind_of_layer_stacks_apart_and_a_lone_or_unlike_layer_is_left(monkeypatch):
    q8 = [layer_blocks(FAMILIES["kv:quant:8:64"], seed) for seed in range(3)]
    q4 = [layer_blocks(FAMILIES["kv:quant:4:32"], seed) for seed in range(2)]
    lone = layer_blocks(FAMILIES["kv:mxfp4"], 9)
    # Another head count: stored in q8 like the others, but not stackable with them.
    wide = layer_blocks(lambda: QuantizedKVCache(64, 8), 7)
    wide = [
        Snapshot(s.signature, s.start, s.stop, {n: np.concatenate([a, a], 1) for n, a in t}, s.meta)
        for s, t in ((s, s.tensors.items()) for s in wide)
    ]
    stored = [q8[0], q4[0], q8[1], lone, q4[1], q8[2]]
    layers = [list(blocks) for blocks in stored]
    assert converted_by_block(layers, lambda i: "kv:plain", [0, 1, 2, 3, 4, 5]) == [3]
    assert all(a is b for a, b in zip(layers[3], lone, strict=True))  # left as it was
    for i in (0, 1, 2, 4, 5):
        assert_as_alone(layers[i], stored[i])
    unlike = [list(q8[0]), list(wide)]
    assert converted_by_block(unlike, lambda i: "kv:plain", [0, 1]) == [0, 1]
    # A tensor more in one layer's snapshots: not stacked (nothing of it dropped).
    extra = [
        Snapshot(s.signature, s.start, s.stop, {**s.tensors, "more": s.tensors["keys.q"]}, s.meta)
        for s in q8[1]
    ]
    unlike = [list(q8[0]), extra]
    assert converted_by_block(unlike, lambda i: "kv:plain", [0, 1]) == [0, 1]


def test_a_block_over_the_vector_bound_is_decoded_in_runs(monkeypatch):
    # 5 layers of 2 heads x 16 rows (32 vectors each), two a run: runs of 2, 2 and a
    # last layer alone; the last block's 5 rows (10 vectors a layer) in one run.
    monkeypatch.setattr(host_stacks, "MAX_VECTORS", 64)
    calls = counted(monkeypatch)
    stored = [layer_blocks(FAMILIES["kv:quant:8:64"], seed) for seed in range(5)]
    layers = [list(blocks) for blocks in stored]
    assert converted_by_block(layers, lambda i: "kv:plain", range(5)) == []
    for got, original in zip(layers, stored, strict=True):
        assert_as_alone(got, original)
    assert calls == [2, 2] * 3 + [5]
