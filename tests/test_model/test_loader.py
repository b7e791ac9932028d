"""Loading mlx-lm model directories: real and tiny models, shards, tokenizers, errors."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from kvstore.errors import CapabilityError, ModelLoadError
from kvstore.model import SUPPORTED_MODEL_TYPES, Tokenizer, load_model
from kvstore.model.tokenizer import load_tokenizer

from .conftest import rel_err, save_mlx_lm_dir

PYCODE = Path("/work/shared/fixtures/pycode-lm")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("mlx_lm")
    from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model

    path = tmp_path_factory.mktemp("tiny") / "llama"
    return save_mlx_lm_dir(path, build_mlx_lm_model("llama"), TINY_ARGS["llama"])


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def logits(model, n=48):
    tokens = mx.arange(n)[None] % 256
    return model(tokens, cache=model.make_cache())


@pytest.mark.skipif(not PYCODE.is_dir(), reason="pycode-lm fixture not present")
def test_pycode_lm_loads_and_matches_mlx_lm():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load_model

    ours, tokenizer = load_model(PYCODE)
    theirs, _ = mlx_lm_load_model(PYCODE)
    assert tokenizer is None  # byte-level: the directory ships no tokenizer
    assert ours.source_path == PYCODE.resolve()
    assert ours.config == json.loads((PYCODE / "config.json").read_text())
    assert ours.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert ours.layer_layout() == [{"n_kv_heads": 2, "head_dim": 128, "sliding_window": None}] * 4
    text = (PYCODE / "heldout.txt").read_bytes()[:96]
    tokens = mx.array(list(text))[None]
    expected = theirs(tokens, cache=make_prompt_cache(theirs))
    got = ours(tokens, cache=ours.make_cache())
    assert rel_err(got.astype(mx.float32), expected.astype(mx.float32)) <= 1e-5
    # A trained model predicts its held-out text far better than chance (8 bits/byte).
    nll = -mx.take_along_axis(
        got[0, :-1].astype(mx.float32) - mx.logsumexp(got[0, :-1].astype(mx.float32), -1, True),
        tokens[0, 1:, None],
        axis=-1,
    ).mean()
    assert nll.item() < 2.5


def test_sharded_equals_single_file(tiny_dir, tmp_path):
    from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model

    sharded = save_mlx_lm_dir(
        tmp_path / "sharded", build_mlx_lm_model("llama"), TINY_ARGS["llama"], shards=3
    )
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    single, _ = load_model(tiny_dir)
    split, _ = load_model(sharded)
    assert mx.array_equal(logits(single), logits(split)).item()


def test_dtype_cast(tiny_dir):
    model, _ = load_model(tiny_dir, dtype=mx.bfloat16)
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_unsupported_model_type_lists_supported(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_config(path, model_type="mamba")
    with pytest.raises(CapabilityError) as info:
        load_model(path)
    msg = str(info.value)
    assert msg.startswith("[load_model]") and "'mamba'" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)
    assert info.value.found == "mamba" and info.value.supported == list(SUPPORTED_MODEL_TYPES)


def test_unsupported_rope_type(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_config(path, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(CapabilityError, match="rope type 'longrope' is not supported"):
        load_model(path)


@pytest.mark.parametrize(
    "quantization, match",
    [
        ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "mode 'mxfp4'"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "method 'awq'"),
    ],
)
def test_unsupported_weight_quantization(tiny_dir, tmp_path, quantization, match):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_config(path, **quantization)
    with pytest.raises(CapabilityError, match=match):
        load_model(path)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(tmp_path / "nope")
    assert isinstance(info.value, ValueError) and info.value.path == tmp_path / "nope"


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path)


def test_unreadable_config(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        load_model(path)


def test_no_weights(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"No model\*.safetensors"):
        load_model(path)


def test_index_naming_a_missing_shard(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "model-00002-of-00002.safetensors" for name in weights}})
    )
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors") as info:
        load_model(path)
    assert info.value.missing == ["model-00002-of-00002.safetensors"]


def test_weights_that_do_not_fit_the_config(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_config(path, num_hidden_layers=3)  # the checkpoint has 2 layers
    with pytest.raises(ModelLoadError, match="do not fit the llama architecture"):
        load_model(path)


def write_tokenizer(path: Path, with_transformers_config: bool = False) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "def": 2, "return": 3, "x": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    if with_transformers_config:
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "eos_token": "</s>",
                    "unk_token": "[UNK]",
                    "tokenizer_class": "PreTrainedTokenizerFast",
                }
            )
        )


def test_tokenizer_loaded_when_present(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    write_tokenizer(path)
    edit_config(path, eos_token_id=1)
    _, tokenizer = load_model(path)
    assert isinstance(tokenizer, Tokenizer) and tokenizer.backend == "tokenizers"
    ids = tokenizer.encode("def x return x")
    assert ids == [2, 4, 3, 4]
    assert tokenizer.decode(ids) == "def x return x"
    assert tokenizer.eos_token_ids == {1}
    assert tokenizer.get_vocab() == {"[UNK]": 0, "</s>": 1, "def": 2, "return": 3, "x": 4}


def test_tokenizer_with_transformers_backend(tmp_path):
    pytest.importorskip("transformers")
    write_tokenizer(tmp_path, with_transformers_config=True)
    tokenizer = load_tokenizer(tmp_path, backends=("transformers",))
    assert tokenizer.backend == "transformers"
    assert tokenizer.encode("return x") == [3, 4]
    assert tokenizer.decode([3, 4]) == "return x"
    assert 1 in tokenizer.eos_token_ids
    assert tokenizer.get_vocab()["return"] == 3


def test_no_tokenizer_backend_installed_means_none(tmp_path, monkeypatch):
    import sys

    write_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    assert load_tokenizer(tmp_path, backends=("tokenizers",)) is None
