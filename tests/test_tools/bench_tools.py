"""Running a ``tools/bench/`` script as its README says, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench_tool(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python3 tools/bench/<script> argv...`` with the project importable; asserts it
    exited 0 (its stderr's end in the message)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / script), *argv],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done
