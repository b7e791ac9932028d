"""Figure: time to first token after a server restart, ``kvstore serve`` vs stock ``mlx_lm.server``.

One conversation over a long shared context (a system prompt of ``--context``
tokens): turn 1 is asked, both servers are restarted, turn 2 (turn 1, its
answer and a new question) is asked. After the restart stock ``mlx_lm.server``
has an empty prompt cache and prefills everything; ``kvstore serve`` restores
turn 1 from its store (a fresh LMDB directory per repeat) and prefills only
the new question. For reference, the same turn 2 is also asked of the stock
server *without* a restart (its in-memory cache serves it).

Every answer runs its whole ``max_tokens``: the model's end tokens get a logit bias of
-100 (a random-weight model's turn 2 otherwise ends at its sixth token or so, short of
the next buffer size ``--answer2`` is meant to cross).

TTFT is measured by the client: from sending a streaming chat request to the
first SSE data chunk (one per generated token). Servers run side by side,
started together, requests interleaved; the median of ``--repeats`` is reported
with ``cached_tokens`` as each server reported it. The model is an mlx-lm
llama directory written here with the reference model's ``small`` shape
(6 layers, hidden 512, head dim 128; a byte-level tokenizer), or ``--model DIR``.
Model compute depends ~10x on the BLAS (BENCHMARKS.md): run with OpenBLAS
preloaded, which the servers inherit::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/serve_ttft.py [--context 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.bench.figures.gpu_common import LLAMA8B as GPU_LLAMA8B
from kvstore.testing.mlx_lm_models import MLX_LM_SHARD_BYTES, write_model_dir
from kvstore.testing.serve_processes import ServerProcess

SMALL = dict(
    hidden_size=512,
    num_hidden_layers=6,
    intermediate_size=1408,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=16384,
)
#: The GPU figures' model on the byte-level tokenizer (its vocabulary), bfloat16: where a
#: new shape's cuDNN attention graph costs what a server pays.
LLAMA8B = {
    **{k: v for k, v in GPU_LLAMA8B.items() if k not in ("model_type", "vocab_size")},
    "max_position_embeddings": 16384,
}
SHAPES = {"small": (SMALL, None, 0.15), "llama8b": (LLAMA8B, "bfloat16", 0.02)}


def context_text(tokens: int) -> str:
    """About ``tokens`` tokens (one per byte) of standard-library source text."""
    import inspect
    import textwrap

    parts, size = [], 0
    for module in ("argparse", "json.decoder", "textwrap", "inspect", "tempfile", "statistics"):
        source = inspect.getsource(__import__(module, fromlist=["_"]))
        parts.append(source)
        size += len(source.encode())
        if size >= tokens:
            break
    text = "".join(parts).encode()[:tokens].decode("ascii", "ignore")
    return textwrap.dedent(text)


def end_tokens(model: Path) -> list[int]:
    """The model's end-of-sequence token ids (its ``config.json``'s ``eos_token_id``)."""
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def ttft(
    server: ServerProcess,
    messages: list[dict[str, str]],
    max_tokens: int,
    bias: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Stream one greedy chat completion (``bias``: token id -> logit bias): seconds to
    the first token, the longest wait between two tokens after it (a decode step that
    built a graph shows there), its text, cached tokens."""
    request: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if bias:
        request["logit_bias"] = bias
    body = json.dumps(request)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = None
    text, cached, gaps, last = [], None, [0.0], 0.0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            now = time.perf_counter() - start
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
        if chunk.get("choices"):
            text.append("".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"]))
        if chunk.get("usage"):
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
            prompt = chunk["usage"]["prompt_tokens"]
    conn.close()
    return {
        "ttft_s": first,
        "max_gap_s": max(gaps),
        # where the waits fell, longest first: (chunk index, seconds, the chunk's text).
        # A chunk is sent only once a token's text is out: tokens whose text the server
        # holds back (a partial UTF-8 character, a possible control sequence) make a
        # gap of the text's, not of the decode's (the text's tokens tell which).
        "longest_gaps": sorted(zip(range(len(gaps)), gaps, text), key=lambda g: -g[1])[:3],
        "median_gap_s": statistics.median(gaps),
        "text": "".join(text),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
    }


def token_counter(model: Path) -> Any:
    """How many of the model's tokens a streamed chunk's text is (about: re-encoded): a
    long gap before a chunk of several tokens is the server holding their text back."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def handoff_seconds(server: ServerProcess) -> list[float]:
    """``[sum, count]`` of the seconds the generating thread gave saves (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, body = server.get("/metrics")
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.startswith("kvstore_save_handoff_seconds_"):
                values[sample.name.rsplit("_", 1)[1]] = sample.value
    return [values.get("sum", 0.0), values.get("count", 0.0)]


def startup(server: ServerProcess) -> dict[str, float | None]:
    """Seconds ``kvstore serve`` spent making its model ready (``/v1/kvstore/stats``):
    mlx-lm's load, the store's binding (the fingerprint) and the warm-up."""
    stats = server.stats()["server"]
    (load,) = stats["load_s"].values()  # one model
    return {**load, "warmup": next(iter(stats["warmup_s"].values()), None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory; one that does not exist is written there "
        "(--shape) and kept for the next run (default: written in a temporary directory)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="small",
        help="the model written when --model names none (llama8b: ~15 GiB, a GPU's, in "
        "mlx-lm's 5 GiB files)",
    )
    parser.add_argument("--context", type=int, default=4000, help="system prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--answer", type=int, default=16, help="turn 1 answer tokens")
    parser.add_argument(
        "--answer2",
        type=int,
        default=8,
        help="turn 2 answer tokens (past the restored buffer's 256-row size, a decode step "
        "into a new size: the longest gap between tokens is reported)",
    )
    parser.add_argument(
        "--ours-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an option for kvstore serve (repeat it: --ours-arg=--warm-decode --ours-arg=8192)",
    )
    parser.add_argument(
        "--store-query",
        default="",
        metavar="QUERY",
        help="store options for kvstore serve's LMDB URL (touch_interval=30: the restore's "
        "recency writes 30 s after it instead of 1)",
    )
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kvstore-serve-ttft-"))
    model = Path(args.model) if args.model else work / "model"
    if not model.exists():
        shape, dtype, scale = SHAPES[args.shape]
        write_model_dir(
            model, "llama", scale=scale, dtype=dtype, shard_bytes=MLX_LM_SHARD_BYTES, **shape
        )
    no_end = {str(token): -100.0 for token in end_tokens(model)}
    env = {"KVSTORE_CACHE_DIR": str(work / "digests")}
    blas = "OpenBLAS (preloaded)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "bundled"
    system = context_text(args.context)
    turn1 = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What does the first function above do?"},
    ]
    samples: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        logs, store = work / f"logs-{rep}", f"lmdb://{work / f'store-{rep}'}"
        store += f"?{args.store_query}" if args.store_query else ""
        stock = ServerProcess.stock(model, log=logs / "stock.log", env=env)
        ours = ServerProcess.kvstore(model, store, *args.ours_arg, log=logs / "ours.log", env=env)
        ServerProcess.start_all(stock, ours)
        first = {
            name: ttft(server, turn1, args.answer, no_end)
            for name, server in (("stock", stock), ("ours", ours))
        }
        answer = first["ours"]["text"]
        # Not asserted (reported below): on a random-weight model a near-tie turns on
        # rounding, and `kvstore serve` may attend new tokens by plain ops
        # (KVSTORE_UNFUSED_ATTENTION) or prefill a restored prompt's suffix alone.
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And the second one?"},
        ]
        # stock, no restart: its in-memory cache (the whole answer: whether the stock
        # server's own text depends on what it had cached shows below)
        warm_stock = ttft(stock, turn2, args.answer2, no_end)
        started = {"first start": startup(ours)}
        ours.wait_saved()
        handoff = handoff_seconds(ours)
        stock.stop()
        ours.stop()
        stock = ServerProcess.stock(model, log=logs / "stock-2.log", env=env)
        ours = ServerProcess.kvstore(model, store, *args.ours_arg, log=logs / "ours-2.log", env=env)
        ServerProcess.start_all(stock, ours)
        # Each server's first request pays one-off costs (MLX kernels, imports):
        # a short unrelated request first, then turn 2, servers alternating.
        for server in (stock, ours):
            ttft(server, [{"role": "user", "content": "hi"}], 1)
        started["restart"] = startup(ours)
        order = [("stock", stock), ("ours", ours)]
        results = {}
        for name, server in order if rep % 2 == 0 else order[::-1]:
            results[name] = ttft(server, turn2, args.answer2, no_end)
        # Not asserted either, for the same reason as turn 1.
        stock.stop()
        ours.stop()
        samples.append(
            {
                "turn1": first,
                "stock_no_restart": warm_stock,
                "stock_restarted": results["stock"],
                "ours_restarted": results["ours"],
                "save_handoff_s": handoff,
                "ours_startup_s": started,
            }
        )
        print(
            f"repeat {rep + 1}: stock {results['stock']['ttft_s'] * 1e3:.0f} ms, "
            f"kvstore serve {results['ours']['ttft_s'] * 1e3:.0f} ms "
            f"(cached {results['ours']['cached_tokens']} of "
            f"{results['ours']['prompt_tokens']})",
            file=sys.stderr,
        )

    def med(key: str) -> float:
        return statistics.median(s[key]["ttft_s"] for s in samples)

    last = samples[-1]
    rows = [
        ("stock mlx_lm.server, after a restart", "stock_restarted"),
        ("stock mlx_lm.server, no restart (memory)", "stock_no_restart"),
        ("kvstore serve, after a restart (store)", "ours_restarted"),
    ]
    print(
        f"turn 2: {last['ours_restarted']['prompt_tokens']} prompt tokens; BLAS: {blas}; "
        f"model {model}; median of {args.repeats}"
    )
    count_tokens = token_counter(model)
    print(f"{'server':44} {'TTFT':>9} {'cached_tokens':>14} {'longest gap':>12}  at chunk")
    for label, key in rows:
        gap = statistics.median(s[key]["max_gap_s"] for s in samples)
        where = ", ".join(
            f"{i}: {g * 1e3:.1f} ({n} tok, {g * 1e3 / max(1, n):.1f} a token)"
            for i, g, piece in last[key]["longest_gaps"]
            for n in [count_tokens(piece)]
        )
        print(
            f"{label:44} {med(key) * 1e3:7.0f} ms {last[key]['cached_tokens']!s:>14} "
            f"{gap * 1e3:9.1f} ms  {where} (median {last[key]['median_gap_s'] * 1e3:.1f})"
        )
    agree1 = sum(s["turn1"]["stock"]["text"] == s["turn1"]["ours"]["text"] for s in samples)
    agree = sum(s["stock_restarted"]["text"] == s["ours_restarted"]["text"] for s in samples)
    agree_memory = sum(
        s["stock_no_restart"]["text"] == s["ours_restarted"]["text"] for s in samples
    )
    stock_self = sum(s["stock_no_restart"]["text"] == s["stock_restarted"]["text"] for s in samples)
    print(
        f"texts equal to the stock server's: turn 1 in {agree1}, turn 2 in {agree} "
        f"(to its no-restart answer in {agree_memory}) of {len(samples)} repeats; the stock "
        f"server's turn 2 equal to itself across its restart in {stock_self}"
    )
    print(f"speed-up after a restart: {med('stock_restarted') / med('ours_restarted'):.1f}x")
    total = sum(s["save_handoff_s"][0] for s in samples)
    saves = sum(s["save_handoff_s"][1] for s in samples)
    if saves:
        print(
            f"saves: the generating thread gave each {total / saves * 1e3:.2f} ms on average "
            f"(kvstore_save_handoff_seconds, {saves:.0f} saves of turn 1)"
        )
    for when in ("first start", "restart"):
        parts = last["ours_startup_s"][when]
        print(
            f"kvstore serve's model at its {when}: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items() if v is not None)
            + " (before its first request could run; last repeat)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"blas": blas, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
