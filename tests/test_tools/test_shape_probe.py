"""``tools/bench/gpu/shape_probe.py`` on this CPU with its tiny stand-in (``--quick``):
every part runs and writes its rows, so a device call spends its minutes measuring, and
the plain-op attention that landed is at the float32 result's bfloat16 rounding floor."""

from __future__ import annotations

import json

from .bench_tools import run_bench_tool


def test_every_part_runs_and_plain_ops_sit_at_the_rounding_floor(tmp_path):
    out = tmp_path / "probe.json"
    argv = ["--quick", "--prefix", "256", "--suffixes", "7", "--decode", "4", "--ops"]
    argv += ["--spread", "1,2", "--decode-warm"]
    run_bench_tool("gpu/shape_probe.py", *argv, "--skip-c", "--out", str(out))
    rows = json.loads(out.read_text())
    assert {"A", "B", "logits", "D", "E"} <= rows.keys()
    # The warm-ups ran: a spread of 2 lengths in both modes; the decode graphs of the 2
    # buffer sizes 256 + 4 steps meet (256 and 512 rows).
    assert [(r["mode"], r["S"]) for r in rows["spread"]] == [
        (mode, S) for mode in ("spread never", "spread auto") for S in (1, 2)
    ]
    assert rows["decode_warm_sizes"] == 2

    a = {row["attend"]: row for row in rows["A"]}
    assert a.keys() == {"fused", "unfused", "broadcast", "bf16weights"}
    landed = a["unfused"]
    assert landed["off_f32"] <= landed["floor"] * 1.05, landed
    # Rounding the weights to bfloat16 (the form before) lands further off; so does MLX's
    # CPU kernel, which rounds the scores.
    assert a["bf16weights"]["off_f32"] > landed["off_f32"]
    assert a["fused"]["off_f32"] > landed["off_f32"]

    # The tiny stand-in is float32: plain ops give the fused kernel's logits exactly.
    assert [(r["off"], r["top_token_agrees"]) for r in rows["logits"]] == [(0.0, 1.0)] * 2

    growth = {row["step"]: row for row in rows["D"]}
    # 256 cached rows: the first of 4 steps needs a larger buffer when it grows by 256;
    # grown by 255 (a buffer of 510 rows) none of them does.
    assert len(growth[256]["crossing"]) == 1 and growth[255]["crossing"] == []

    (ops,) = rows["E"]
    assert ops["S"] == 12 and {"q_proj", "attention", "head_all"} <= ops.keys()
    assert all(len(pair) == 2 and min(pair) > 0 for name, pair in ops.items() if name != "S")
