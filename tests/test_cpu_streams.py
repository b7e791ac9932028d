"""One thread's MLX CPU work spread over its CPU streams (kvstore.cpu_streams)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from kvstore.cpu_streams import cpu_streams, evaluated_in_waves, spread, stream_count


def _stream_of_each(items: list[int]) -> tuple[list[mx.array], list[mx.Stream]]:
    seen: list[mx.Stream] = []

    def build(i: int) -> mx.array:
        seen.append(mx.default_stream(mx.cpu))  # the stream evaluated_in_waves set
        return mx.arange(i, i + 4) * 2

    return evaluated_in_waves(items, build), seen


def test_items_go_to_the_threads_cpu_streams_in_turn(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "3")
    streams = cpu_streams()
    assert len(streams) == 3 and streams[0] == mx.default_stream(mx.cpu)
    assert len({repr(s) for s in streams}) == 3
    results, seen = _stream_of_each(list(range(7)))
    assert [repr(s) for s in seen] == [repr(streams[i % 3]) for i in range(7)]
    assert [r.tolist() for r in results] == [[2 * (i + j) for j in range(4)] for i in range(7)]
    assert cpu_streams() == streams  # kept, not made again


def test_one_stream_or_one_item_stays_on_the_default_stream(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "1")
    _, seen = _stream_of_each([0, 1, 2])
    assert {repr(s) for s in seen} == {repr(mx.default_stream(mx.cpu))}
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "4")
    _, seen = _stream_of_each([5])
    assert [repr(s) for s in seen] == [repr(mx.default_stream(mx.cpu))]


def test_spread_builds_item_i_on_stream_i_modulo_their_count(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "3")
    streams = cpu_streams()
    seen, built = [], []
    for i in range(5):
        with spread(i):
            seen.append(repr(mx.default_stream(mx.cpu)))
            built.append(
                mx.quantize(mx.arange(64 * (i + 1), dtype=mx.float32).reshape(-1, 64), 64, 8)
            )
    assert seen == [repr(streams[i % 3]) for i in range(5)]
    assert repr(mx.default_stream(mx.cpu)) == repr(streams[0])  # restored after each
    mx.eval(built)  # one evaluation runs them all, each on its stream's thread
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "1")
    for i in range(5):
        assert [np.array(a).tobytes() for a in built[i]] == [
            np.array(a).tobytes()
            for a in mx.quantize(mx.arange(64 * (i + 1), dtype=mx.float32).reshape(-1, 64), 64, 8)
        ]
        with spread(i):  # one stream: the default one
            assert repr(mx.default_stream(mx.cpu)) == repr(streams[0])


def test_waves_inside_a_spread_still_use_every_stream(monkeypatch):
    # Inside spread(1) MLX's default stream is the first extra one; waves built there
    # (a TurboQuant decode) must not put two items on it.
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "2")
    streams = cpu_streams()
    with spread(1):
        assert cpu_streams() == streams
        _, seen = _stream_of_each([0, 1])
    assert [repr(s) for s in seen] == [repr(s) for s in streams]


def test_a_bad_stream_count_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "0")
    with pytest.raises(
        ValueError, match=r"KVSTORE_CPU_STREAMS='0': expected a positive number of streams"
    ):
        stream_count()


def test_each_thread_spreads_over_streams_of_its_own(monkeypatch):
    # MLX streams belong to the thread that made them: another thread's would raise
    # "There is no Stream(cpu, N) in current thread".
    monkeypatch.setenv("KVSTORE_CPU_STREAMS", "2")
    mine = {repr(s) for s in cpu_streams()}
    out: dict[str, object] = {}

    def work() -> None:
        try:
            results, seen = _stream_of_each([0, 1, 2, 3])
            out["streams"] = {repr(s) for s in seen}
            out["values"] = [r.tolist() for r in results]
        except Exception as e:  # reported below
            out["error"] = e

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "error" not in out, out.get("error")
    assert len(out["streams"]) == 2 and not (out["streams"] & mine)
    assert out["values"] == [[2 * (i + j) for j in range(4)] for i in range(4)]


@pytest.mark.parametrize("bits", [2, 4])
def test_turboquant_over_many_blocks_is_the_same_on_any_stream_count(monkeypatch, bits):
    # 3 x 4096 rows and a part: blocks of a wave run at once on different streams.
    from kvstore.turboquant.quantizer import BLOCK_VALUES, quantizer_for

    rows = 3 * BLOCK_VALUES // 128 + 123
    x = mx.random.normal((1, 1, rows, 128), key=mx.random.key(bits)).astype(mx.bfloat16)
    q = quantizer_for(bits, 128, "v")
    got = {}
    for count in ("1", "2", "3"):
        monkeypatch.setenv("KVSTORE_CPU_STREAMS", count)
        codes, scales = q.encode(x)
        decoded = q.decode(codes, scales, mx.bfloat16)
        got[count] = [np.array(a).tobytes() for a in (codes, scales, decoded.view(mx.uint16))]
    assert got["1"] == got["2"] == got["3"]
    # And row-wise: the last rows alone encode to the same codes.
    tail_codes, _ = q.encode(x[:, :, -123:])
    assert np.array_equal(np.array(tail_codes), np.array(q.encode(x)[0][:, :, -123:]))


def test_turboquant_encodes_on_two_threads_at_once_match_one_thread():
    # Each thread builds on its own streams; the compiled block functions are shared.
    from kvstore.turboquant.quantizer import encode_many, quantizer_for

    kq, vq = quantizer_for(4, 128, "k"), quantizer_for(3, 128, "v")
    inputs = [mx.random.normal((1, 4, 600 + 7 * i, 128), key=mx.random.key(i)) for i in range(4)]
    mx.eval(inputs)

    def encode(x: mx.array) -> list[bytes]:
        out = encode_many([(kq, x, None), (vq, x * 2, None)])
        decoded = vq.decode(*out[1], mx.float32)
        return [np.array(a).tobytes() for pair in out for a in pair] + [np.array(decoded).tobytes()]

    alone = [encode(x) for x in inputs]
    got: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = encode(inputs[i])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(4)] == alone
