"""``kvstore demo``: sessions in fresh processes reuse a shared context through the store.

The demo runs for real with the ``tiny`` config and a 300-token context: in
process (cold), then as a subprocess on the same store (warm); and once as a
subprocess on the shipped model (its default), with a 120-token context. Tests
assert on the table's content -- what was reused, hits, the follow-up turn,
warm, the answers' text and that it reads as code -- never on times.
"""

from __future__ import annotations

import io
import json
import keyword
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.demo.blas import OPENBLAS, BlasChoice, choose_blas
from kvstore.demo.dense import dequantize
from kvstore.demo.report import TABLE_HEADERS
from kvstore.demo.runner import (
    CONTEXT_TOKENS,
    DemoModel,
    DemoOptions,
    plan_context,
    prepare_model,
)
from kvstore.demo.script import (
    PENALTY_CONTEXT,
    PRESENCE_PENALTY,
    TURNS,
    TextCodec,
    Turn,
    question_text,
    question_tokens,
)
from kvstore.demo.shipped import SHIPPED_FILES, SHIPPED_MODEL, shipped_model_dir
from kvstore.errors import ModelLoadError
from kvstore.mlx_lm.version import mlx_lm_is_tested, mlx_lm_version
from kvstore.model import NAMED_CONFIGS, load_model

from .conftest import kvstore_cli
from .test_bad_input import check_one_line

PYCODE = Path("/work/shared/fixtures/pycode-lm")
ANSWER = 8
TINY = ["--config", "tiny", "--context-tokens", "300", "--answer-tokens", str(ANSWER)]
FOLLOW_UP = next(i for i, turn in enumerate(TURNS) if turn.follows is not None)


def table(text: str) -> list[dict[str, str]]:
    """The rows of the demo's table, by column header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("session  turn"))
    assert re.split(r"\s{2,}", lines[start].strip()) == list(TABLE_HEADERS)
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(TABLE_HEADERS), line
        rows.append(dict(zip(TABLE_HEADERS, cells)))
    return rows


def answers(text: str) -> dict[str, list[str]]:
    """The answers block under the table: each question and the lines of its answer."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("answers"))
    found: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line:  # the block's end (an answer's blank lines keep their indent)
            break
        if re.match(r"\s{0,2}\d+  ", line):
            found[line.split(None, 1)[1]] = []
        else:
            list(found.values())[-1].append(line[7:])
    return found


def field(text: str, name: str) -> str:
    """The value of a ``name  value`` summary line."""
    return next(line for line in text.splitlines() if line.startswith(f"{name} ")).split(None, 1)[1]


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, str]:
    """A first run on a new store, in process: (store, what it printed)."""
    store = tmp_path_factory.mktemp("demo") / "store"
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["demo", *TINY, "--store", str(store), "--no-progress"]) == 0
    return store, out.getvalue()


def test_cold_run_reuses_the_shared_context(cold):
    store, text = cold
    assert "new, created by the first save" in text
    rows = table(text)
    assert [r["session"] for r in rows] == [str(i + 1) for i in range(len(TURNS))]
    first, *later = rows
    assert first["reused"] == "0" and first["lookup"] == "miss (cold)"
    for row in later:
        # every later session reuses at least the whole 300-token context
        assert int(row["reused"]) >= 300 and row["lookup"] == "hit", row
        assert row["speed-up"].endswith("x") and row["TTFT no store"] == first["TTFT no store"]
    assert field(text, "lookups") == f"{len(TURNS)}: {len(TURNS) - 1} hits, 1 miss (cold 1)"
    assert "Run it again (make demo)" in text


def test_the_follow_up_reuses_the_previous_turn(cold):
    _, text = cold
    rows = table(text)
    follow_up = rows[FOLLOW_UP]
    earlier = rows[TURNS[FOLLOW_UP].follows]
    assert follow_up["turn"] == f"follows {TURNS[FOLLOW_UP].follows + 1}"
    # the earlier prompt and its answer, but the answer's last token (it has no KV yet)
    assert int(follow_up["reused"]) == int(earlier["prompt"]) + ANSWER - 1


def test_bytes_are_measured_against_mlx_lm_files(cold):
    _, text = cold
    rows = table(text)
    assert all(r["mlx-lm file"].endswith(("KiB", "MiB")) for r in rows)
    # each cold-run session stores the blocks it computed (counted once the writer commits)
    assert all(r["saved"].endswith(("KiB", "MiB")) for r in rows), rows
    stored = field(text, "stored")
    assert re.match(r"[\d.]+ (KiB|MiB) in \d+ blocks for this model", stored), stored
    mlx_lm = field(text, "mlx-lm")
    assert f"for the {len(TURNS)} sessions' prompt-cache files" in mlx_lm
    # mlx-lm's own writer where a tested mlx-lm is installed (Python 3.10 has none)
    writer = (
        "mlx_lm save_prompt_cache"
        if mlx_lm_is_tested()
        else f"kvstore export_prompt_cache (mlx-lm {mlx_lm_version()} untested)"
    )
    assert f"written by {writer} and measured" in mlx_lm
    # sessions sharing a context store it once; each mlx-lm file holds all of it
    assert float(re.search(r"\(([\d.]+)x the store", mlx_lm)[1]) > 1.5


def test_a_second_run_as_a_subprocess_starts_warm(cold):
    store, _ = cold
    done = kvstore_cli("demo", *TINY, "--store", str(store), "--no-progress")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "WARM, it already holds" in text and "This run started warm" in text
    rows = table(text)
    for row in rows:  # every prompt was stored whole: all but its last token reused
        assert int(row["reused"]) == int(row["prompt"]) - 1 and row["lookup"] == "hit", row
        assert row["saved"] == "0 B"  # the answers are the same: nothing new to store
    assert "(0 B added by this run)" in field(text, "stored")


# ---------------------------------------------------------------- the shipped model

#: Enough of an answer to tell code from a loop, and still a short run.
SHIPPED_CODE = ["--context-tokens", "120", "--answer-tokens", "24"]
ROUND_TRIPS = ("def naïve(x):\n\treturn {'ü': x}  # ✓\r\n", "\x00\x7f — 日本語 🐍", "")


def test_the_shipped_model_is_a_small_4bit_mlx_lm_directory():
    path = shipped_model_dir()
    assert sorted(p.name for p in path.iterdir()) == sorted(SHIPPED_FILES)
    assert sum(p.stat().st_size for p in path.iterdir()) <= 8_000_000  # issue 15's budget
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}


def test_the_shipped_model_loads_with_kvstore_and_mlx_lm():
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, tokenizer = load_model(SHIPPED_MODEL)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # the tied head too
    ids = tokenizer.encode("import json\n\ndef load(s):\n    return json.loads(s)\n")
    theirs, wrapper = load(str(SHIPPED_MODEL))
    ours_logits, their_logits = model(mx.array([ids])), theirs(mx.array([ids]))
    assert mx.array_equal(ours_logits.argmax(-1), their_logits.argmax(-1)).item()
    assert mx.allclose(ours_logits, their_logits, atol=1e-2).item()
    # mlx-lm formats a conversation the way the demo writes its prompts
    chat = wrapper.apply_chat_template(
        [{"role": "user", "content": "How?"}], add_generation_prompt=True
    )
    assert chat[0] == wrapper.bos_token_id == 0 and wrapper.eos_token_ids == {0}
    assert chat == question_tokens(TextCodec(tokenizer, 4096), Turn("How?"))
    # a follow-up: the earlier answer, then a new file for the next question
    messages = [
        {"role": "system", "content": "Be brief.\nUse json."},
        {"role": "user", "content": "How?"},
        {"role": "assistant", "content": "import json"},
        {"role": "user", "content": "And?"},
    ]
    eot = "<|endoftext|>"
    assert wrapper.apply_chat_template(messages, tokenize=False) == (
        f"{eot}# Be brief.\n# Use json.\n{eot}{question_text(Turn('How?'))}import json"
        f"{eot}{question_text(Turn('And?'))}"
    )


def test_the_shipped_model_dir_is_printed_for_other_tools(capsys):
    """``--model "$(kvstore demo --shipped-model-dir)"``: for mlx_lm and kvstore serve."""
    assert main(["demo", "--shipped-model-dir"]) == 0
    assert capsys.readouterr().out == f"{SHIPPED_MODEL}\n"


def test_the_shipped_tokenizer_round_trips_text():
    _, tokenizer = load_model(SHIPPED_MODEL, lazy=True)
    for text in ROUND_TRIPS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # a document starts with <|endoftext|>, which also ends answers
    assert tokenizer.encode("x = 1")[0] == 0 and tokenizer.eos_token_ids == {0}


def test_dense_weights_compute_what_the_quantized_ones_do():
    import mlx.core as mx

    # the quantized kernels, fed float32 scales and activations, as the reference
    quantized, _ = load_model(SHIPPED_MODEL, dtype=mx.float32)
    dense, _ = load_model(SHIPPED_MODEL)
    assert dequantize(dense) == 1 + 7 * len(dense.layers)  # the embedding, 7 linears a layer
    assert dense.model.norm.weight.dtype == mx.float32
    tokens = mx.array([[0, 10, 200, 31, 7, 99]])
    assert mx.allclose(dense(tokens), quantized(tokens), atol=1e-4, rtol=1e-4).item()


def test_the_shipped_model_is_package_data():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the dev extra's tomli
        import tomli as tomllib
    from fnmatch import fnmatch

    from .conftest import ROOT

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["kvstore"]
    for name in SHIPPED_FILES:
        assert any(fnmatch(f"demo/model/{name}", p) for p in patterns), name


def reads_as_code(answer: list[str]) -> list[str]:
    """What keeps ``answer`` (its lines) from reading as code; empty when it does.

    Code here: mostly printable ASCII, Python keywords and identifiers among its
    words, and no line (a loop such as ``self.args = args``) repeated back to back.
    """
    text = "\n".join(answer)
    problems = []
    if sum(c.isascii() and (c.isprintable() or c.isspace()) for c in text) < 0.95 * len(text):
        problems.append("not mostly printable ASCII")
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
    if not any(keyword.iskeyword(w) or w == "self" for w in words) or len(set(words)) < 3:
        problems.append(f"no Python keywords among a few identifiers: {words}")
    lines = [line.strip() for line in answer if line.strip()]
    if any(a == b for a, b in zip(lines, lines[1:])):
        problems.append("a line repeated back to back")
    return problems


def test_reads_as_code():
    code = ["class Parser(object):", '    """Parse it."""', "", "    def run(self):"]
    assert reads_as_code(code) == []
    loop = ["        self.args = args"] * 3
    assert reads_as_code(["def f(self):", *loop]) == ["a line repeated back to back"]
    assert reads_as_code(["#   -*-", "#   -----"])[0].startswith("no Python keywords")


def test_the_demo_writes_code_on_the_shipped_model(tmp_path):
    """No --model, no --config: the shipped model; answers are decoded text that reads
    as code (greedy with a presence penalty), and later sessions reuse the context."""
    done = kvstore_cli("demo", *SHIPPED_CODE, "--store", str(tmp_path / "store"), "--no-progress")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "model    the shipped demo model (llama" in text
    assert "text     tokenizer (tokenizers)" in text
    assert (
        f"decoding greedy, presence penalty {PRESENCE_PENALTY:g} over the newest "
        f"{PENALTY_CONTEXT} tokens" in text
    )
    rows = table(text)
    assert rows[0]["lookup"] == "miss (cold)"
    for row in rows[1:]:  # each later session restores at least the whole context
        assert int(row["reused"]) >= 120 and row["lookup"] == "hit", row
    written = answers(text)
    assert list(written) == [turn.question for turn in TURNS]
    for question, answer in written.items():
        assert answer and reads_as_code(answer) == [], (question, answer)
    # the penalty covers the turn it follows: plain greedy copies that answer (measured)
    follow_up = TURNS[FOLLOW_UP]
    assert written[follow_up.question] != written[TURNS[follow_up.follows].question]
    assert "seeded weights write no text" not in text


@pytest.mark.skipif(not PYCODE.is_dir(), reason="pycode-lm fixture not present")
def test_a_model_directory_with_text(tmp_path):
    """pycode-lm: a trained byte-level model without tokenizer files; --json output."""
    done = kvstore_cli(
        "demo",
        "--model",
        str(PYCODE),
        "--context-tokens",
        "300",
        "--answer-tokens",
        str(ANSWER),
        "--store",
        str(tmp_path / "store"),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["text"] == "bytes (UTF-8)" and report["model"].startswith("pycode-lm (llama")
    sessions = report["sessions"]
    assert all(isinstance(s["answer_text"], str) for s in sessions)
    assert [s["result"]["reused_tokens"] > 0 for s in sessions] == [False] + [True] * (
        len(TURNS) - 1
    )
    assert "session 2 (new conversation" in done.stderr  # the commentary went to stderr


# ---------------------------------------------------------------- planning


def test_blas_choice():
    lib = OPENBLAS["x86_64"]
    found = choose_blas(environ={}, platform_name="linux", machine="x86_64", exists=lambda p: True)
    assert found.fast and found.env["LD_PRELOAD"] == lib
    missing = choose_blas(
        environ={}, platform_name="linux", machine="x86_64", exists=lambda p: False
    )
    assert not missing.fast and "LD_PRELOAD" not in missing.env
    assert "apt-get install libopenblas0-pthread" in missing.description
    already = choose_blas(
        environ={"LD_PRELOAD": "/opt/x/libopenblas.so"}, platform_name="linux", machine="x86_64"
    )
    assert already.fast and already.env["LD_PRELOAD"] == "/opt/x/libopenblas.so"
    bundled = choose_blas(
        "bundled", environ={"LD_PRELOAD": f"{lib}:/lib/other.so"}, platform_name="linux"
    )
    assert not bundled.fast and bundled.env["LD_PRELOAD"] == "/lib/other.so"
    assert choose_blas(environ={}, platform_name="darwin").fast


def test_the_context_is_sized_to_the_blas_and_the_model():
    model = DemoModel({}, "m", "ns", TextCodec(None, 256, readable=False), None)
    slow = BlasChoice(False, "bundled", {})
    fast = BlasChoice(True, "openblas", {})
    tokens, note = plan_context(DemoOptions(), fast, model, reserve=100)
    assert len(tokens) == CONTEXT_TOKENS["fast"] and note is None
    tokens, note = plan_context(DemoOptions(), slow, model, reserve=100)
    assert len(tokens) == CONTEXT_TOKENS["slow"] and "sized down" in note
    limited = DemoModel({}, "m", "ns", model.codec, 2048)
    tokens, note = plan_context(DemoOptions(), fast, limited, reserve=100)
    assert len(tokens) == 2048 - 100 and "2048 positions" in note
    tokens, note = plan_context(DemoOptions(context_tokens=500), slow, model, reserve=100)
    assert len(tokens) == 500 and note is None


def test_a_model_directory_with_a_tokenizer(tmp_path, monkeypatch):
    """Text goes through the directory's tokenizer; its end-of-text ids stop answers."""
    pytest.importorskip("mlx_lm")
    from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model

    from ..test_model.conftest import save_mlx_lm_dir
    from ..test_model.test_loader import write_tokenizer

    path = save_mlx_lm_dir(
        tmp_path / "m", build_mlx_lm_model("llama"), {**TINY_ARGS["llama"], "eos_token_id": 1}
    )
    write_tokenizer(path)
    model = prepare_model(DemoOptions(model_dir=str(path)))
    assert model.codec.kind == "tokenizer (tokenizers)" and model.codec.stop_tokens == [1]
    assert model.codec.encode("def x return") == [2, 4, 3]
    assert model.codec.decode([2, 4, 1]) == "def x"  # the end-of-text id dropped
    assert model.spec == {"dir": str(path.resolve())}
    for backend in ("tokenizers", "transformers"):
        monkeypatch.setitem(sys.modules, backend, None)  # not installed
    with pytest.raises(ModelLoadError, match="no tokenizer backend is installed"):
        prepare_model(DemoOptions(model_dir=str(path)))


def test_demo_bad_input(tmp_path, capsys):
    check_one_line(capsys, ["demo", "--store", "memory://x"], "lives only as long as its process")
    check_one_line(capsys, ["demo", "--config", "huge"], "Unknown --config 'huge'", "tiny")
    for bad in ("-1", "inf", "x"):  # argparse's usage error
        with pytest.raises(SystemExit):
            main(["demo", "--presence-penalty", bad])
        assert f"takes a number >= 0; received '{bad}'" in capsys.readouterr().err
    check_one_line(
        capsys, ["demo", "--model", str(tmp_path), "--config", "tiny"], "are alternatives"
    )
    check_one_line(
        capsys, ["demo", "--model", str(tmp_path / "none")], "does not exist", "model directory"
    )
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(NAMED_CONFIGS["tiny"]))
    check_one_line(capsys, ["demo", "--model", str(no_weights)], "No model*.safetensors")
    file = tmp_path / "file"
    file.write_text("x")
    check_one_line(capsys, ["demo", *TINY, "--store", str(file)], "is a file")
