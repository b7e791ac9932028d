"""What recurrent checkpoints cost in a prefix store (issue 16): measured and computed.

Measured: the tiny Qwen3.5-shaped model (``tiny-qwen3_5``: 3 Gated-DeltaNet
layers, 1 attention layer, float32) generates 16 tokens for prompts of
several lengths into a fresh LMDB store with the default checkpoint stride
(8 blocks of 256 tokens); the store's own figures give the bytes of KV rows
and of checkpoints (``StoreStats.checkpoint_bytes``: the checkpoints' tensor
bytes; everything else -- rows, headers, alignment -- is the KV side).

Computed: the same for Qwen3.5-35B-A3B from its public ``config.json``
(https://huggingface.co/Qwen/Qwen3.5-35B-A3B, ``text_config``: 40 layers,
``full_attention_interval`` 4, so 30 Gated-DeltaNet and 10 attention layers;
2 KV heads of ``head_dim`` 256; 16 key heads and 32 value heads of 128;
conv kernel 4; ``mamba_ssm_dtype`` float32; bfloat16 weights): per layer a
checkpoint holds the conv window ``[K - 1, 2 * 16 * 128 + 32 * 128]`` in
bfloat16 and the state ``[32, 128, 128]`` in float32; a token's KV is 2 heads
x 256 x (K + V) x 2 bytes in each attention layer. The store keeps, per saved
prompt of ``P`` tokens with ``G`` generated: one checkpoint every 8 blocks,
the last block boundary <= ``P - 1``, the end of the saved sequence and (when
decoding crossed one) its last block boundary; a branch point only where a
prompt leaves a stored one (not counted here).

    .venv/bin/python -m tools.bench.checkpoint_cost

Writes ``tools/bench/results/checkpoint_cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvstore.bridge import generate_tokens
from kvstore.bridge.checkpoints import plan_positions
from kvstore.model import build_model
from kvstore.store import open_store

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK, STRIDE, GENERATED = 256, 8, 16
MIB = 1 << 20

#: Qwen3.5-35B-A3B's text_config, the fields that size its caches (see the module docstring).
QWEN3_5_35B_A3B: dict[str, Any] = {
    "source": "https://huggingface.co/Qwen/Qwen3.5-35B-A3B (config.json, text_config)",
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "dtype": "bfloat16",
    "mamba_ssm_dtype": "float32",
}


def checkpoints_kept(prompt: int, generated: int, block: int = BLOCK, stride: int = STRIDE) -> int:
    """Checkpoints one save of a fresh prompt keeps (no branch point)."""
    saved = prompt + generated - 1  # tokens with KV after generating
    positions = set(plan_positions(block, stride, prompt, 0, 0))
    reached = [b for b in range(prompt, saved + 1) if b % block == 0]  # after prefill, decoding
    positions.update(b for b in reached if stride and b % (stride * block) == 0)
    positions.update(reached[-1:])  # the latest boundary reached
    positions.add(saved)  # the live state at the end of the saved sequence
    return len(positions)


def computed(config: dict[str, Any], prompts: list[int]) -> dict[str, Any]:
    layers, every = config["num_hidden_layers"], config["full_attention_interval"]
    attention = layers // every
    recurrent = layers - attention
    conv_dim = (
        2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
        + config["linear_num_value_heads"] * config["linear_value_head_dim"]
    )
    conv = (config["linear_conv_kernel_dim"] - 1) * conv_dim * 2  # bfloat16
    state = (
        config["linear_num_value_heads"]
        * config["linear_value_head_dim"]
        * config["linear_key_head_dim"]
        * 4  # float32
    )
    per_checkpoint = recurrent * (conv + state)
    per_token = attention * config["num_key_value_heads"] * config["head_dim"] * 2 * 2
    rows = []
    for p in prompts:
        n = checkpoints_kept(p, GENERATED)
        kv = per_token * (p + GENERATED - 1)
        rows.append(
            {
                "prompt": p,
                "checkpoints": n,
                "kv_bytes": kv,
                "checkpoint_bytes": n * per_checkpoint,
                "checkpoint_share": n * per_checkpoint / (kv + n * per_checkpoint),
            }
        )
    return {
        "layers": {"attention": attention, "gated_delta": recurrent},
        "conv_bytes_per_layer": conv,
        "state_bytes_per_layer": state,
        "bytes_per_checkpoint": per_checkpoint,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_block": per_token * BLOCK,
        "rows": rows,
    }


def measured(prompts: list[int]) -> dict[str, Any]:
    model = build_model("tiny-qwen3_5", seed=0)
    probe = model.make_cache()
    model(mx.array([[1]]), cache=probe)
    per_checkpoint = sum(c.bytes_per_checkpoint() for c in probe if c.bytes_per_token() == 0)
    rows = []
    for p in prompts:
        with tempfile.TemporaryDirectory() as tmp, open_store(f"lmdb://{tmp}") as store:
            tokens = mx.random.randint(0, 256, (p,), key=mx.random.key(p)).tolist()
            generate_tokens(model, tokens, store=store, max_tokens=GENERATED)
            stats = store.stats()
        rows.append(
            {
                "prompt": p,
                "blocks": stats.blocks,
                "checkpoints": stats.checkpoints,
                "expected_checkpoints": checkpoints_kept(p, GENERATED),
                "store_bytes": stats.bytes,
                "kv_bytes": stats.bytes - stats.checkpoint_bytes,
                "checkpoint_bytes": stats.checkpoint_bytes,
                "checkpoint_share": stats.checkpoint_bytes / stats.bytes,
            }
        )
    return {"bytes_per_checkpoint": per_checkpoint, "rows": rows}


def markdown(tiny: dict[str, Any], big: dict[str, Any]) -> str:
    lines = [
        "# Recurrent checkpoints: bytes per checkpoint and store size, default stride",
        "",
        f"Default stride {STRIDE} blocks of {BLOCK} tokens; each prompt then generates "
        f"{GENERATED} tokens and is saved (checkpoints: every {STRIDE} blocks, the last "
        f"boundary <= P - 1, the saved sequence's last boundary and its end).",
        "",
        "## Measured: tiny-qwen3_5 (3 Gated-DeltaNet + 1 attention layer, float32)",
        "",
        f"Bytes per checkpoint: {tiny['bytes_per_checkpoint']:,} "
        f"({tiny['bytes_per_checkpoint'] / 1024:.1f} KiB).",
        "",
        "| prompt | blocks | checkpoints | store bytes | KV bytes | checkpoint bytes | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tiny["rows"]:
        lines.append(
            f"| {r['prompt']} | {r['blocks']} | {r['checkpoints']} | {r['store_bytes']:,} | "
            f"{r['kv_bytes']:,} | {r['checkpoint_bytes']:,} | {r['checkpoint_share']:.1%} |"
        )
    lines += [
        "",
        "## Computed: Qwen3.5-35B-A3B (30 Gated-DeltaNet + 10 attention layers, bfloat16)",
        "",
        f"From {QWEN3_5_35B_A3B['source']}. Per Gated-DeltaNet layer: conv window "
        f"{big['conv_bytes_per_layer']:,} B + state {big['state_bytes_per_layer']:,} B; "
        f"bytes per checkpoint {big['bytes_per_checkpoint']:,} "
        f"({big['bytes_per_checkpoint'] / MIB:.1f} MiB); KV "
        f"{big['kv_bytes_per_token']:,} B per token ({big['kv_bytes_per_block'] / MIB:.1f} "
        f"MiB per block). One checkpoint weighs "
        f"{big['bytes_per_checkpoint'] / big['kv_bytes_per_block']:.1f} blocks of KV.",
        "",
        "| prompt | checkpoints | KV | checkpoints' bytes | store size | checkpoint share |",
        "|---|---|---|---|---|---|",
    ]
    for r in big["rows"]:
        total = r["kv_bytes"] + r["checkpoint_bytes"]
        lines.append(
            f"| {r['prompt']} | {r['checkpoints']} | {r['kv_bytes'] / MIB:.0f} MiB | "
            f"{r['checkpoint_bytes'] / MIB:.0f} MiB | {total / MIB:.0f} MiB | "
            f"{r['checkpoint_share']:.0%} |"
        )
    lines += ["", "Reproduce: `.venv/bin/python -m tools.bench.checkpoint_cost`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    tiny = measured(args.prompts)
    big = computed(QWEN3_5_35B_A3B, [*args.prompts, 32768])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_cost.json").write_text(
        json.dumps(
            {"tiny-qwen3_5": tiny, "qwen3.5-35b-a3b": big, "config": QWEN3_5_35B_A3B}, indent=1
        )
    )
    text = markdown(tiny, big)
    (args.out / "checkpoint_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
