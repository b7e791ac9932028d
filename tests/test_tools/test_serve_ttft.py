"""``tools/bench/serve_ttft.py``'s stream reading against a real stock ``mlx_lm.server``:
each long gap comes with the text of the chunk it preceded, and the tokens behind it
are counted with the model's own tokenizer (a chunk the server held back is several)."""

from __future__ import annotations

from kvstore.testing.mlx_lm_models import write_model_dir
from kvstore.testing.serve_processes import ServerProcess


def test_each_long_gap_names_its_chunk_and_the_tokens_behind_it(tmp_path):
    from tools.bench.serve_ttft import end_tokens, token_counter, ttft

    model = write_model_dir(tmp_path / "model", "llama")
    server = ServerProcess.stock(model, log=tmp_path / "stock.log")
    ServerProcess.start_all(server)
    try:
        bias = {str(t): -100.0 for t in end_tokens(model)}
        got = ttft(server, [{"role": "user", "content": "def f(x):"}], 12, bias)
    finally:
        server.stop()
    gaps = got["longest_gaps"]
    assert 1 <= len(gaps) <= 3
    assert [g for _, g, _ in gaps] == sorted((g for _, g, _ in gaps), reverse=True)
    # Each gap's chunk is a piece of the streamed text, sent because it had text.
    assert all(piece and piece in got["text"] for _, _, piece in gaps)
    count = token_counter(model)
    assert all(count(piece) >= 1 for _, _, piece in gaps)
    assert count(got["text"]) >= max(count(piece) for _, _, piece in gaps)
