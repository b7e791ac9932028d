"""tools/damage/sweep: its sample store is the same bytes every build, so ``--again`` replays.

A rerun of a failed position flips the same bit of the same file only if the
store it builds is byte for byte the one the sweep built (issue 18: reruns of
meta positions on a differently laid out store were not comparable).
"""

from __future__ import annotations

from tools.damage.sweep import build, replay_check, store_digest


def test_the_sweep_store_is_the_same_bytes_every_build(tmp_path):
    build(tmp_path / "a")
    build(tmp_path / "b")
    assert store_digest(tmp_path / "a") == store_digest(tmp_path / "b")


def test_a_replay_says_whether_it_damages_the_same_store(tmp_path):
    again = tmp_path / "sweep-positions.jsonl.gz"
    assert "recorded no store hash" in replay_check(again, "ab")
    (tmp_path / "sweep-summary.json").write_text('{"store_sha256": "ab"}')
    assert replay_check(again, "ab").endswith("the same store, byte for byte")
    assert "NOT the same store (was ab)" in replay_check(again, "cd")
