"""G5: decode tokens/s, the step specialised to the cache layout vs the generic path.

Issue 17 item 4. The reference model decodes greedily, one token per step
with ``.item()`` after each as :func:`kvstore.model.generate` does, from a
prompt already prefilled; each timed call decodes :data:`TOKENS_PER_CALL`
tokens and the caches are trimmed back afterwards (untimed), so every
repetition decodes at the same context. Timed side by side, interleaved, on
two copies of the same caches:

* ``specialised``: ``model.decode_step(caches)`` picks the step built for the
  caches' signatures (:mod:`kvstore.model.decode_step`);
* ``generic``: the same loop with specialised steps disabled (``model(...)``);
* ``specialised, pipelined`` and ``generic, pipelined``: both again in mlx-lm's
  loop, which builds step ``n + 1``'s graph (``mx.async_eval``) before reading
  token ``n`` -- what the Python side of a step costs once it overlaps the
  device's work (information: ``generate`` reads each token first).

Layouts: plain caches (the model's dtype) and a mixed quantized layout
(``kv:quant:4:64`` and ``kv:quant:8:64`` on alternate layers). Where MLX's
default device is a GPU: the llama-8B shape (BENCHMARKS.md "On a GPU") in
bfloat16 at a 4096-token context; on a CPU: the ``small`` config in float32 at
1024 (the row says which BLAS ran); ``--quick``: ``tiny`` at 64.

Each row also says whether the two paths' logits were bit-identical over 32
teacher-forced steps, and a profile: per token, the milliseconds spent
building the graph in Python and evaluating it, per path. Aim (issue 17):
>= 1.3x at batch 1 on the GPU machine.

The prompt is prefilled through the model as a user's would be (on CUDA the
quantized layers' prefill attends their rows dequantized: MLX 0.32.4 has no
CUDA ``quantized_matmul`` kernel for it, :mod:`kvstore.model.attention`). A
layout MLX cannot run here (no kernel for its decode shapes, a kernel its JIT
cannot compile) becomes a row not measured yet that names the MLX limitation,
and the other layouts are still measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from kvstore.bench.figures.gpu_common import LLAMA8B
from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least
from kvstore.bench.results import FigureResult, Row

__all__ = [
    "FIGURE",
    "TOKENS_PER_CALL",
    "LAYOUTS",
    "decode_tokens",
    "mlx_limitation",
]

TOKENS_PER_CALL = 16
CHECK_STEPS = 32
RATIO = "specialised vs generic"


def _mixed_quant(model: Any) -> list[Any]:
    from kvstore.layout import LayerLayout
    from kvstore.model import CachePolicy

    bits = [(4, 8)[i % 2] for i in range(len(model.layers))]
    layout = LayerLayout(layers=tuple((i, f"kv:quant:{b}:64") for i, b in enumerate(bits)))
    return model.make_cache(CachePolicy(layout=layout))


#: Layout name -> fresh caches for a model.
LAYOUTS: dict[str, Callable[[Any], list[Any]]] = {
    "plain": lambda model: model.make_cache(),
    "mixed kv:quant 4/8": _mixed_quant,
}


def _setting(ctx: BenchContext) -> tuple[str, Any, Any, int]:
    """``(device, model name, model, context tokens)`` for this machine and run size."""
    import mlx.core as mx

    from kvstore.model import build_model

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    if ctx.quick:
        return device, "tiny", build_model("tiny"), 64
    if device == "gpu":
        return device, "llama8b bf16", build_model(dict(LLAMA8B), dtype=mx.bfloat16), 4096
    return device, "small", build_model("small"), 1024


def decode_tokens(model: Any, caches: list[Any], token: int, n: int) -> list[int]:
    """``n`` greedy decode steps from ``token`` over ``caches``, as ``generate`` runs them."""
    import mlx.core as mx

    y = mx.array([token])
    out = []
    for _ in range(n):
        logits = model.decode_step(caches)(y[:, None], caches)[:, -1, :]
        y = mx.argmax(logits, axis=-1)
        out.append(cast(int, y.item()))
    return out


def decode_tokens_pipelined(model: Any, caches: list[Any], token: int, n: int) -> list[int]:
    """:func:`decode_tokens` in mlx-lm's loop: step ``n + 1`` is built and queued before
    token ``n`` is read (one step more is computed, and waited for)."""
    import mlx.core as mx

    def step(y: mx.array) -> mx.array:
        return mx.argmax(model.decode_step(caches)(y[:, None], caches)[:, -1, :], axis=-1)

    y = step(mx.array([token]))
    mx.async_eval(y)
    out = []
    for _ in range(n):
        following = step(y)
        mx.async_eval(following)
        out.append(cast(int, y.item()))
        y = following
    mx.eval(y)
    return out


def _prefilled(model: Any, layout: str, prompt: Any) -> list[Any]:
    import mlx.core as mx

    caches = LAYOUTS[layout](model)
    model.decode_steps.enabled = False
    held = prompt.shape[1] - 1  # the last prompt token is the first one decoded
    for start in range(0, held, 2048):
        model(prompt[:, start : min(start + 2048, held)], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _compare(model: Any, layout: str, prompt: Any, tokens: list[int]) -> dict[str, float]:
    """Whether both paths give the same logits over teacher-forced ``tokens``."""
    import mlx.core as mx

    runs = []
    for enabled in (False, True):
        caches = _prefilled(model, layout, prompt)
        model.decode_steps.enabled = enabled
        out = []
        for t in tokens:
            out.append(model.decode_step(caches)(mx.array([[t]]), caches)[0, -1])
            mx.eval(out[-1])
        runs.append(mx.stack(out).astype(mx.float32))
        del caches
    same = cast(bool, mx.array_equal(runs[0], runs[1]).item())
    diff = cast(float, mx.abs(runs[0] - runs[1]).max().item())
    return {"logits bit-exact": float(same), "max |logit diff|": diff}


def _profile(
    model: Any, caches: list[Any], token: int, enabled: bool, n: int
) -> tuple[float, float]:
    """Per token, ``(ms building the graph, ms evaluating it)`` on one path."""
    import mlx.core as mx

    model.decode_steps.enabled = enabled
    y = mx.array([token])
    build = evaluate = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model.decode_step(caches)(y[:, None], caches)[:, -1, :]
        y = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter()
        mx.eval(y)
        build += t1 - t0
        evaluate += time.perf_counter() - t1
    for c in caches:
        c.trim(n)
    return build / n * 1e3, evaluate / n * 1e3


def mlx_limitation(exc: RuntimeError) -> str | None:
    """What an MLX error says this machine's MLX cannot run, with the fix where there is
    one; ``None`` for any other error (a bug of ours: it propagates)."""
    from importlib import metadata

    message, mlx = str(exc), f"MLX {metadata.version('mlx')}"
    if "No implementation for problem shape" in message:
        return f"{mlx} has no kernel here for this layout's shapes: {message}"
    if "Failed to compile kernel" in message and "cannot open source file" in message:
        return (
            f"{mlx}'s JIT could not compile a kernel: its C++ headers are missing (carry "
            f"them: tools/bench/gpu/README.md): {message}"
        )
    return None


def _params(device: str, name: str, context: int, layout: str) -> dict[str, Any]:
    from kvstore.bench.machine import blas_info

    params: dict[str, Any] = {"device": device, "model": name, "layout": layout, "context": context}
    if device == "cpu":
        params["blas"] = blas_info()["mlx"]
    return params


def measure(
    ctx: BenchContext, device: str, name: str, model: Any, context: int, layout: str
) -> Row:
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(context)
    prompt = mx.array(rng.integers(0, model.args.vocab_size, (1, context)).astype(np.int32))
    model.decode_steps.build_after = 0
    first = cast(int, prompt[0, -1].item())
    paths = {"specialised": True, "generic": False}
    loops = {"": decode_tokens, ", pipelined": decode_tokens_pipelined}
    names = [f"{path}{loop}" for loop in loops for path in paths]
    caches = {name: _prefilled(model, layout, prompt) for name in names}

    def case(path: str, loop: str) -> Case:
        name, decode = f"{path}{loop}", loops[loop]

        def run() -> None:
            model.decode_steps.enabled = paths[path]
            decode(model, caches[name], first, TOKENS_PER_CALL)

        def reset() -> None:
            for c in caches[name]:
                c.trim(c.offset - (context - 1))

        return Case(name, "ours" if paths[path] else "peer", run, reset)

    row = ctx.measure(
        _label(name, layout, context),
        _params(device, name, context, layout),
        [case(path, loop) for loop in loops for path in paths],
        [
            Ratio(RATIO, "specialised", "generic"),
            Ratio(
                "pipelined: specialised vs generic", "specialised, pipelined", "generic, pipelined"
            ),
            Ratio("specialised pipelined vs generic", "specialised, pipelined", "generic"),
        ],
    )
    for case_name in names:
        row.values[f"{case_name} tokens/s"] = TOKENS_PER_CALL / row.spread(case_name).median
    for path, enabled in paths.items():
        graph_ms, eval_ms = _profile(model, caches[path], first, enabled, TOKENS_PER_CALL)
        row.values[f"{path} graph ms/token"] = graph_ms
        row.values[f"{path} eval ms/token"] = eval_ms
    caches.clear()
    model.decode_steps.enabled = False
    teacher = decode_tokens(model, _prefilled(model, layout, prompt), first, CHECK_STEPS)
    row.values.update(_compare(model, layout, prompt, teacher))
    model.decode_steps.enabled = True
    return row


def _label(name: str, layout: str, context: int) -> str:
    return f"{name} {layout} @{context}"


def run(ctx: BenchContext) -> FigureResult:
    device, name, model, context = _setting(ctx)
    rows = []
    for layout in LAYOUTS:
        try:
            rows.append(measure(ctx, device, name, model, context, layout))
        except RuntimeError as exc:
            reason = mlx_limitation(exc)
            if reason is None:
                raise
            params = _params(device, name, context, layout)
            rows.append(Row(_label(name, layout, context), params, pending=reason))
        finally:
            model.decode_steps.enabled = True
    notes = [f"device: {device}; {TOKENS_PER_CALL} tokens per timed call, batch 1"]
    if device == "cpu":
        notes.append("the >= 1.3x aim is for the GPU machine; CPU rows are reported")
    return FigureResult(rows, notes=notes)


FIGURE = Figure(
    "G5",
    "decode tokens/s: the step specialised to the cache layout vs the generic path",
    "the generic decode step (same model, same caches, specialised steps disabled)",
    (at_least(RATIO, 1.3, where={"device": "gpu"}),),
    run,
)
