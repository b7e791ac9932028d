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

    assert summary.main([str(tmp_path / "loop"), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert f"(mlx_lm.server): {len(calls)} calls" in out and "6 tokens" in out
    inside = [(end - start) * 1e3 for start, end, *_ in calls]
    longest = inside.index(max(inside)) + 1
    assert f"; longest {max(inside):.1f} at call {longest})" in out  # inside next
    assert "BatchGenerator" in out or "generate.py" in out  # the profile's functions
