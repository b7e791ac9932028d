"""Issue 17, item 2: the sensitivity sweep and the layout it chooses (``kvstore tune``)."""

import itertools
import math
import random

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.model import CachePolicy, build_model, load_model
from kvstore.model.tune import (
    Budget,
    candidate_signatures,
    choose_layout,
    layer_bytes_per_token,
    parse_budget,
    text_windows,
    tune,
)

from .conftest import save_mlx_lm_dir

GLOBAL = {"n_kv_heads": 2, "head_dim": 64, "sliding_window": None}
SMALL_RUN = {"windows": 2, "prefill": 48, "continuation": 16}
CANDIDATES = ["kv:quant:4:64", "kv:quant:8:64", "kv:turboquant:3:3", "kv:turboquant:2:2"]


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("4.5", Budget(4.5, "bits")),
        ("3.125bits", Budget(3.125, "bits")),
        ("1152B", Budget(1152, "bytes")),
        ("2KiB", Budget(2048, "bytes")),
        ("1.5 kb/token", Budget(1500, "bytes")),
    ],
)
def test_a_budget_is_bits_per_value_or_bytes_per_token(text, budget):
    assert parse_budget(text) == budget


@pytest.mark.parametrize("bad", ["", "0", "-3", "4.5 apples", "bits"])
def test_other_budgets_are_refused(bad):
    with pytest.raises(ValueError, match=r"\[tune\] --budget"):
        parse_budget(bad)


def test_bits_per_value_come_from_what_each_familys_cache_stores():
    values = 2 * 2 * 64
    bits = {s: layer_bytes_per_token(s, GLOBAL) * 8 / values for s in CANDIDATES + ["kv:plain"]}
    assert bits == {
        "kv:quant:4:64": 4.5,
        "kv:quant:8:64": 8.5,
        "kv:turboquant:3:3": 3.25,  # b + 16/D
        "kv:turboquant:2:2": 2.25,
        "kv:plain": 16.0,
    }
    # 5-bit keys (issue 17) add one bit per key value and nothing else: (5.25 + 4.25) / 2.
    assert layer_bytes_per_token("kv:turboquant:5:4", GLOBAL) * 8 / values == 4.75
    assert layer_bytes_per_token("kv:quant:4:128", GLOBAL) is None  # the group does not fit


def test_candidates_are_every_registered_growing_family_plain_first():
    every = candidate_signatures()
    assert every[0] == "kv:plain" and "kv:rotating-plain" not in every
    assert {"kv:quant:2:32", "kv:quant:8:128", "kv:turboquant:4:2"} <= set(every)
    assert candidate_signatures(["kv:turboquant", "kv:quant:4:64"]) == sorted(
        [f"kv:turboquant:{k}:{v}" for k in (2, 3, 4, 5) for v in (2, 3, 4, 5)] + ["kv:quant:4:64"]
    )
    with pytest.raises(ValueError, match="Unknown candidate"):
        candidate_signatures(["kv:nope"])


def brute_force(costs, kls, budget):
    best = None
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(c[j] for c, j in zip(costs, pick))
        kl = sum(k[j] for k, j in zip(kls, pick))
        if cost <= budget and (best is None or (kl, cost) < best[:2]):
            best = (kl, cost, list(pick))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_finds_the_least_summed_kl_within_the_budget(seed):
    rng = random.Random(seed)
    layers, options = rng.randint(1, 5), rng.randint(1, 5)
    costs = [[rng.randint(1, 20) for _ in range(options)] for _ in range(layers)]
    kls = [[rng.choice([0.0, rng.random()]) for _ in range(options)] for _ in range(layers)]
    budget = rng.randint(layers, 20 * layers)
    got = choose_layout(costs, kls, budget)
    expected = brute_force(costs, kls, budget)
    if expected is None:
        assert got is None
        return
    assert sum(c[j] for c, j in zip(costs, got)) <= budget
    assert math.isclose(sum(k[j] for k, j in zip(kls, got)), expected[0], abs_tol=1e-12)


def test_a_greedy_exchange_would_stop_short_where_the_knapsack_does_not():
    # Greedy by KL saved per byte takes layer 1's step (0.15/B) first, and then cannot
    # afford layer 0's (0.1/B, 10 B): KL 1.35. The optimum spends it all on layer 0: 0.5.
    costs = [[0, 10], [0, 1]]
    kls = [[1.0, 0.0], [0.5, 0.35]]
    assert choose_layout(costs, kls, 10) == [1, 0]


def test_windows_are_evenly_spaced_and_a_short_text_is_refused():
    windows = text_windows(range(100), 3, 40)
    assert [int(w[0]) for w in windows] == [0, 30, 60] and {len(w) for w in windows} == {40}
    with pytest.raises(ValueError, match="one window needs 40"):
        text_windows(range(30), 2, 40)


@pytest.fixture(scope="module")
def gemma():
    return build_model("tiny-gemma3", seed=2)


@pytest.fixture(scope="module")
def text():
    return np.random.default_rng(0).integers(0, 256, 400).tolist()


def test_tune_chooses_within_the_budget_and_measures_the_choice(gemma, text):
    result = tune(gemma, text, Budget(4.0, "bits"), candidates=CANDIDATES, **SMALL_RUN)
    assert result.bits_per_value() <= 4.0
    assert set(result.choice) == {0, 1, 2} and set(result.choice.values()) <= {
        "kv:plain",
        *CANDIDATES,
    }
    for i in result.choice:
        assert result.sweep.kl[i]["kv:plain"] == 0.0
        assert all(kl >= 0 for kl in result.sweep.kl[i].values())
    assert result.measured.kl >= 0 and 0 <= result.measured.top1 <= 1
    # The uniform comparisons are the best of each kind within the budget.
    assert set(result.uniform) <= set(CANDIDATES)
    assert all(result.uniform_bits(s) <= 4.0 for s in result.uniform)
    caches = gemma.make_cache(result.policy)
    assert [c.signature().replace("rotating-", "") for c in caches] == [
        result.choice[i] for i in range(3)
    ]


def test_a_generous_budget_keeps_every_layer_plain(gemma, text):
    result = tune(gemma, text, Budget(16, "bits"), candidates=CANDIDATES[:1], **SMALL_RUN)
    assert set(result.choice.values()) == {"kv:plain"} and result.measured.kl == 0.0


def test_a_budget_below_every_candidate_says_the_least_it_can(gemma, text):
    with pytest.raises(ValueError, match=r"cheapest candidates cost .* \(2\.250 bits"):
        tune(gemma, text, Budget(2.0, "bits"), candidates=CANDIDATES, **SMALL_RUN)


def test_kvstore_tune_prints_the_table_and_writes_a_layout_file(tmp_path, capsys):
    model = build_model("tiny", seed=1)
    path = save_mlx_lm_dir(tmp_path / "m", model, model.config)
    (tmp_path / "text.txt").write_bytes(bytes(range(256)) * 2)
    out = tmp_path / "layout.json"
    argv = ["tune", str(path), "--budget", "4.5", "--text", str(tmp_path / "text.txt")]
    argv += ["--candidates", "kv:quant:4:64,kv:turboquant:3:3", "--out", str(out)]
    argv += ["--windows", "2", "--prefill", "64", "--continuation", "16", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "next-token KL" in printed and "layer 1" in printed and "wrote" in printed
    policy = CachePolicy.from_file(out)
    loaded, _ = load_model(path)
    assert len(loaded.make_cache(policy)) == 2
    assert main([*argv[:3], "7 apples", *argv[4:]]) == 2
    assert "--budget takes" in capsys.readouterr().err
    # Several budgets share one sweep, each into its own file.
    assert main([*argv[:3], "3.5,600B", *argv[4:]]) == 0
    printed = capsys.readouterr().out
    assert printed.count("next-token KL") == 1 and printed.count("wrote") == 2
    assert (tmp_path / "layout-3.5.json").is_file() and (tmp_path / "layout-600B.json").is_file()
    assert main([*argv[:3], "1.0", *argv[4:]]) == 2  # refused before the sweep
    assert "No layout meets" in capsys.readouterr().err
