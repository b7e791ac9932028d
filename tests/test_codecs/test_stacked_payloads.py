"""A run of records cut alike gets its payloads in a few kernels: the bytes are those
``device_payload`` makes record by record, padding included; what is not such a run
is left to it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.codec import Snapshot
from kvstore.codecs.record import device_payload, plan_record
from kvstore.codecs.stacked_payloads import stacked_payloads

BLOCK = 16


def wholes(rows=64, seed=0):
    """Two layers' whole-range tensors: bf16 keys/values, and a side tensor whose rows
    are 10 bytes (its pieces need padding to the next 64-byte boundary)."""
    mx.random.seed(seed)
    out = []
    for _ in range(2):
        keys = mx.random.normal((1, 2, rows, 8)).astype(mx.bfloat16)
        side = mx.random.randint(0, 255, (1, 1, rows, 10)).astype(mx.uint8)
        mx.eval(keys, side)
        out.append({"keys": keys, "values": keys * 3, "side": side})
    return out


def cut_plans(layers, starts, stop_of=lambda s: s + BLOCK):
    """Each block's plan (lent as a save's are) and the cut map ``id -> (tensor, whole,
    a, b)``."""
    cuts = {}
    plans = []
    for start in starts:
        stop = stop_of(start)
        snaps = []
        for tensors in layers:
            pieces = {}
            for name, whole in tensors.items():
                piece = whole[:, :, start:stop]
                cuts[id(piece)] = (piece, whole, start, stop)
                pieces[name] = piece
            snaps.append(Snapshot("kv:plain", start, stop, pieces, {}))
        plans.append(plan_record(snaps, like=plans[-1] if plans else None))
    return plans, cuts


def of(cuts):
    def cut_of(tensor):
        found = cuts.get(id(tensor))
        return None if found is None or found[0] is not tensor else found[1:]

    return cut_of


def as_bytes(array):
    return np.array(array.reshape(-1).view(mx.uint8)).tobytes()


def test_a_run_of_blocks_gets_the_bytes_device_payload_makes_padding_included():
    plans, cuts = cut_plans(wholes(), [0, 16, 32])
    assert any(offset % 64 == 0 and offset for _, offset in plans[0].tensors)
    payloads = stacked_payloads(plans, of(cuts))
    assert all(p is not None for p in payloads)
    assert [as_bytes(p) for p in payloads] == [as_bytes(device_payload(p)) for p in plans]


def test_a_shorter_tail_and_a_lone_block_are_left_to_device_payload():
    layers = wholes()
    stops = {0: 16, 16: 32, 32: 40}  # the tail: 8 rows
    plans, cuts = cut_plans(layers, [0, 16, 32], stop_of=stops.__getitem__)
    payloads = stacked_payloads(plans, of(cuts))
    assert [p is None for p in payloads] == [False, False, True]
    assert [as_bytes(p) for p in payloads[:2]] == [as_bytes(device_payload(p)) for p in plans[:2]]
    lone, lone_cuts = cut_plans(layers, [0])
    assert stacked_payloads(lone, of(lone_cuts)) == [None]


def test_a_block_cut_from_other_tensors_or_out_of_order_starts_a_new_run():
    layers, others = wholes(), wholes(seed=1)
    first, cuts = cut_plans(layers, [0, 16])
    second, more = cut_plans(others, [32, 48])  # another save's tensors
    skipped, far = cut_plans(layers, [48])  # a gap after block 16
    plans = [*first, *second, *skipped]
    payloads = stacked_payloads(plans, of({**cuts, **more, **far}))
    assert [p is None for p in payloads] == [False, False, False, False, True]
    assert [as_bytes(p) for p in payloads[:4]] == [as_bytes(device_payload(p)) for p in plans[:4]]


@pytest.mark.parametrize("missing", ["unknown", "not mlx"])
def test_a_record_with_a_tensor_not_known_as_a_cut_is_left_alone(missing):
    plans, cuts = cut_plans(wholes(), [0, 16, 32])
    tensor, _ = plans[1].tensors[2]
    if missing == "unknown":
        del cuts[id(tensor)]
    else:
        cuts[id(tensor)] = (object(), *cuts[id(tensor)][1:])
    payloads = stacked_payloads(plans, of(cuts))
    assert [p is None for p in payloads] == [True, True, True]  # block 0's run ends at 1


def test_pieces_of_one_shape_back_to_back_are_copied_once_into_place():
    """A lossless model's keys and values: each whole tensor's rows copied straight into
    place (one copy, not two); the bytes are the same."""
    from kvstore.codecs import stacked_payloads as module

    layers = [{"keys": t["keys"], "values": t["values"]} for t in wholes()]
    plans, cuts = cut_plans(layers, [0, 16, 32])
    cut_list = [of(cuts)(tensor) for tensor, _ in plans[0].tensors]
    assert module._same_pieces(plans[0], cut_list) is not None
    payloads = stacked_payloads(plans, of(cuts))
    assert [as_bytes(p) for p in payloads] == [as_bytes(device_payload(p)) for p in plans]
    mixed, mixed_cuts = cut_plans(wholes(), [0, 16])  # a side tensor of another shape
    mixed_list = [of(mixed_cuts)(tensor) for tensor, _ in mixed[0].tensors]
    assert module._same_pieces(mixed[0], mixed_list) is None


def test_one_copy_only_stacks_the_runs_of_one_shape_and_leaves_the_rest():
    """``KVSTORE_CUDA_SAVE_PAYLOADS=auto``: a run whose pieces take two copies (a side
    tensor of another shape) is left to device_payload; a lossless run is stacked."""
    mixed, mixed_cuts = cut_plans(wholes(), [0, 16, 32])
    assert stacked_payloads(mixed, of(mixed_cuts), one_copy_only=True) == [None] * 3
    layers = [{"keys": t["keys"], "values": t["values"]} for t in wholes()]
    plans, cuts = cut_plans(layers, [0, 16, 32])
    payloads = stacked_payloads(plans, of(cuts), one_copy_only=True)
    assert [as_bytes(p) for p in payloads] == [as_bytes(device_payload(p)) for p in plans]


def test_a_run_stops_at_run_bytes_and_the_next_run_starts_there(monkeypatch):
    from kvstore.codecs import stacked_payloads as module

    plans, cuts = cut_plans(wholes(), [0, 16, 32, 48])
    runs = []
    real = module._stacked

    def spied(first, cut_list, count, **kw):
        runs.append(count)
        return real(first, cut_list, count, **kw)

    monkeypatch.setattr(module, "_stacked", spied)
    monkeypatch.setattr(module, "RUN_BYTES", 2 * plans[0].payload_nbytes)
    payloads = stacked_payloads(plans, of(cuts))
    assert runs == [2, 2]
    assert [as_bytes(p) for p in payloads] == [as_bytes(device_payload(p)) for p in plans]
    monkeypatch.setattr(module, "RUN_BYTES", plans[0].payload_nbytes)  # one a run: none
    assert stacked_payloads(plans, of(cuts)) == [None] * 4
