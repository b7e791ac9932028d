"""tools/demo_model: the demo model's training tool, end to end at toy scale on the CPU.

One toy run (a 0.3 MB corpus, 24 steps of 4 x 64 tokens) is trained and
exported once per module; the tests read its directory. The layout test puts
the tool's own decoder next to mlx-lm's and kvstore's on the same weights.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tools.demo_model import bpe
from tools.demo_model.corpus import HELD_OUT, read_corpus
from tools.demo_model.export import FILES
from tools.demo_model.model import PRESET_SHAPES, Llama, init_weights, quantized_bytes
from tools.demo_model.pipeline import run
from tools.demo_model.recipes import RECIPES
from tools.demo_model.train import TrainConfig, learning_rate
from tools.demo_model.verify import MAX_BYTES, ExportCheckError, check

pytest.importorskip("tokenizers")
TOY = PRESET_SHAPES["toy"]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """``(export directory, log lines)`` of one toy run, checked by the pipeline itself."""
    lines: list[str] = []
    out = run(RECIPES["toy"], "toy", tmp_path_factory.mktemp("toy") / "model", say=lines.append)
    return out, lines


def test_the_toy_run_exports_an_mlx_lm_directory(toy_run):
    out, lines = toy_run
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["eos_token_id"] == config["bos_token_id"] == 0
    assert config["training"]["steps"] == RECIPES["toy"].train.max_steps
    # the run checked its own export: both loaders, same logits, mlx-lm generated text
    assert not [line for line in lines if "FAILED" in line]
    assert any(line.startswith("check logits") for line in lines)
    assert any(line.startswith("check generate") for line in lines)
    assert (out / "train_log.txt").read_text().splitlines() == lines
    assert (
        "Retrain: `python -m tools.demo_model train --recipe toy" in (out / "README.md").read_text()
    )


def test_the_weights_are_four_bit_and_the_size_estimate_holds(toy_run):
    out, _ = toy_run
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32  # packed 4-bit
    assert weights["model.layers.0.mlp.down_proj.scales"].dtype == mx.bfloat16
    assert "lm_head.weight" not in weights  # tied
    size = (out / "model.safetensors").stat().st_size
    assert quantized_bytes(TOY) <= size <= quantized_bytes(TOY) + 16_384  # + the header


def test_the_shipped_shape_fits_the_budget():
    shape = RECIPES["h200"].shape
    assert quantized_bytes(shape) + 400_000 <= MAX_BYTES  # tokenizer.json is ~0.26 MB
    assert shape.parameters() == sum(v.size for _, v in tree_flatten(Llama(shape).parameters()))
    with pytest.raises(ValueError, match="multiple of 64"):
        quantized_bytes(PRESET_SHAPES["toy"].__class__(96, 1, 2, 1, 48, 128, 512, 64))


def test_check_refuses_an_export_over_budget(toy_run):
    out, _ = toy_run
    with pytest.raises(ExportCheckError, match="may weigh 1,000 bytes"):
        check(out, max_bytes=1000)


def test_the_tool_decoder_is_mlx_lm_llama(tmp_path):
    """Same weights, unquantized: the tool's logits are mlx-lm's and kvstore's."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from kvstore.model import load_model

    ours = Llama(TOY)
    init_weights(ours, seed=3)
    weights = dict(tree_flatten(ours.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp_path / "config.json").write_text(json.dumps(TOY.config()))
    tokens = mx.array([[0, 5, 9, 200, 17, 3, 3, 41]])
    expected = ours(tokens)
    theirs, _ = mlx_lm_load_model(tmp_path)
    kv, _ = load_model(tmp_path)
    for other in (theirs(tokens), kv(tokens)):
        assert mx.allclose(other, expected, atol=1e-4).item()


def test_the_corpus_holds_out_whole_packages():
    corpus = read_corpus(max_bytes=200_000)
    assert corpus.train and corpus.eval
    headers = [doc.split("\n", 1)[0] for doc in corpus.train + corpus.eval]
    assert all(h.startswith("# ---- ") and h.endswith(".py ----") for h in headers)
    package = [h.removeprefix("# ---- ").split("/")[0] for h in headers]
    assert set(package[len(corpus.train) :]) <= set(HELD_OUT)
    assert not set(package[: len(corpus.train)]) & set(HELD_OUT)


def test_the_corpus_names_whose_library_it_is(tmp_path):
    """The export records the library trained on, not the Python that ran the training
    (the shipped run: the device's 3.12 on a carried copy of 3.11's)."""
    import platform

    assert read_corpus(max_bytes=10_000).python == f"Python {platform.python_version()}"
    carried = tmp_path / "python3.11"
    (carried / "pkg").mkdir(parents=True)
    (carried / "pkg" / "mod.py").write_text("x = 1\n")
    assert read_corpus(carried, held_out=()).python == "Python 3.11"


def test_the_tokenizer_is_byte_level_with_a_document_marker():
    tokenizer = bpe.train_tokenizer(["def f(x):\n    return x\n"] * 50, 300)
    text = "naïve ✓\t\r\n\x00 — any text"
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id(bpe.EOT) == 0  # every document starts with it
    assert tokenizer.decode(ids) == text
    stream = bpe.encode_documents(tokenizer, ["a", "bc"])
    assert stream.dtype == np.int32 and list(stream[stream == 0]) == [0, 0]
    sizes = bpe.token_bytes(tokenizer)
    assert sizes[0] == 0 and sizes[ids[1:]].sum() == len(text.encode("utf-8"))


def test_the_schedule_warms_up_then_decays_to_its_floor():
    cfg = TrainConfig(batch_size=1, seq_len=8, learning_rate=1e-3, warmup_steps=10)
    rates = [learning_rate(step, 100, cfg) for step in range(101)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))  # cosine: never rises
    assert rates[100] == pytest.approx(1e-4)  # min_lr_ratio 0.1


def test_dropout_trains_only():
    tokens = mx.array([[0, 5, 9, 200, 17, 3]])
    plain, dropping = Llama(TOY), Llama(TOY, dropout=0.5)
    init_weights(plain, seed=1)
    dropping.update(plain.parameters())
    dropping.train()
    assert not mx.allclose(dropping(tokens), dropping(tokens)).item()
    dropping.eval()
    assert mx.array_equal(dropping(tokens), plain(tokens)).item()
