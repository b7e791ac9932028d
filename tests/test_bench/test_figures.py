"""The figure table and the figures measurable now, on small sizes (structure, never times)."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore.bench.figures import (
    FIGURES,
    decode,
    decode_speed,
    restore,
    save,
    stored_bytes,
    turboquant_speed,
)
from kvstore.bench.figures.common import pending_figure
from kvstore.bench.harness import Case, Sizes, at_least, evaluate, figure_status
from kvstore.bench.results import MET, MISSED, NOT_MEASURED
from kvstore.bench.workloads import WORKLOADS
from kvstore.codecs import registered_kinds
from kvstore.signature import parse_signature

from .helpers import context

BENCHMARKS_MD = Path("/work/shared/BENCHMARKS.md")
SMALL = Sizes(("qwen0.5b",), (256, 512))


def test_every_figure_of_benchmarks_md_is_in_the_table_under_its_own_id():
    gpu = [f"G{i}" for i in range(1, 6)]
    assert list(FIGURES) == [f"P{i}" for i in range(1, 12)] + ["D1", "D2"] + gpu
    for fid, figure in FIGURES.items():
        assert figure.id == fid and figure.title and figure.peer
    assert all(FIGURES[f"P{i}"].bars for i in range(1, 12))  # every P-figure has its bar(s)


@pytest.mark.skipif(
    not BENCHMARKS_MD.exists(), reason="the shared BENCHMARKS.md is not on this machine"
)
def test_the_table_lists_the_figures_benchmarks_md_defines():
    defined = set(re.findall(r"^\| (P\d+) \|", BENCHMARKS_MD.read_text(), re.MULTILINE))
    assert defined == {fid for fid in FIGURES if fid.startswith("P")}


def test_figures_without_their_parts_say_why_and_measure_nothing(tmp_path):
    ctx = context(tmp_path)
    figure = pending_figure(
        "P99", "a figure whose parts are missing", "a peer", (at_least("x", 1.0),), "needs issue 99"
    )
    result = figure.run(ctx)
    assert result.rows == [] and result.pending == "needs issue 99"
    checks = evaluate(figure, result)
    assert {c.status for c in checks} == {NOT_MEASURED}
    assert figure_status(checks, result) == NOT_MEASURED


def _expected_families():
    kinds = set(registered_kinds())
    return {f: parse_signature(f).kind in kinds for f in stored_bytes.FAMILIES}


@pytest.fixture(scope="module")
def p7_result(tmp_path_factory):
    # 256 tokens: the store's block, over which the record header is amortised as stored
    ctx = context(tmp_path_factory.mktemp("p7"), sizes=Sizes((), (), block_tokens=256))
    return stored_bytes.FIGURE.run(ctx)


def test_p7_measures_real_records_of_every_registered_family(p7_result):
    measured = _expected_families()
    assert [(r.params["workload"], r.params["family"]) for r in p7_result.rows] == [
        (w, f) for w in WORKLOADS for f in stored_bytes.FAMILIES
    ]
    for row in p7_result.rows:
        shape = WORKLOADS[row.params["workload"]]
        if not measured[row.params["family"]]:
            assert row.pending.startswith("no codec registered for 'kv:") and not row.values
            continue
        per_token, ratio = row.values["bytes/token"], row.values[stored_bytes.METRIC]
        assert ratio == pytest.approx(per_token / shape.bytes_per_token)
        if row.params["family"] == "kv:plain":
            # the rows themselves, plus the record's header and padding
            assert shape.bytes_per_token < per_token < shape.bytes_per_token * 1.01
        # Rows cost exactly their family's formula. The header adds a few percent at most:
        # TurboQuant's description (signs, codebook) is ~0.4 KB per layer, 4% of a block of
        # qwen0.5b's 2 heads x 64 dims at 2 bits.
        assert row.values["rows/formula"] == 1.0
        assert row.values["formula vs bf16"] < ratio < row.values["formula vs bf16"] * 1.05


def test_p7_turboquant_bars_follow_from_b_plus_16_over_d(p7_result):
    # tq 3/3 and 2/2 cost 3 + 16/D and 2 + 16/D bits per value: within the 0.20x and
    # 0.14x bars at head_dim 128 (llama8b) and 256 (gemma-swa), above them at 64 (qwen0.5b).
    checks = evaluate(stored_bytes.FIGURE, p7_result)
    statuses = {(c.bar, c.row.split()[0]): c.status for c in checks if "turboquant" in c.bar}
    for bar in ("vs bf16 <= 0.2x [kv:turboquant:3:3]", "vs bf16 <= 0.14x [kv:turboquant:2:2]"):
        assert statuses[(bar, "llama8b")] == statuses[(bar, "gemma-swa")] == MET
        assert statuses[(bar, "qwen0.5b")] == MISSED
    assert stored_bytes.formula_bits_per_value("kv:turboquant:3:3", 64) / 16 > 0.20
    assert stored_bytes.formula_bits_per_value("kv:turboquant:2:2", 64) / 16 > 0.14


def test_p7_quantized_families_meet_their_size_bars(p7_result):
    # Sizes, not times: these follow from the affine layout (8/64: 68 of 128 bytes per group).
    checks = evaluate(stored_bytes.FIGURE, p7_result)
    statuses = {c.bar: c.status for c in checks if "kv:quant" in c.bar}
    assert statuses == {
        "vs bf16 <= 0.54x [kv:quant:8:64]": MET,
        "vs bf16 <= 0.29x [kv:quant:4:64]": MET,
    }


def test_p1_measures_the_peers_at_every_length_and_waits_for_ours(tmp_path, monkeypatch):
    monkeypatch.setattr(restore, "OURS", None)
    result = restore.FIGURE.run(context(tmp_path, sizes=SMALL))
    *prompts, scaling = result.rows
    assert [r.params["tokens"] for r in prompts] == [256, 512]
    for row in prompts:
        assert list(row.samples) == ["mlx-lm load", "memcpy", "mlx-lm load + step"]
        assert all(len(s) == 5 for s in row.samples.values())
        assert set(row.ratios) == {"mlx-lm vs memcpy"}
        assert row.params["mib"] == pytest.approx(row.params["tokens"] * 12 / 1024)
    assert scaling.params == {"workload": "qwen0.5b", "scaling": True, "tokens": [256, 512]}
    assert set(scaling.values) == {
        "mlx-lm load s/MiB max/min",
        "memcpy s/MiB max/min",
        "mlx-lm load + step s/MiB max/min",
    }
    assert all(v >= 1.0 for v in scaling.values.values())  # max/min, by construction
    assert "issue 5" in result.pending
    assert list(tmp_path.iterdir()) == []  # the prompt-cache files are gone
    assert figure_status(evaluate(restore.FIGURE, result), result) == NOT_MEASURED


def test_p1_judges_its_bars_once_ours_is_plugged_in(tmp_path, monkeypatch):
    built = []

    @contextmanager
    def ours(ctx, kv):
        built.append(kv.label)
        yield Case("ours", "ours", kv.mlx_lm)  # caches, for the first step after it

    monkeypatch.setattr(restore, "OURS", ours)
    result = restore.FIGURE.run(context(tmp_path, sizes=SMALL))
    assert built == ["qwen0.5b 256", "qwen0.5b 512"]
    assert result.pending is None
    assert set(result.rows[0].ratios) == {
        "vs mlx-lm",
        "vs memcpy",
        "mlx-lm vs memcpy",
        "with the first step vs mlx-lm",
    }
    assert list(result.rows[0].samples)[-1] == "ours + step"
    checks = evaluate(restore.FIGURE, result)
    assert len(checks) == 2 + 2 + 1  # two ratio bars per length, one scaling bar (none on the step)
    assert all(c.status != NOT_MEASURED and c.value is not None for c in checks)


def test_p2_times_both_mlx_lm_saves_and_removes_their_files(tmp_path, monkeypatch):
    monkeypatch.setattr(save, "OURS_NEW", None)
    result = save.P2.run(context(tmp_path, sizes=SMALL))
    *prompts, scaling = result.rows
    for row in prompts:
        assert list(row.samples) == ["mlx-lm save", "mlx-lm save+fsync"]
        assert row.ratios == {}
    assert "issue 5" in result.pending
    assert list(tmp_path.iterdir()) == []


def test_d1_times_the_decode_paths_in_both_buffer_cache_modes(tmp_path):
    import mlx.core as mx

    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    result = decode.FIGURE.run(context(tmp_path, sizes=Sizes(("gemma-swa",), (64,))))
    assert [r.params.get("mlx_cache") for r in result.rows] == ["warm", "cold"]
    for row in result.rows:
        assert list(row.samples) == [
            "decode_to_mlx",
            "decode+snapshot_to_mlx",
            "decode_views",
            "memcpy",
        ]
        assert set(row.ratios) == {"decode_to_mlx vs memcpy", "decode+snapshot_to_mlx vs memcpy"}
    assert mx.set_cache_limit(before) == before  # the figure put MLX's limit back
    assert figure_status(evaluate(decode.FIGURE, result), result) == "reported"


def test_g5_times_both_decode_paths_per_layout_and_checks_their_logits(tmp_path):
    result = decode_speed.FIGURE.run(context(tmp_path))  # quick: tiny, 64 tokens
    assert [r.params["layout"] for r in result.rows] == list(decode_speed.LAYOUTS)
    for row in result.rows:
        assert list(row.samples) == [
            "specialised",
            "generic",
            "specialised, pipelined",
            "generic, pipelined",
        ]
        assert set(row.ratios) == {
            "specialised vs generic",
            "pipelined: specialised vs generic",
            "specialised pipelined vs generic",
        }
        assert row.values["logits bit-exact"] == 1.0
        assert row.values["specialised graph ms/token"] > 0
    # the 1.3x aim is judged on a GPU's rows only
    assert {c.status for c in evaluate(decode_speed.FIGURE, result)} == {NOT_MEASURED}


#: What MLX 0.32.4 raised on the H200 (G5, bench-results.json of tools/bench/results/gpu).
H200_NO_KERNEL = (
    "[quantized_matmul] No implementation for problem shape: 2047x4095x128x32, transpose: "
    'true, activation: bfloat16, bits: 4, group size: 64, mode: "affine".'
)
H200_NO_HEADERS = (
    "Failed to compile kernel: mlx/backend/cuda/device/cute_dequant.cuh: cannot open "
    'source file "cute/numeric/numeric_types.hpp"'
)


def test_g5_names_the_mlx_limitation_of_a_layout_it_cannot_run(tmp_path, monkeypatch):
    from importlib import metadata

    def no_kernel(model):
        raise RuntimeError(H200_NO_KERNEL)  # as MLX raised it, where this CPU has kernels

    layouts = {"plain": decode_speed.LAYOUTS["plain"], "no kernel here": no_kernel}
    monkeypatch.setattr(decode_speed, "LAYOUTS", layouts)
    result = decode_speed.FIGURE.run(context(tmp_path))
    plain, missing = result.rows
    assert plain.pending is None and plain.values["logits bit-exact"] == 1.0
    assert missing.params["layout"] == "no kernel here" and not missing.samples
    version = metadata.version("mlx")
    assert missing.pending == (
        f"MLX {version} has no kernel here for this layout's shapes: {H200_NO_KERNEL}"
    )
    headers = decode_speed.mlx_limitation(RuntimeError(H200_NO_HEADERS))
    assert headers is not None and "tools/bench/gpu/README.md" in headers

    def our_bug(model):
        raise RuntimeError("[update_and_fetch] something of ours")

    monkeypatch.setattr(decode_speed, "LAYOUTS", {"ours": our_bug})
    with pytest.raises(RuntimeError, match="something of ours"):
        decode_speed.FIGURE.run(context(tmp_path))


def test_d1_record_holds_each_layers_attended_rows():
    from kvstore.bench.workloads import SyntheticKV
    from kvstore.codecs import decode_record

    from .test_workloads import TINY_SWA

    record = decode_record(decode.record_of(SyntheticKV(TINY_SWA, tokens=40)))
    assert [s.signature for s in record.layers] == [
        "kv:rotating-plain",
        "kv:rotating-plain",
        "kv:plain",
    ]
    assert [(s.start, s.stop) for s in record.layers] == [(24, 40), (24, 40), (0, 40)]


def test_p9_reads_the_same_records_from_redis_and_lmdb(tmp_path):
    from tests.test_store.conftest import require_redis_server

    require_redis_server()
    # 16-token blocks: 128 records of 192 KiB, small enough for a test; nothing is timed here.
    ctx = context(tmp_path, sizes=Sizes(("qwen0.5b",), (), block_tokens=16))
    result = FIGURES["P9"].run(ctx)
    (row,) = result.rows
    assert row.params["workload"] == "qwen0.5b" and row.params["tokens"] == 2048
    assert set(row.samples) == {"redis", "lmdb", "redis GET only"}
    assert set(row.ratios) == {"vs lmdb", "store overhead"}
    assert {c.metric for c in evaluate(FIGURES["P9"], result)} == {"vs lmdb"}


def test_p11_times_turboquant_against_mx_affine_on_the_same_rows(tmp_path):
    result = turboquant_speed.FIGURE.run(context(tmp_path, sizes=Sizes(("qwen0.5b",), (64, 128))))
    *rows, _, _, _ = result.rows  # one scaling row per width
    assert [(r.params["tokens"], r.params["config"]) for r in rows] == [
        (t, c) for t in (64, 128) for c in ("tq4/4", "tq3/3", "tq2/2")
    ]
    for row in rows:
        ours = ["encode", "decode"] + (["fwht"] if row.params["config"] == "tq4/4" else [])
        assert list(row.samples) == ["mx.quantize 4/64", "mx.dequantize 4/64", *ours]
        assert {turboquant_speed.ENCODE, turboquant_speed.DECODE} <= set(row.ratios)
        assert row.params["mib"] == pytest.approx(row.params["tokens"] * 2 * 2 * 64 * 2 / 2**20)
    checks = evaluate(turboquant_speed.FIGURE, result)
    assert len(checks) == 2 * len(rows) and all(c.value is not None for c in checks)


def test_the_gpu_figures_wait_for_a_gpu_and_smoke_on_a_cpu(tmp_path, monkeypatch):
    """G1-G4 on a CPU: not measured (they say why) unless --quick, which runs their
    paths with a tiny model; fresh sessions run in-process here (spawning costs seconds)."""
    from kvstore.bench.figures import gpu_common, gpu_namespace, gpu_save, gpu_session, gpu_ttft

    full = context(tmp_path)
    full.quick = False
    for figure in (gpu_ttft.G1, gpu_ttft.G2, gpu_save.G3, gpu_namespace.G4):
        assert figure.run(full).pending == gpu_common.NEEDS_GPU
    monkeypatch.setattr(
        gpu_common, "RUN_SESSION", lambda spec: gpu_common.Session(**gpu_session.run(spec))
    )
    monkeypatch.setattr(gpu_ttft, "POLICIES", ("kv:quant:8:64",))
    # A setting of the path measured is noted with the figure; the bench's own are not.
    monkeypatch.setenv("KVSTORE_CUDA_LOCK_SPANS", "auto")
    monkeypatch.setenv("KVSTORE_BENCH_GPU_TOKENS", "300")
    monkeypatch.setenv("KVSTORE_URL", "redis://:secret@cache:6379/0")  # a caller's own
    ctx = context(tmp_path)
    g1 = gpu_ttft.G1.run(ctx)
    (noted,) = [note for note in g1.notes if note.startswith("settings: ")]
    assert "KVSTORE_CUDA_LOCK_SPANS=auto" in noted.split()
    assert not any("KVSTORE_BENCH_" in note or "secret" in note for note in g1.notes)
    (row,) = g1.rows
    assert row.values["ours argmax agrees"] == 1.0 and row.values["mlx-lm argmax agrees"] == 1.0
    assert row.values["ours max |logit diff|"] == 0.0  # restored bit-exactly
    assert {c.status for c in evaluate(gpu_ttft.G1, g1)} <= {MET, MISSED}
    logged: list[str] = []
    ctx.log = logged.append
    g2 = gpu_ttft.G2.run(ctx)
    assert [r.params["policy"] for r in g2.rows] == ["lossless", "kv:quant:8:64"]
    # Each policy's figure logged as it is measured (a run cut short still shows it).
    said = [line for line in logged if "warm/cold" in line]
    assert [line.strip().split(": warm/cold ")[0] for line in said] == ["lossless", "kv:quant:8:64"]
    for line, row in zip(said, g2.rows, strict=True):
        assert f"warm/cold {row.values['warm/cold']:.4f}," in line
    assert g2.rows[1].values["bytes vs lossless"] < 0.6
    # And each session of it, phase by phase (the medians hide sessions in two groups).
    sessions = [line for line in logged if "kv:quant:8:64 session: total " in line]
    assert len(sessions) == ctx.repeats and all("; collections: " in s for s in sessions)
    g3 = gpu_save.G3.run(ctx)
    assert g3.rows[0].values["held ms"] > 0 and "tq/lossless" in g3.rows[0].values
    # The host's disk beside the bar: mlx-lm's save synced too, and ours against it.
    assert "mlx-lm save+fsync" in g3.rows[0].samples
    assert g3.rows[0].ratios["ours (durable) vs mlx-lm save+fsync"].median > 0
    # Every step taken while the writer commits, beside the one right after the hand-off.
    during = g3.rows[0].values
    assert during["longest step during save ms"] >= during["step during save ms"] > 0
    g4 = gpu_namespace.G4.run(ctx)
    assert g4.rows[0].values["directory cached ms"] > 0
    gpu_common.release_all()


def test_g3_at_two_lengths_compares_turboquant_at_the_shortest_only(tmp_path, monkeypatch):
    """The storage policies are saved at the shortest length; a longer row has no
    TurboQuant case (its ``tq/lossless`` raised KeyError on the device at 16384 tokens)."""
    from kvstore.bench.figures import gpu_common, gpu_save

    monkeypatch.setenv("KVSTORE_BENCH_GPU_TOKENS", "600,300")
    g3 = gpu_save.G3.run(context(tmp_path))
    short, long = g3.rows
    assert (short.params["tokens"], long.params["tokens"]) == (300, 600)
    assert "tq/lossless" in short.values and "tq/lossless" not in long.values
    assert "ours tq4/4 (durable)" not in long.samples
    assert long.values["durable save vs mlx-lm save"] > 0
    assert {c.status for c in evaluate(gpu_save.G3, g3)} <= {MET, MISSED}
    gpu_common.release_all()


def test_g1_rows_of_a_suffix_restore_the_rest_and_only_rows_of_one_are_judged(
    tmp_path, monkeypatch
):
    from kvstore.bench.figures import gpu_common, gpu_session, gpu_ttft

    monkeypatch.setattr(
        gpu_common, "RUN_SESSION", lambda spec: gpu_common.Session(**gpu_session.run(spec))
    )
    monkeypatch.setenv("KVSTORE_BENCH_GPU_TOKENS", "300")
    monkeypatch.setenv(gpu_ttft.SUFFIX_ENV, "20")
    ctx = context(tmp_path)
    g1 = gpu_ttft.G1.run(ctx)
    (row,) = g1.rows
    assert row.label == "llama8b 300 +20" and row.params["suffix"] == 20
    setup = gpu_common.setup_for(ctx, 300)
    assert {s.restored for s in setup.sessions["lossless +20"]} == {280}  # 20 computed
    assert {s.detail["suffix"] for s in setup.sessions["mlx-lm +20"]} == {20}
    assert row.values["ours argmax agrees"] == 1.0 and row.values["mlx-lm argmax agrees"] == 1.0
    assert evaluate(gpu_ttft.G1, g1)[0].status == NOT_MEASURED  # the bar is for suffix 1
    for bad in ("0", "x", ""):
        monkeypatch.setenv(gpu_ttft.SUFFIX_ENV, bad)
        with pytest.raises(ValueError, match=r"KVSTORE_BENCH_G1_SUFFIX=.*token counts of 1"):
            gpu_ttft.g1_suffixes()
    gpu_common.release_all()


def test_a_gpu_session_runs_in_a_fresh_interpreter(tmp_path):
    from kvstore.bench.figures import gpu_common

    setup = gpu_common.setup_for(context(tmp_path), 300)
    setup.prepare()
    session = gpu_common.spawn_session(setup.spec("ours"))
    assert session.restored == 299 and session.argmax_equal and session.max_abs_diff == 0.0
    assert 0 < session.detail["restore_call_s"] <= session.restore_s  # then evaluated
    collected = session.detail["collections"]  # what Python collected in the timed part
    assert all(g in (0, 1, 2) and t >= 0 for g, t in collected)
    line = gpu_common.session_line(session)
    assert line.startswith(f"total {1e3 * session.total_s:.1f}, ")
    # The forward's graph built apart from its evaluation (both inside forward_s).
    build = session.detail["forward_build_s"]
    assert 0 < build <= session.forward_s and session.detail["forward_build_cpu_s"] >= 0
    assert f"(built in {1e3 * build:.1f}, cpu " in line
    # The restoring thread's faults and context switches, counted where Linux counts them.
    usage = session.detail["restore_thread"]
    if sys.platform == "linux":
        assert set(usage) == {"faults", "waits", "preempted"}
        assert all(type(n) is int and n >= 0 for n in usage.values())
        assert f"faults {usage['faults']}, waits {usage['waits']}, " in line
    else:
        assert usage == {} and "faults" not in line
    gpu_common.release_all()


def test_g2_policies_narrow_by_name_and_refuse_unknown_ones(monkeypatch):
    from kvstore.bench.figures import gpu_ttft

    monkeypatch.delenv(gpu_ttft.POLICIES_ENV, raising=False)
    assert gpu_ttft.lossy_policies() == gpu_ttft.POLICIES
    monkeypatch.setenv(gpu_ttft.POLICIES_ENV, "kv:turboquant:3:3, kv:quant:8:64")
    assert gpu_ttft.lossy_policies() == ("kv:turboquant:3:3", "kv:quant:8:64")
    monkeypatch.setenv(gpu_ttft.POLICIES_ENV, "kv:quant:8:64,kv:quant:2:64")
    with pytest.raises(ValueError, match=r"names kv:quant:2:64; G2 measures kv:quant:8:64, "):
        gpu_ttft.lossy_policies()
    monkeypatch.setenv(gpu_ttft.POLICIES_ENV, " , ")
    with pytest.raises(ValueError, match="names no policy"):
        gpu_ttft.lossy_policies()


def test_d2_times_each_side_in_fresh_processes_holding_the_whole_prompt(tmp_path, monkeypatch):
    from kvstore.bench.figures import first_restore

    spawned = []
    real = first_restore.fresh_process

    def recorded(spec):
        spawned.append(spec["case"])
        return real(spec)

    monkeypatch.setattr(first_restore, "fresh_process", recorded)
    result = first_restore.FIGURE.run(context(tmp_path, sizes=Sizes(("gemma-swa",), (64,))))
    (row,) = result.rows  # one prompt length: no scaling row
    assert row.label == "gemma-swa 64"
    assert row.roles == {
        "ours first": "ours",
        "mlx-lm first": "peer",
        "ours first + step": "ours",
        "mlx-lm first + step": "peer",
    }
    assert [len(s) for s in row.samples.values()] == [5, 5, 5, 5]
    assert len(row.ratios["vs mlx-lm"].per_rep) == 5
    assert len(row.ratios["with the first step vs mlx-lm"].per_rep) == 5
    for case in ("ours first", "mlx-lm first"):  # the step timed after the restore
        assert all(
            stepped > alone
            for alone, stepped in zip(row.samples[case], row.samples[f"{case} + step"])
        )
    # In turn, the order swapped each repetition; every process held all 64 tokens
    # (fresh_process's reports are checked by the figure).
    # One untimed process of each first (the harness's warm-up round).
    assert spawned == ["ours", "mlx-lm"] + ["ours", "mlx-lm", "mlx-lm", "ours"] * 2 + [
        "ours",
        "mlx-lm",
    ]
    assert figure_status(evaluate(first_restore.FIGURE, result), result) == "reported"
    assert list(tmp_path.iterdir()) == []  # the store and the file removed


def test_d2_a_fresh_process_that_fails_says_which_and_why():
    from kvstore.bench.figures import first_restore

    spec = {"case": "mlx-lm", "file": "/nonexistent.safetensors", "workload": "qwen0.5b"}
    with pytest.raises(RuntimeError, match=r"D2's fresh mlx-lm process failed \(1\)"):
        first_restore.fresh_process({**spec, "tokens": 16})
