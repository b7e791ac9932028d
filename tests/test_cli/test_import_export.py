"""``kvstore import`` / ``kvstore export``: mlx-lm prompt-cache files written by the
installed mlx-lm go into a store, and come back out as files stock
``load_prompt_cache`` loads, giving the same next-token logits in the mlx-lm model.
Any mlx-lm since 0.28.1: 0.32's layout or, with 0.31 (Python 3.10), the legacy one."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as lm_cache  # noqa: E402

from kvstore.bridge import generate_tokens  # noqa: E402
from kvstore.cli import main  # noqa: E402
from kvstore.codecs.prompt_cache import import_prompt_cache, installed_file_layout  # noqa: E402
from kvstore.errors import StoreConfigError  # noqa: E402
from kvstore.model import CachePolicy, build_model, load_model  # noqa: E402
from kvstore.store import keys as K  # noqa: E402
from kvstore.store import namespace_for_model, open_store  # noqa: E402
from kvstore.store.maintenance.cache_files import export_cache_file  # noqa: E402
from kvstore.testing.codec import assert_arrays_equal, assert_snapshots_equal  # noqa: E402
from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model  # noqa: E402

from ..test_model.conftest import save_mlx_lm_dir  # noqa: E402
from .conftest import kvstore_cli, raw_items  # noqa: E402
from .test_bad_input import check_one_line  # noqa: E402

PROMPT = 70
#: How import names the layout of the files the installed mlx-lm writes (0.31, on Python
#: 3.10, writes the legacy one): each test runs with either.
WRITTEN_LAYOUT = {"current": "current layout", "legacy": "legacy layout, mlx-lm <= 0.31"}[
    installed_file_layout()
]
#: Block size of the test stores (URL option), so prompts span several blocks.
BLOCK = 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(mlx-lm model, its model directory)."""
    model = build_mlx_lm_model("llama")
    path = save_mlx_lm_dir(tmp_path_factory.mktemp("llama") / "llama", model, TINY_ARGS["llama"])
    return model, path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Sliding-window layers (window 16) between global ones."""
    model = build_mlx_lm_model("gemma3_text")
    path = save_mlx_lm_dir(
        tmp_path_factory.mktemp("gemma") / "gemma", model, TINY_ARGS["gemma3_text"]
    )
    return model, path


def prompt_ids(n: int = PROMPT, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def stock_caches(model, family: str) -> list:
    if family == "quant-8-64":
        return [lm_cache.QuantizedKVCache(64, 8) for _ in model.layers]
    return lm_cache.make_prompt_cache(model)


def write_prompt_cache(tmp_path, model, family: str = "plain", n: int = PROMPT):
    """A prompt cache written by the installed mlx-lm: (file, tokens file, tokens, caches)."""
    tokens = prompt_ids(n)
    caches = stock_caches(model, family)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    path = tmp_path / f"{family}.safetensors"
    lm_cache.save_prompt_cache(str(path), caches, {"written_by": "mlx-lm"})
    tokens_file = tmp_path / f"{family}-tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    return path, tokens_file, tokens, caches


def next_logits(model, caches, tokens=(7, 9, 11)) -> list[mx.array]:
    """Next-token logits as the cache is extended one token at a time."""
    out = []
    for t in tokens:
        out.append(model(mx.array([[t]]), cache=caches)[:, -1, :])
    mx.eval(out)
    return out


def store_url(path) -> str:
    return f"lmdb://{path}?block_size={BLOCK}"


def run_ok(capsys, argv: list[str]) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def import_file(capsys, file, tokens_file, store, model_dir, *extra: str) -> str:
    """``kvstore import FILE --model DIR`` into ``store`` (a new one: 16-token blocks)."""
    argv = ["import", str(file), "--model", str(model_dir), "--tokens", str(tokens_file)]
    return run_ok(capsys, [*argv, "--store", store_url(store), *extra])


def export_file(capsys, store, namespace, tokens_file, out, *extra: str) -> str:
    argv = ["export", str(store), "-n", namespace, "--tokens", str(tokens_file)]
    return run_ok(capsys, [*argv, "--out", str(out), *extra])


def only_namespace(capsys, store) -> str:
    """The one namespace ``kvstore ls`` lists."""
    (entry,) = json.loads(run_ok(capsys, ["ls", str(store), "--json"]))["namespaces"]
    return entry["namespace"]


def records(path) -> dict[bytes, bytes]:
    """The store's block records (keys and bytes), nothing else."""
    return {k: v for k, v in raw_items(path).items() if K.split_record_key(k)}


@pytest.mark.parametrize("family", ["plain", "quant-8-64"])
def test_import_then_export_gives_stock_mlx_lm_the_same_logits(llama, tmp_path, capsys, family):
    model, model_dir = llama
    file, tokens_file, tokens, original = write_prompt_cache(tmp_path, model, family)
    store = tmp_path / "store"
    out = import_file(capsys, file, tokens_file, store, model_dir)
    assert f"(mlx-lm prompt cache ({WRITTEN_LAYOUT}): {PROMPT} tokens, 2 layers" in out
    assert f"a lookup of these tokens restores {PROMPT} of them" in out
    namespace = namespace_for_model(model_dir, caches=import_prompt_cache(file).caches())
    assert f"into namespace {namespace} of" in out

    exported = tmp_path / "exported.safetensors"
    out = export_file(capsys, store, namespace, tokens_file, exported)
    assert f"exported {PROMPT} of the {PROMPT} tokens" in out and str(exported) in out
    loaded, meta = lm_cache.load_prompt_cache(str(exported), return_metadata=True)
    assert meta == {"kvstore_namespace": namespace, "kvstore_tokens": str(PROMPT)}
    assert [type(c) for c in loaded] == [type(c) for c in original]
    for want, got in zip(next_logits(model, original), next_logits(model, loaded), strict=True):
        assert_arrays_equal(want, got, "next-token logits")

    # The namespace --model computed is the one a kvstore session of that model uses:
    # generate reuses the imported prompt.
    ours, _ = load_model(model_dir)
    policy = CachePolicy(kv_bits=8, kv_group_size=64) if family == "quant-8-64" else None
    with open_store(str(store)) as opened:
        _, stats = generate_tokens(ours, tokens + [5], store=opened, policy=policy, max_tokens=1)
    assert stats.reused_tokens == PROMPT and stats.store_error is None


def test_round_trips_import_export_import(llama, tmp_path, capsys):
    model, model_dir = llama
    file, tokens_file, _, _ = write_prompt_cache(tmp_path, model)
    first, again, snapshots = tmp_path / "first", tmp_path / "again", tmp_path / "snapshots"
    import_file(capsys, file, tokens_file, first, model_dir)
    namespace = only_namespace(capsys, first)
    back = tmp_path / "back.safetensors"
    export_file(capsys, first, namespace, tokens_file, back)
    export_file(capsys, first, namespace, tokens_file, tmp_path / "snap", "--format", "kvstore")
    # The exported file holds what the original held, row for row ...
    for want, got in zip(
        import_prompt_cache(file).layers, import_prompt_cache(back).layers, strict=True
    ):
        assert_snapshots_equal(want, got)
    # ... and imported again (both formats), it makes the same records, bit for bit.
    import_file(capsys, back, tokens_file, again, model_dir)
    snap = tmp_path / "snap.safetensors"  # the suffix was added
    assert "(kvstore snapshot file:" in import_file(capsys, snap, tokens_file, snapshots, model_dir)
    assert records(first) == records(again) == records(snapshots)
    assert len(records(first)) == -(-PROMPT // BLOCK)


def test_importing_a_stored_prompt_again_writes_nothing(llama, tmp_path, capsys):
    model, model_dir = llama
    file, tokens_file, _, _ = write_prompt_cache(tmp_path, model)
    store = tmp_path / "store"
    import_file(capsys, file, tokens_file, store, model_dir)
    namespace = only_namespace(capsys, store)
    # --namespace names it directly the second time
    argv = ["import", str(file), "-n", namespace, "--tokens", str(tokens_file)]
    out = run_ok(capsys, [*argv, "--store", str(store)])
    assert f"0 blocks written (0 B), {-(-PROMPT // BLOCK)} already stored" in out
    report = json.loads(run_ok(capsys, [*argv, "--store", str(store), "--json"]))
    assert report["saved"]["deduplicated"] == -(-PROMPT // BLOCK) and report["served"] == PROMPT


def test_sliding_window_caches_round_trip(gemma, tmp_path, capsys):
    """Sliding layers (window 16) past their window keep the blocks their window holds."""
    model, model_dir = gemma
    file, tokens_file, _, original = write_prompt_cache(tmp_path, model, n=64)
    store = tmp_path / "store"
    out = import_file(capsys, file, tokens_file, store, model_dir)
    assert "kv:rotating-plain" in out and "restores 64 of them" in out
    exported = tmp_path / "exported.safetensors"
    export_file(capsys, store, only_namespace(capsys, store), tokens_file, exported)
    loaded = lm_cache.load_prompt_cache(str(exported))
    assert [type(c) for c in loaded] == [type(c) for c in original]
    for want, got in zip(next_logits(model, original), next_logits(model, loaded), strict=True):
        assert_arrays_equal(want, got, "next-token logits")


def test_export_of_a_longer_prompt_covers_the_stored_prefix(llama, tmp_path, capsys):
    model, model_dir = llama
    file, tokens_file, tokens, _ = write_prompt_cache(tmp_path, model)
    store = tmp_path / "store"
    import_file(capsys, file, tokens_file, store, model_dir)
    longer = tmp_path / "longer.txt"
    longer.write_text(" ".join(map(str, tokens + [1, 2, 3])))
    out = tmp_path / "x.safetensors"
    report = json.loads(
        export_file(capsys, store, only_namespace(capsys, store), longer, out, "--json")
    )
    assert report["tokens"] == PROMPT and report["requested"] == PROMPT + 3


def write_legacy_prompt_cache(path, caches, metadata) -> None:
    """A prompt-cache file as mlx-lm <= 0.31 wrote it: (keys, values) cut to the
    offset, then [meta_state per cache, user metadata, class names]."""
    states = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    info = ["" for _ in caches]  # KVCache's meta_state was ""
    meta = dict(tree_flatten([info, metadata, [type(c).__name__ for c in caches]]))
    mx.save_safetensors(str(path), dict(tree_flatten(states)), meta)


def test_import_of_the_older_mlx_lm_layout(llama, tmp_path, capsys):
    model, model_dir = llama
    _, tokens_file, _, original = write_prompt_cache(tmp_path, model)
    legacy = tmp_path / "legacy.safetensors"
    write_legacy_prompt_cache(legacy, original, {"written_by": "mlx-lm 0.31"})
    store = tmp_path / "store"
    out = import_file(capsys, legacy, tokens_file, store, model_dir)
    assert "(mlx-lm prompt cache (legacy layout, mlx-lm <= 0.31): 70 tokens" in out
    exported = tmp_path / "exported.safetensors"
    export_file(capsys, store, only_namespace(capsys, store), tokens_file, exported)
    loaded = lm_cache.load_prompt_cache(str(exported))
    for want, got in zip(next_logits(model, original), next_logits(model, loaded), strict=True):
        assert_arrays_equal(want, got, "next-token logits")


def test_families_mlx_lm_lacks_export_as_snapshot_files(tmp_path, capsys):
    """TurboQuant caches: no mlx-lm class, so only --format kvstore, which imports back."""
    model = build_model("tiny", seed=0)
    tokens = prompt_ids(40)
    store = tmp_path / "store"
    with open_store(store_url(store)) as opened:
        generate_tokens(
            model, tokens, store=opened, policy=CachePolicy(turboquant=(4, 4)), max_tokens=1
        )
    namespace = only_namespace(capsys, store)
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    out = tmp_path / "tq.safetensors"
    argv = ["export", str(store), "-n", namespace, "--tokens", str(tokens_file), "--out", str(out)]
    check_one_line(
        capsys, argv, "kv:turboquant:4:4", "mlx-lm has no cache class", "--format kvstore"
    )
    assert not out.exists()
    report = json.loads(run_ok(capsys, [*argv, "--format", "kvstore", "--json"]))
    assert report["tokens"] == 40 and set(report["families"]) == {"kv:turboquant:4:4"}
    before = records(store)
    again = run_ok(
        capsys,
        ["import", str(out), "-n", namespace, "--tokens", str(tokens_file), "--store", str(store)],
    )
    assert "(kvstore snapshot file: 40 tokens" in again and "0 blocks written" in again
    assert records(store) == before


# ---------------------------------------------------------------- bad input


@pytest.fixture
def imported(llama, tmp_path, capsys):
    """(store path, namespace, mlx-lm file, its tokens file) after one import."""
    model, model_dir = llama
    file, tokens_file, _, _ = write_prompt_cache(tmp_path, model)
    store = tmp_path / "store"
    import_file(capsys, file, tokens_file, store, model_dir)
    return store, only_namespace(capsys, store), file, tokens_file


def test_export_writes_the_layout_asked_and_by_default_the_installed_mlx_lm_s(
    imported, tmp_path, capsys
):
    store, namespace, file, tokens_file = imported
    legacy, current = tmp_path / "legacy.safetensors", tmp_path / "current.safetensors"
    out = export_file(capsys, store, namespace, tokens_file, legacy, "--mlx-lm-layout", "legacy")
    assert "load_prompt_cache(path) (mlx-lm 0.28.1 to 0.31)" in out
    out = export_file(capsys, store, namespace, tokens_file, current, "--mlx-lm-layout", "current")
    assert "load_prompt_cache(path) (mlx-lm >= 0.32)" in out
    # The same rows in either layout, and the rows the imported file held.
    want = import_prompt_cache(file)
    for path, layout in ((legacy, "legacy"), (current, "current")):
        got = import_prompt_cache(path)
        assert got.layout == layout
        for a, b in zip(want.layers, got.layers, strict=True):
            assert_snapshots_equal(a, b)
    # Without the option: the layout the installed mlx-lm loads, named in --json too.
    auto = tmp_path / "auto.safetensors"
    argv = ["export", str(store), "-n", namespace, "--tokens", str(tokens_file)]
    report = json.loads(run_ok(capsys, [*argv, "--out", str(auto), "--json"]))
    assert report["layout"] == installed_file_layout() == import_prompt_cache(auto).layout
    lm_cache.load_prompt_cache(str(auto))  # the installed mlx-lm loads it
    snapshot = tmp_path / "snapshot.safetensors"
    report = json.loads(
        run_ok(capsys, [*argv, "--out", str(snapshot), "--format", "kvstore", "--json"])
    )
    assert report["layout"] is None


def test_import_bad_input(imported, llama, tmp_path, capsys):
    store, namespace, file, tokens_file = imported
    _, model_dir = llama
    into = ["-n", namespace, "--tokens", str(tokens_file), "--store", str(store)]
    check_one_line(
        capsys, ["import", str(tmp_path / "none.safetensors"), *into], "No file at", "mlx-lm"
    )
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    check_one_line(
        capsys,
        ["import", str(text), *into],
        "is not an mlx-lm prompt-cache file (save_prompt_cache) or a kvstore snapshot file",
        "not a readable safetensors file",
    )
    weights = model_dir / "model.safetensors"  # a safetensors file, but model weights
    check_one_line(capsys, ["import", str(weights), *into], "No mlx-lm prompt-cache metadata")
    short = tmp_path / "short.json"
    short.write_text(json.dumps(prompt_ids(PROMPT - 1)))
    check_one_line(
        capsys,
        ["import", str(file), "-n", namespace, "--tokens", str(short), "--store", str(store)],
        f"holds the KV of {PROMPT} tokens",
        f"has {PROMPT - 1} token ids",
        "Give exactly the token ids",
    )
    check_one_line(
        capsys,
        ["import", str(file), "-n", "nope", "--tokens", str(tokens_file), "--store", str(store)],
        "has no namespace 'nope'",
        "kvstore ls",
    )
    fresh = tmp_path / "fresh"
    check_one_line(
        capsys,
        ["import", str(file), "-n", namespace, "--tokens", str(tokens_file)]
        + ["--store", str(fresh)],
        "No store at",
    )
    assert not fresh.exists()


def test_import_into_the_wrong_model_is_refused(imported, gemma, tmp_path, capsys):
    _, _, file, tokens_file = imported
    _, gemma_dir = gemma
    store = tmp_path / "new-store"
    check_one_line(
        capsys,
        ["import", str(file), "--model", str(gemma_dir), "--tokens", str(tokens_file)]
        + ["--store", str(store)],
        "(2 layers, KV heads [2, 2]) do not fit the model",
        "(4 layers",
    )
    assert not store.exists()  # nothing created for a refused import


def test_import_into_a_namespace_of_another_layer_count(imported, gemma, tmp_path, capsys):
    store, namespace, _, _ = imported
    model, _ = gemma
    file, tokens_file, _, _ = write_prompt_cache(tmp_path, model, n=32)
    check_one_line(
        capsys,
        ["import", str(file), "-n", namespace, "--tokens", str(tokens_file)]
        + ["--store", str(store)],
        f"Namespace {namespace} holds records of 2 layers",
        "has 4",
    )


def test_export_bad_input(imported, tmp_path, capsys):
    store, namespace, _, tokens_file = imported
    out = str(tmp_path / "out.safetensors")
    check_one_line(
        capsys,
        ["export", str(store), "-n", "nope", "--tokens", str(tokens_file), "--out", out],
        "has no namespace 'nope'",
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps(prompt_ids(PROMPT, seed=9)))
    check_one_line(
        capsys,
        ["export", str(store), "-n", namespace, "--tokens", str(other), "--out", out],
        "holds no prefix of these 70 tokens",
        "kvstore inspect",
    )
    check_one_line(
        capsys,
        ["export", str(tmp_path / "nowhere"), "-n", namespace, "--tokens", str(tokens_file)]
        + ["--out", out],
        "No store at",
    )
    with open_store(str(store)) as opened, pytest.raises(StoreConfigError) as info:
        export_cache_file(opened, namespace, json.loads(tokens_file.read_text()), out, layout="v0")
    assert "[export] layout is one of current, legacy; received 'v0'." in str(info.value)
    assert info.value.supported == ["current", "legacy"]
    assert not (tmp_path / "out.safetensors").exists()


def test_bad_import_as_a_subprocess(imported, tmp_path):
    store, namespace, file, _ = imported
    short = tmp_path / "short.txt"
    short.write_text("1 2 3")
    done = kvstore_cli(
        "import", str(file), "-n", namespace, "--tokens", str(short), "--store", str(store)
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "holds the KV of 70 tokens" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
