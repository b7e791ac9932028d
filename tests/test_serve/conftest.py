"""Real ``kvstore serve`` and stock ``mlx_lm.server`` processes over a tiny offline model.

Servers are started once per module (each start costs seconds) on free loopback
ports; the model directory (weights, byte-level tokenizer, ChatML template) is
written by the session. Requests go through the real ``openai`` client.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from kvstore.testing.mlx_lm_models import write_model_dir  # noqa: E402
from kvstore.testing.serve_processes import ServerProcess  # noqa: E402

#: A system prompt of ~1000 tokens (one per byte): several 256-token blocks, shared by turns.
SYSTEM = (
    "You answer questions about the Python standard library, briefly and exactly. "
    "Quote the module and the function you mean, and say which version added it. "
) * 6


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("hybrid") / "tiny-qwen3-next", "qwen3_next")


@pytest.fixture(scope="session")
def server_env(tmp_path_factory) -> dict[str, str]:
    return {"KVSTORE_CACHE_DIR": str(tmp_path_factory.mktemp("digests"))}


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server: ServerProcess, messages, **kwargs):
    """``(text, cached_tokens, prompt_tokens)`` of a greedy chat completion."""
    r = client(server).chat.completions.create(
        model="default_model", messages=messages, temperature=0, **{"max_tokens": 12, **kwargs}
    )
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content or "", details.cached_tokens, r.usage.prompt_tokens


def chat_stream(server: ServerProcess, messages, **kwargs):
    """``(text, cached_tokens)`` of a streamed greedy chat completion."""
    stream = client(server).chat.completions.create(
        model="default_model",
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **{"max_tokens": 12, **kwargs},
    )
    parts, cached = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return "".join(parts), cached


def complete(server: ServerProcess, prompt: str, **kwargs):
    r = client(server).completions.create(
        model="default_model", prompt=prompt, temperature=0, **{"max_tokens": 12, **kwargs}
    )
    return r.choices[0].text


def conversation(user: str, *turns: tuple[str, str]):
    """The system prompt, earlier ``(user, assistant)`` turns, then ``user``."""
    messages = [{"role": "system", "content": SYSTEM}]
    for question, answer in turns:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return [*messages, {"role": "user", "content": user}]
