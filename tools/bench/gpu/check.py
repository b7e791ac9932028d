"""Before the GPU figures: the CUDA paths this checkout relies on, checked on the device.

    python3 tools/bench/gpu/check.py

Prints one line per check (staging round trip, a restore through staging equal
to its record, a save's records equal to encode_record's, the row-digest kernel
equal to xxhash, the model over quantized caches: prefill, then decode) and exits 1
if any fails, so run.sh stops before measuring a
path that is not the one meant. Falling back is not failing: a path that is off
says so (``staging False``) and the figures then measure the fallback.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np


def _bf16_caches(layers: int, rows: int) -> list[Any]:
    """``layers`` KVCaches of ``rows`` random bf16 rows, 8 heads of 128 (values = 2 x keys)."""
    from kvstore.caches import KVCache

    caches = []
    for layer in range(layers):
        cache = KVCache()
        keys = mx.random.normal((1, 8, rows, 128), key=mx.random.key(layer)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
    return caches


def _handed_off_records_ok(policy: str = "lossless") -> bool:
    """A save behind's records under ``policy``, 3 layers of 3 full blocks and a tail,
    8 MiB and more (the pool's and the stacked payloads' route), against encode_record."""
    from kvstore.abc.store import BlockSpan, PendingRecord
    from kvstore.codecs.record import encode_record
    from kvstore.store.kv.writer import HandedOff

    caches = _bf16_caches(3, 1100)
    encoder = HandedOff(caches, policy, {}, (0, 1100), 256)
    spans = [BlockSpan(i, a, min(1100, a + 256), b"") for i, a in enumerate(range(0, 1100, 256))]
    records = encoder(spans)
    got = [bytes(r.result() if isinstance(r, PendingRecord) else r) for r in records]
    return got == [encode_record(encoder.layers(s.start, s.stop)) for s in spans]


def main() -> int:
    from kvstore.bridge import digests
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for, cuda, cuda_pages
    from kvstore.codecs.arena import write_records
    from kvstore.codecs.record import encode_record, plan_record

    failed = 0
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    t = time.perf_counter()
    staging = cuda.available()
    print(f"staging {staging} ({(time.perf_counter() - t) * 1e3:.0f} ms to check)", flush=True)
    cache = KVCache()
    rows = mx.random.normal((1, 8, 700, 128)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows * 3)
    codec = codec_for(cache)
    layers = [[codec.snapshot(cache, s, min(700, s + 256))] for s in (0, 256, 512)]
    got = [bytes(r) for r in write_records([plan_record(layer) for layer in layers])]
    ok = got == [encode_record(layer) for layer in layers]
    failed += not ok
    print(f"records via the arena == encode_record: {ok}", flush=True)
    from kvstore.store.kv import save

    for payloads, policy in [
        ("auto", "lossless"),
        ("record", "lossless"),
        ("stacked", "lossless"),
    ]:
        save.SAVE_PAYLOADS, chosen = payloads, save.SAVE_PAYLOADS
        ok = _handed_off_records_ok(policy)
        save.SAVE_PAYLOADS = chosen
        failed += not ok
        print(
            f"a save behind's records (payloads {payloads}, {policy}) == encode_record: {ok}",
            flush=True,
        )
    specs = [((1, 8, 768, 128), "bfloat16"), ((3, 5), "float32"), ((1001,), "uint8")]
    from kvstore.codecs.fill import filled_arrays

    sizes = [int(np.prod(s)) * (2 if n == "bfloat16" else np.dtype(n).itemsize) for s, n in specs]
    # Finite float bit patterns (a NaN's bits need not survive a float view).
    want = [
        np.random.default_rng(i).integers(0, 64, n, dtype=np.uint8) for i, n in enumerate(sizes)
    ]

    def fill(i: int, view: np.ndarray) -> None:
        view.reshape(-1).view(np.uint8)[:] = want[i]

    arrays = filled_arrays(specs, fill)
    ok = all(
        np.array_equal(np.asarray(a.reshape(-1).view(mx.uint8)), w)
        for a, w in zip(arrays, want, strict=True)
    )
    failed += not ok
    print(f"filled arrays (staged: {staging}) bit-exact: {ok}", flush=True)
    if staging:
        ok = cuda_pages._works()
        failed += not ok
        print(f"rows gathered from registered host pages bit-exact: {ok}", flush=True)
        from kvstore.turboquant import cuda_decode

        proofs = {bits: cuda_decode._try(bits, 128, bits * 4) for bits in (2, 3, 4, 5)}
        print(f"TurboQuant decode kernel == MLX ops (bits: ok): {proofs}", flush=True)
    probe = mx.random.randint(0, 255, (3 * digests.ROW_BYTES + 777,), dtype=mx.uint8)
    mx.eval(probe)
    t = time.perf_counter()
    device = digests.array_digests([probe])
    elapsed = time.perf_counter() - t
    host = digests._host_digests([memoryview(np.asarray(probe))])
    ok = device == host
    failed += not ok
    kernel = digests._kernel() is not False
    print(f"row digests here == host: {ok} (kernel {kernel}, {elapsed * 1e3:.0f} ms)", flush=True)
    failed += not _store_round_trips()
    failed += not _quantized_attention_runs()
    return 1 if failed else 0


def _quantized_attention_runs() -> bool:
    """Per quantized layout of G5: a chunked prefill (the second chunk over cached rows,
    as the one MLX 0.32.4 had no kernel for) and decode steps, close to plain caches'
    logits. Also says whether MLX has a quantized_matmul kernel for that prefill here
    (KVSTORE_DEQUANTIZED_PREFILL=never): the model does not need one."""
    import os

    from kvstore.bench.figures.gpu_common import LLAMA8B
    from kvstore.model import CachePolicy, build_model
    from kvstore.model.attention import DEQUANTIZED_PREFILL

    args = dict(LLAMA8B, num_hidden_layers=2, vocab_size=1024)
    model = build_model(args, dtype=mx.bfloat16)
    tokens = mx.random.randint(0, 1024, (1, 304), key=mx.random.key(3))

    def logits(caches: list, chunks: tuple[int, ...] = (0, 200, 300)) -> mx.array:
        out = [model(tokens[:, b:e], cache=caches)[0, -1:] for b, e in zip(chunks, chunks[1:])]
        out += [model(tokens[:, i : i + 1], cache=caches)[0] for i in range(300, 304)]
        return mx.concatenate(out).astype(mx.float32)

    plain = logits(model.make_cache())
    ok = True
    for bits in (4, 8):
        policy = CachePolicy(kv_bits=bits, kv_group_size=64)
        try:
            got = logits(model.make_cache(policy))
            diff = float(mx.max(mx.abs(got - plain)).item())
            good = diff < 1.0
            line = f"{good} (max |logit diff| vs plain {diff:.3g})"
        except RuntimeError as exc:
            good, line = False, f"False: {exc}"
        os.environ[DEQUANTIZED_PREFILL] = "never"
        try:
            mx.eval(logits(model.make_cache(policy)))
            kernel = "runs"
        except RuntimeError as exc:
            kernel = f"no kernel: {exc}"
        finally:
            del os.environ[DEQUANTIZED_PREFILL]
        print(f"model over kv:quant:{bits}:64, prefill + decode: {line}", flush=True)
        print(
            f"  quantized_matmul for that prefill, {DEQUANTIZED_PREFILL}=never: {kernel}",
            flush=True,
        )
        ok = ok and good
    return ok


def _store_round_trips() -> bool:
    """A save handed off (write-behind) restores bit-exactly; a q8-policy store restores
    close to the rows (decoded on the device)."""
    import shutil
    import tempfile

    from kvstore.caches import KVCache
    from kvstore.codecs import cuda_pages
    from kvstore.store import open_store

    # These rows are below the page route's 16 MiB: take it anyway (the trial first), so
    # that the spans copied to the device (or the host pages, KVSTORE_CUDA_STAGE_SPANS=0)
    # are what these restores read.
    cuda_pages.GATHER_MIN_BYTES = 0
    route = cuda_pages._works()
    print(f"page route tried: {route} (spans copied to the device: {cuda_pages.STAGE_SPANS})")
    print(f"decoded rows joined on the device by one kernel: {cuda_pages.joins_proven()}")

    caches = _bf16_caches(2, 600)
    mx.eval([c.keys for c in caches])
    tokens = np.arange(600, dtype=np.uint32)
    ok = True
    for policy in ("lossless", "kv:quant:8:64"):
        path = tempfile.mkdtemp(prefix="kvstore-check-")
        try:
            kw = {} if policy == "lossless" else {"storage_policy": policy}
            with open_store(f"lmdb://{path}", **kw) as store:
                handle = store.save_behind("check", tokens, caches)
                store.flush()
                written = len(handle.result().written)
                got = store.restore(store.lookup("check", tokens), [KVCache(), KVCache()])
                n = int(got[0].offset)
                diffs = [
                    float(mx.max(mx.abs(a[..., :n, :] - b[..., :n, :])).item())
                    for g, c in zip(got, caches, strict=True)
                    for a, b in ((g.keys, c.keys), (g.values, c.values))
                ]
            good = n == 599 and written == 3 and (max(diffs) == 0.0 or policy != "lossless")
            good = good and max(diffs) < 0.1
            print(
                f"save_behind + restore, {policy}: {good} (held {handle.held_s * 1e3:.1f} ms, "
                f"{n} tokens, largest difference {max(diffs):.3g})",
                flush=True,
            )
            ok = ok and good
        finally:
            shutil.rmtree(path, ignore_errors=True)
    cuda_pages.settle()
    return ok and route


if __name__ == "__main__":
    sys.exit(main())
