"""``tools/bench/gpu/loop_profile`` in a real stock ``mlx_lm.server``: the
``sitecustomize`` it loads through ``PYTHONPATH`` times each ``BatchGenerator.next``
call of a streamed request, writes them at SIGTERM, and the summary reads them back."""

from __future__ import annotations

import json
import os

from kvstore.testing.mlx_lm_models import write_model_dir
from kvstore.testing.serve_processes import ServerProcess

from .bench_tools import ROOT


def test_a_servers_next_calls_are_timed_and_summarized(tmp_path, capsys):
    from tools.bench.gpu.loop_profile import summary
    from tools.bench.serve_ttft import end_tokens

    model = write_model_dir(tmp_path / "model", "llama")
    hook = ROOT / "tools" / "bench" / "gpu" / "loop_profile"
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "KVSTORE_BENCH_LOOP_PROFILE": str(tmp_path / "loop"),
        "KVSTORE_BENCH_LOOP_PROFILE_CPROFILE": "1",
        "KVSTORE_BENCH_LOOP_PROFILE_SAMPLE": "1",
        "KVSTORE_BENCH_LOOP_PROFILE_SLOW_MS": "0",  # every call and gap a window
    }
    server = ServerProcess.stock(model, log=tmp_path / "stock.log", env=env)
    ServerProcess.start_all(server)
    try:
        status, reply = server.post(
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "def f(x):"}],
                "max_tokens": 6,
                "temperature": 0,
                "logit_bias": {str(t): -100 for t in end_tokens(model)},  # all six
            },
        )
        assert status == 200, reply
    finally:
        server.stop()
    (timeline,) = (tmp_path / "loop").glob("*.json")
    data = json.loads(timeline.read_text())
    assert "mlx_lm" in " ".join(data["argv"])
    calls = data["calls"]
    assert sum(generated for *_, generated in calls) == 6
    assert all(end >= start for start, end, *_ in calls)
    assert timeline.with_suffix(".prof").exists()  # the generating thread's cProfile
    # The stack samples kept are those inside a call or gap over SLOW_MS, each once.
    windows = summary.slow_windows(calls, data["slow_ms"])
    kept = [(t, thread) for t, thread, _ in data["samples"]]
    assert kept and len(set(kept)) == len(kept)
    assert all(any(a <= t <= b for _, a, b in windows) for t, _ in kept)
    assert any(
        stack[0].endswith(" next_call") or "generate.py" in stack[0]
        for _, thread, stack in data["samples"]
        if "generate" in thread
    )

    assert summary.main([str(tmp_path / "loop"), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert f"(mlx_lm.server): {len(calls)} calls" in out and "6 tokens" in out
    inside = [(end - start) * 1e3 for start, end, *_ in calls]
    longest = inside.index(max(inside)) + 1
    assert f"; longest {max(inside):.1f} at call {longest})" in out  # inside next
    assert "BatchGenerator" in out or "generate.py" in out  # the profile's functions


def test_the_summary_prints_each_threads_stacks_in_each_slow_call_or_gap(capsys):
    from tools.bench.gpu.loop_profile import summary

    # (start, end, prompt responses, generated): call 2 takes 180 ms, then a 180 ms gap.
    calls = [[0.0, 0.01, 0, 1], [0.02, 0.20, 0, 1], [0.21, 0.22, 0, 1], [0.40, 0.41, 0, 1]]
    step = ["generate.py:1 step", "server.py:2 loop"]
    samples = [
        [0.05, "gen", step],
        [0.10, "gen", step],
        [0.12, "pool_0", ["thread.py:81 _worker", "threading.py:982 run"]],  # idle
        [0.30, "writer", ["lmdb.py:652 _commit", "prefix.py:3 flush"]],
        [0.50, "gen", ["late.py:1 after"]],  # in no slow window
    ]
    summary.print_samples(calls, samples, 100.0)
    out = capsys.readouterr().out
    assert "  call 2 inside next: 180.0 ms, 3 samples\n" in out
    assert "    gen x2: generate.py:1 step < server.py:2 loop\n" in out
    assert "  gap after call 3: 180.0 ms, 1 samples\n" in out
    assert "    writer x1: lmdb.py:652 _commit < prefix.py:3 flush\n" in out
    assert "pool_0" not in out and "late.py" not in out
