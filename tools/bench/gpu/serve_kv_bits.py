"""Does a server attend quantized caches on this device? ``kvstore serve`` and stock
``mlx_lm.server``, each with ``--kv-bits`` from the first token, and without it.

    python3 tools/bench/gpu/serve_kv_bits.py [--bits 8]

A small llama (serve_ttft.py's ``small`` shape, written to a temporary directory), one
chat request of 24 greedy tokens to each server: its text, or the error the server
answered with. On MLX's CUDA backend stock ``--kv-bits`` failed at its first decode step
("No implementation for problem shape"); kvstore serve routes quantized caches through
kvstore's kernel (``kvstore.mlx_lm.attention``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvstore.testing.mlx_lm_models import write_model_dir
from kvstore.testing.serve_processes import ServerProcess
from tools.bench.serve_ttft import SHAPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", default="8")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstore-kv-bits-"))
    shape, dtype, scale = SHAPES["small"]
    write_model_dir(work / "model", "llama", scale=scale, dtype=dtype, **shape)
    kv = ["--kv-bits", args.bits, "--kv-group-size", "64", "--quantized-kv-start", "0"]
    servers = {
        "stock": ServerProcess.stock(work / "model", log=work / "stock.log"),
        f"stock --kv-bits {args.bits}": ServerProcess.stock(
            work / "model", *kv, log=work / "stock-q.log"
        ),
        "kvstore serve": ServerProcess.kvstore(
            work / "model", f"lmdb://{work / 'a'}", log=work / "ours.log"
        ),
        f"kvstore serve --kv-bits {args.bits}": ServerProcess.kvstore(
            work / "model", f"lmdb://{work / 'b'}", *kv, log=work / "ours-q.log"
        ),
    }
    ServerProcess.start_all(*servers.values())
    body = {
        "messages": [{"role": "user", "content": "def add(a, b): return a + b\n" * 40}],
        "max_tokens": 24,
        "temperature": 0.0,
    }
    try:
        for name, server in servers.items():
            status, reply = server.post("/v1/chat/completions", body)
            if status == 200:
                print(f"{name}: {reply['choices'][0]['message']['content']!r}", flush=True)
            else:
                print(f"{name}: HTTP {status}: {str(reply)[:300]}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    for log in sorted(work.glob("*.log")):
        errors = [line for line in log.read_text().splitlines() if "Error" in line]
        if errors:
            print(f"{log.name}: {errors[-1][:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
