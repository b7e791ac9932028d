"""A cache family from a third-party distribution, end to end, with no edit to kvstore.

``tests/fixtures/fp8_plugin/`` is laid out as pip installs a distribution: the
package ``kvstore_fp8`` (families ``kv:fp8`` and ``kv:rotating-fp8``, their
caches and codecs) and ``kvstore_fp8-0.1.dist-info`` with two entry points in
the group ``kvstore.codecs``. The tests put that directory on ``sys.path``
(``PYTHONPATH`` for other processes); kvstore finds the family only through
its entry points. Before issue 14 such a family had no signature
(``signature_of(cache) is None``), so the model, ``store.save`` and
``restore`` refused it.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.cache import (
    family_of,
    is_sliding_window_cache,
    signature_of,
    signature_string,
    uses_dense_attention,
    uses_quantized_attention,
)
from kvstore.bridge.namespace import namespace_for_model
from kvstore.errors import UnknownSignatureError
from kvstore.model import CachePolicy
from kvstore.signature import parse_signature
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store.kv.policy import policy_kinds
from tests.test_cli.conftest import raw_items
from tests.test_store.kv_helpers import held_rows, model_for, prompt, token_by_token

from .worker import BLOCK, digests, fp8_policy

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "tests" / "fixtures" / "fp8_plugin"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT)])}
#: Both windowed and full-attention layers (window 32 = two blocks).
CONFIG = "tiny-gemma3"
TOKENS = prompt(7, 48)


def expected_signatures(model) -> list[str]:
    return [
        "kv:fp8" if layer["sliding_window"] is None else "kv:rotating-fp8"
        for layer in model.layer_layout()
    ]


@pytest.fixture
def fp8(registries_restored, monkeypatch):
    """The distribution on ``sys.path``, as if installed; forgotten afterwards."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    importlib.invalidate_caches()
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "kvstore_fp8"]:
        del sys.modules[name]


def in_another_process(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def kvstore_cli(*args: str) -> dict:
    return json.loads(in_another_process("-m", "kvstore.cli", *args, "--json"))


def test_kvstore_itself_knows_nothing_of_the_family():
    sources = (ROOT / "kvstore").rglob("*.py")
    assert [p for p in sources if "kv:fp8" in p.read_text() or "kvstore_fp8" in p.read_text()] == []


def test_without_the_distribution_the_kind_is_unknown(registries_restored):
    with pytest.raises(UnknownSignatureError, match="'kv:fp8'"):
        parse_signature("kv:fp8")
    with pytest.raises(UnknownSignatureError):
        CachePolicy(family="kv:fp8")


def test_the_cache_policy_builds_it_and_the_model_attends_through_the_predicates(fp8):
    model = model_for(CONFIG)
    caches = model.make_cache(CachePolicy(family="kv:fp8"))
    assert [str(signature_of(c)) for c in caches] == expected_signatures(model)
    assert [is_sliding_window_cache(c) for c in caches] == [
        layer["sliding_window"] is not None for layer in model.layer_layout()
    ]
    assert all(uses_dense_attention(c) and not uses_quantized_attention(c) for c in caches)
    assert family_of(caches[0]).description.startswith("8-bit float rows")
    logits = model(mx.array([TOKENS]), cache=caches)
    for t in (3, 1, 4):  # decode steps: the windowed layers' rings wrap
        logits = mx.concatenate([logits, model(mx.array([[t]]), cache=caches)], axis=1)
    reference = model(mx.array([TOKENS + [3, 1, 4]]), cache=model.make_cache())
    err = mx.abs(logits - reference).max().item() / mx.abs(reference).max().item()
    assert 0 < err < 0.1  # the rows really are 8-bit floats, and close


def test_save_lookup_restore_across_processes_bit_exactly(fp8, tmp_path):
    model = model_for(CONFIG)
    caches = token_by_token(model, TOKENS, fp8_policy())
    url = f"lmdb://{tmp_path / 'store'}"
    with open_store(url, block_size=BLOCK) as store:
        saved = store.save(namespace_for_model(model), TOKENS, caches)
    assert len(saved.written) == len(TOKENS) // BLOCK
    out = json.loads(
        in_another_process(
            "-m", "tests.test_plugin.worker", "restore", url, CONFIG, json.dumps(TOKENS + [9])
        )
    )
    assert out["restored"] == len(TOKENS)
    assert out["signatures"] == expected_signatures(model)
    assert out["digests"] == digests(caches)  # the other process holds this one's rows


def test_it_is_a_storage_policy(fp8, tmp_path):
    model = model_for(CONFIG)
    plain = token_by_token(model, TOKENS)
    url = f"lmdb://{tmp_path / 'store'}"
    ns = namespace_for_model(model)
    with open_store(url, block_size=BLOCK, storage_policy="kv:fp8") as store:
        assert "kv:fp8" in policy_kinds()  # found when the store named it
        store.save(ns, TOKENS, plain)
        assert set(store.stats(by_family=True).by_family) == {"kv:fp8+kv:rotating-fp8"}
        restored = store.restore(store.lookup(ns, TOKENS + [9]), model.make_cache())
    assert [signature_string(c) for c in restored] == [signature_string(c) for c in plain]
    assert restored[0].offset == len(TOKENS)
    for got, want in zip(restored, plain):  # decoded from 8-bit floats: close, not equal
        for (_, _, g), (_, _, w) in zip(held_rows(got), held_rows(want), strict=True):
            for name in w:
                err = np.abs(g[name] - w[name]).max() / np.abs(w[name]).max()
                assert 0 < err < 0.1, name
    stats = kvstore_cli("stats", url)
    assert stats["settings"]["storage_policy"] == "kv:fp8"
    assert stats["by_family"] == {"kv:fp8+kv:rotating-fp8": stats["bytes"]}


def test_migrate_to_it_and_inspect_name_it(fp8, tmp_path):
    model = model_for(CONFIG)
    src, dst = tmp_path / "src", tmp_path / "dst"
    with open_store(f"lmdb://{src}", block_size=BLOCK) as store:
        store.save(namespace_for_model(model), TOKENS, token_by_token(model, TOKENS))
    report = kvstore_cli("migrate", str(src), str(dst), "--to", "kv:fp8", "--no-progress")
    assert {(c["source"], c["target"], c["lossy"]) for c in report["conversions"]} == {
        ("kv:plain", "kv:fp8", True),
        ("kv:rotating-plain", "kv:rotating-fp8", True),
    }
    stats = kvstore_cli("stats", str(dst))
    assert stats["settings"]["storage_policy"] == "kv:fp8"
    labels = {part for label in stats["by_family"] for part in label.split("+")}
    assert labels == {"kv:fp8", "kv:rotating-fp8"}
    key = next(k for k in raw_items(dst) if K.split_record_key(k))
    block = kvstore_cli("inspect", str(dst), key.decode())
    names = [layer["signature"] for layer in block["header"]["layers"] if layer]
    assert set(names) <= {"kv:fp8", "kv:rotating-fp8"} and "kv:fp8" in names
    # The migrated store restores into the plug-in's caches in this process too.
    with open_store(f"lmdb://{dst}", readonly=True) as store:
        restored = store.restore(
            store.lookup(namespace_for_model(model), TOKENS + [9]), model.make_cache(fp8_policy())
        )
    assert restored[0].offset == len(TOKENS)
    assert [signature_string(c) for c in restored] == expected_signatures(model)
