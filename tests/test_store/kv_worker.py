"""Subprocess side of the multi-process tests with real caches (``test_kv_processes``).

Run as ``python -m tests.test_store.kv_worker MODE ARGS...``; prints one JSON
document (``e2e``) or progress lines (``writer``, ``mixer``).

Prompts come from :func:`shared_prompt` so that the parent rebuilds any of
them from ``(seed, i)``; caches saved here are computed token by token
(:func:`~tests.test_store.kv_helpers.token_by_token`), so any process
rebuilds exactly the same rows for a shared prefix.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from kvstore.bridge.namespace import namespace_for_model
from kvstore.store import open_store

from .kv_helpers import (
    BLOCK,
    CHUNK,
    FAMILIES,
    assert_same_caches,
    log_probs_recorder,
    model_for,
    prompt,
    token_by_token,
)

_LONG = prompt(100, 100)


def e2e_cases(
    first_out: dict[str, list[int]] | None = None,
) -> list[tuple[str, str, str, list[int], list[int]]]:
    """The end-to-end cases: (name, family, storage policy, first prompt, second prompt).

    ``first`` is generated with the store in process A; ``second`` in process
    B. ``first_out``: A's generated tokens by case, which a follow-up turn
    (``plain-turn``) appends (empty until A has run).
    """
    turn = (first_out or {}).get("plain-turn", [])[:3]
    p96 = _LONG[:96]
    return [
        # Chunk ends agree with a run without store: equal bit for bit.
        ("plain", "plain", "lossless", p96, p96 + prompt(101, 5)),
        ("quant", "quant", "lossless", p96, p96 + prompt(102, 5)),
        ("window", "window", "lossless", _LONG, _LONG[:64] + prompt(103, 9)),
        ("window-quant", "window-quant", "lossless", _LONG, _LONG[:64] + prompt(104, 9)),
        ("turboquant", "turboquant", "lossless", p96, p96 + prompt(108, 5)),
        ("window-turboquant", "window-turboquant", "lossless", _LONG, _LONG[:64] + prompt(109, 9)),
        # Chunked differently (A decoded token by token what B's reference prefills).
        ("plain-turn", "plain", "lossless", _LONG, _LONG + turn + prompt(105, 3)),
        ("window-70", "window", "lossless", _LONG, _LONG[:70] + prompt(106, 9)),
        # A lossy storage policy.
        ("lossy", "plain", "kv:quant:8:64", p96, p96 + prompt(107, 5)),
        ("lossy-turboquant", "plain", "kv:turboquant:4:4", p96, p96 + prompt(110, 5)),
    ]


def generate_case(url: str, family: str, policy: str, tokens: list[int], max_tokens: int):
    from kvstore.bridge import generate_tokens

    config, cache_policy = FAMILIES[family]
    seen, sampler = log_probs_recorder()
    with open_store(url, block_size=BLOCK, storage_policy=policy) as store:
        out, stats = generate_tokens(
            model_for(config),
            tokens,
            store=store,
            policy=cache_policy,
            max_tokens=max_tokens,
            chunk_size=CHUNK,
            sampler=sampler,
        )
    return out, stats, seen


def e2e(role: str, root: str, first_report: str = "") -> None:
    """Process A (``first``) or B (``second``, given the path of A's report) of
    every case, one store per case."""
    report = {}
    first_out = (
        {k: v["tokens"] for k, v in json.loads(Path(first_report).read_text()).items()}
        if first_report
        else None
    )
    for name, family, policy, first, second in e2e_cases(first_out):
        tokens = first if role == "first" else second
        out, stats, seen = generate_case(f"lmdb://{root}/{name}", family, policy, tokens, 4)
        report[name] = {
            "tokens": out,
            "reused": stats.reused_tokens,
            "error": stats.store_error,
            "logprobs": [row.reshape(-1).tolist() for row in seen],
        }
    print(json.dumps(report), flush=True)


def shared_prompt(seed: int, i: int) -> list[int]:
    """Prompt ``i`` of stream ``seed``: shares prefixes with the other streams' prompts."""
    rng = random.Random(seed * 100_003 + i)
    system = random.Random(i % 3).choices(range(4), k=48)  # three common system prompts
    return system[: rng.randrange(0, 49)] + rng.choices(range(4), k=rng.randrange(1, 40))


def open_(url: str, **options):
    return open_store(url, block_size=BLOCK, touch_interval=0.05, **options)


def long_prompt(seed: int, n: int = 160) -> list[int]:
    """Writer ``seed``'s prompt: a system prompt shared with a third of the writers, then
    its own tokens. The SIGKILL test saves prefixes of it."""
    return random.Random(seed % 3).choices(range(4), k=48) + random.Random(seed).choices(
        range(4), k=n - 48
    )


def writer_lengths(seed: int) -> list[int]:
    """The prefix lengths writer ``seed`` saves, in order: every one, shuffled, so
    that most saves write a block or a tail and the saves last long enough to be
    killed in."""
    return random.Random(-seed - 1).sample(range(2, 161), 159)


def writer(url: str, seed: str) -> None:
    """Save prefixes of one prompt back to back, acknowledging each once saved (the
    SIGKILL test). Its caches are computed first, so that a kill lands inside a save."""
    model = model_for("tiny")
    namespace = namespace_for_model(model)
    tokens = long_prompt(int(seed))
    caches = token_by_token(model, tokens)
    store = open_(url)
    print("READY", flush=True)
    for length in writer_lengths(int(seed)):
        store.save(namespace, tokens[:length], caches)
        sys.stdout.write(f"ACK {length}\n")  # one write: a SIGKILL cannot cut the line
        sys.stdout.flush()
    print("END", flush=True)


def behind(url: str, seed: str) -> None:
    """The writer's saves handed off (write-behind): every third save a ``flush``,
    after which the saves handed off before it are acknowledged."""
    model = model_for("tiny")
    namespace = namespace_for_model(model)
    tokens = long_prompt(int(seed))
    caches = token_by_token(model, tokens)
    store = open_(url)
    print("READY", flush=True)
    handed: list[int] = []
    for k, length in enumerate(writer_lengths(int(seed))):
        store.save_behind(namespace, tokens[:length], caches)
        handed.append(length)
        if k % 3 == 2:
            store.flush()
            print("".join(f"ACK {n}\n" for n in handed), end="", flush=True)
            handed = []
    store.flush()
    print("".join(f"ACK {n}\n" for n in handed), end="", flush=True)
    print("END", flush=True)


def check_restore(store, namespace: str, model, tokens: list[int], expected=None) -> int:
    """Restore ``tokens``'s longest stored prefix; it must equal a fresh computation
    (``expected(model, prefix)``, :func:`token_by_token` by default)."""
    restored = store.restore(store.lookup(namespace, tokens), model.make_cache())
    n = restored[0].offset
    if n:
        assert_same_caches(restored, (expected or token_by_token)(model, tokens[:n]))
    return n


def mixer(url: str, seed: str, count: str) -> None:
    """Save and restore overlapping prompts while three other processes do (4-process test)."""
    model = model_for("tiny")
    namespace = namespace_for_model(model)
    store = open_(url)
    rng = random.Random(int(seed))
    for i in range(int(count)):
        tokens = shared_prompt(int(seed), i)
        store.save(namespace, tokens, token_by_token(model, tokens))
        assert check_restore(store, namespace, model, tokens) == len(tokens) - 1
        other = shared_prompt(rng.randrange(4), rng.randrange(int(count)))
        check_restore(store, namespace, model, other)  # whatever is found must be exact
    store.close()
    print("DONE", seed, flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"e2e": e2e, "writer": writer, "behind": behind, "mixer": mixer}[mode](*args)
