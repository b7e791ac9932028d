"""What the GPU figures (G1-G4) share: the llama-8B model, its prompts, the cold prefill,
the stores holding its KV, and the fresh sessions that restore from them.

BENCHMARKS.md "On a GPU": the llama-8B shape (32 layers, hidden 4096, 32 query /
8 KV heads, head_dim 128, intermediate 14336, vocab 128256), bfloat16, seeded
random weights (:func:`kvstore.model.build_model`); prompts of 4096 and 16384
tokens. "Cold" is the full prefill in chunks of 2048; "warm" is lookup +
restore + the forward of the one token left, in a fresh process
(:mod:`kvstore.bench.figures.gpu_session`), both after a warm-up of the kernels.

The figures run where the default device is a GPU. Elsewhere they are not
measured (the row says why), except in a ``--quick`` run, which measures the
same paths with a tiny model and a 300-token prompt: a smoke run for a CPU.
A run of several G figures prepares each prompt once (:class:`GpuSetup`):
the model, the cold timings, one store per storage policy, the mlx-lm file,
and the fresh sessions' timings (G2 reuses G1's lossless ones).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import BenchContext

__all__ = [
    "LLAMA8B",
    "TINY",
    "PREFILL_CHUNK",
    "NEEDS_GPU",
    "on_gpu",
    "model_config",
    "prompt_lengths",
    "GpuSetup",
    "setup_for",
    "Session",
    "session_line",
    "spawn_session",
]

#: BENCHMARKS.md's GPU model: the llama-8B shape.
LLAMA8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
#: The ``--quick`` stand-in: the same code paths in milliseconds on a CPU.
TINY: dict[str, Any] = {
    **LLAMA8B,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 512,
}
#: The cold prefill's chunk (mlx-lm's default prefill step).
PREFILL_CHUNK = 2048
NEEDS_GPU = (
    "needs a GPU (MLX's default device is the CPU here): run it on the device machine "
    "with tools/bench/gpu/run.sh"
)
SEED = 0


def on_gpu() -> bool:
    import mlx.core as mx

    return bool(mx.default_device() == mx.gpu)


def model_config(ctx: BenchContext) -> dict[str, Any]:
    return TINY if ctx.quick else LLAMA8B


def prompt_lengths(ctx: BenchContext) -> tuple[int, ...]:
    """4096 and 16384 tokens (``--quick``: 300); ``KVSTORE_BENCH_GPU_TOKENS`` (``4096``,
    say) names them instead, for a run that must fit what is left of a device session."""
    named = os.environ.get("KVSTORE_BENCH_GPU_TOKENS")
    if named:
        return tuple(int(t) for t in named.split(","))
    return (300,) if ctx.quick else (4096, 16384)


def build(config: dict[str, Any]) -> Any:
    """The seeded model (the same weights in every process): bfloat16, except the
    ``--quick`` stand-in, float32 (the CPU has no fast bfloat16 matmul)."""
    import mlx.core as mx

    from kvstore.model import build_model

    dtype = mx.float32 if config["hidden_size"] == TINY["hidden_size"] else mx.bfloat16
    return build_model(dict(config), seed=SEED, dtype=dtype)


def prefill(model: Any, prompt: Any, caches: list[Any]) -> Any:
    """The full prefill in chunks of :data:`PREFILL_CHUNK`; the last position's logits
    (evaluated, with every cache)."""
    import mlx.core as mx

    n = int(prompt.shape[1])
    for start in range(0, n, PREFILL_CHUNK):
        logits = model(prompt[:, start : start + PREFILL_CHUNK], caches)
        mx.eval(logits[:, -1], [c.keys for c in caches])
    return logits[:, -1]


@dataclass
class Session:
    """One fresh process's restore (see :mod:`kvstore.bench.figures.gpu_session`)."""

    total_s: float
    lookup_s: float
    restore_s: float
    forward_s: float
    restored: int
    argmax_equal: bool
    max_abs_diff: float
    staging: bool
    detail: dict[str, Any] = field(default_factory=dict)


def spawn_session(spec: dict[str, Any]) -> Session:
    """Run one session in a fresh interpreter and parse its report.

    Raises:
        RuntimeError: the session failed (its stderr is in the message).
    """
    command = [sys.executable, "-m", "kvstore.bench.figures.gpu_session", json.dumps(spec)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"[bench] a G1 session failed (exit status {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}"
        )
    return Session(**json.loads(lines[-1]))


def session_line(session: Session) -> str:
    """One session's phases in ms (the restore's call returning, then its arrays
    evaluated), its restoring thread's CPU (with its page faults and context switches,
    where the platform counts them) and the collections Python ran in its timed part."""
    ms = {k: 1e3 * v for k, v in vars(session).items() if k.endswith("_s")}
    cpu = 1e3 * session.detail.get("restore_cpu_s", float("nan"))
    call = 1e3 * session.detail.get("restore_call_s", float("nan"))
    collected = session.detail.get("collections", [])
    gcs = " ".join(f"gen{g} {1e3 * t:.1f}" for g, t in collected) or "none"
    usage = session.detail.get("restore_thread") or {}
    thread = "".join(f", {n} {usage[n]}" for n in ("faults", "waits", "preempted") if n in usage)
    build = 1e3 * session.detail.get("forward_build_s", float("nan"))
    build_cpu = 1e3 * session.detail.get("forward_build_cpu_s", float("nan"))
    return (
        f"total {ms['total_s']:.1f}, lookup {ms['lookup_s']:.2f}, restore {ms['restore_s']:.1f} "
        f"(returned at {call:.1f}, cpu {cpu:.1f}{thread}), forward {ms['forward_s']:.1f} "
        f"(built in {build:.1f}, cpu {build_cpu:.1f}); collections: {gcs}"
    )


#: How sessions are run (tests run them in-process).
RUN_SESSION: Callable[[dict[str, Any]], Session] = spawn_session


@dataclass
class GpuSetup:
    """One prompt length's model, cold timings, stores and sessions, shared by G1/G2/G3."""

    ctx: BenchContext
    tokens: int
    config: dict[str, Any]
    model: Any = None
    prompt: np.ndarray | None = None
    caches: list[Any] | None = None
    cold: list[float] = field(default_factory=list)
    stores: dict[str, str] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    mlx_lm_file: Path | None = None
    sessions: dict[str, list[Session]] = field(default_factory=dict)
    directory: Path = field(default_factory=Path)

    @property
    def namespace(self) -> str:
        return "gpu-bench"

    @property
    def kv_bytes(self) -> int:
        layers = self.config["num_hidden_layers"]
        itemsize = 4 if self.config["hidden_size"] == TINY["hidden_size"] else 2
        per_token = 2 * layers * self.config["num_key_value_heads"] * self.config["head_dim"]
        return per_token * itemsize * self.tokens

    def prepare(self) -> None:
        """Model, prompt, the cold prefill timed (after a warm-up), its caches kept."""
        import mlx.core as mx

        if self.model is not None:
            return
        self.ctx.log(f"  building the model and prefilling {self.tokens} tokens")
        self.directory = Path(tempfile.mkdtemp(prefix=f"g-{self.tokens}-", dir=self.ctx.scratch))
        self.model = build(self.config)
        rng = np.random.default_rng(self.tokens)
        self.prompt = rng.integers(0, self.config["vocab_size"], self.tokens, dtype=np.uint32)
        prompt = mx.array(self.prompt[None, :].astype(np.int32))
        prefill(self.model, prompt, self.model.make_cache())  # warm-up
        for _ in range(self.ctx.repeats):
            caches = self.model.make_cache()
            start = time.perf_counter()
            prefill(self.model, prompt, caches)
            self.cold.append(time.perf_counter() - start)
            del caches
        self.caches = self.model.make_cache()
        logits = prefill(self.model, prompt, self.caches)
        np.save(self.directory / "prompt.npy", self.prompt)
        np.save(self.directory / "logits.npy", np.asarray(logits.astype(mx.float32)))

    def store_for(self, policy: str) -> str:
        """The URL of a store holding the prompt saved under ``policy`` (saved once, and
        restored once here so every kernel the sessions will run is compiled)."""
        from kvstore.store import open_store

        if policy in self.stores:
            return self.stores[policy]
        self.prepare()
        name = "lossless" if policy == "lossless" else policy.replace(":", "-")
        url = f"lmdb://{self.directory / name}"
        options: dict[str, Any] = {"map_size": 3 * self.kv_bytes + (256 << 20)}
        if policy != "lossless":
            options["storage_policy"] = policy
        assert self.caches is not None
        with open_store(url, **options) as store:
            store.save(self.namespace, self.prompt, self.caches)
            store.flush()
            self.stored_bytes[policy] = store.stats().bytes
            restored = store.restore(
                store.lookup(self.namespace, self.prompt), self.model.make_cache()
            )
            del restored
        self.stores[policy] = url
        return url

    def mlx_lm_path(self) -> Path:
        """mlx-lm's ``save_prompt_cache`` file of the prompt's first ``tokens - 1`` tokens."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, save_prompt_cache

        if self.mlx_lm_file is not None:
            return self.mlx_lm_file
        self.prepare()
        assert self.caches is not None
        caches = []
        for cache in self.caches:
            mine = KVCache()
            n = self.tokens - 1
            mine.update_and_fetch(cache.keys[:, :, :n], cache.values[:, :, :n])
            caches.append(mine)
        mx.eval([c.keys for c in caches])
        self.mlx_lm_file = self.directory / "mlx-lm.safetensors"
        save_prompt_cache(str(self.mlx_lm_file), caches)
        return self.mlx_lm_file

    def spec(self, case: str, policy: str = "lossless", suffix: int = 1) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "case": case,
            "config": self.config,
            "tokens": str(self.directory / "prompt.npy"),
            "logits": str(self.directory / "logits.npy"),
            "namespace": self.namespace,
            "suffix": suffix,
        }
        if case == "ours":
            spec["url"] = self.store_for(policy)
        else:
            spec["file"] = str(self.mlx_lm_path())
        return spec

    def run_sessions(
        self, key: str, case: str, policy: str = "lossless", suffix: int = 1
    ) -> list[Session]:
        """``ctx.repeats`` fresh sessions of ``case`` (cached under ``key``), each computing
        the prompt's last ``suffix`` tokens after restoring the rest."""
        if key not in self.sessions:
            spec = self.spec(case, policy, suffix)
            self.sessions[key] = [RUN_SESSION(spec) for _ in range(self.ctx.repeats)]
            for session in self.sessions[key]:  # each one: the medians hide two groups
                self.ctx.log(f"    {key} session: {session_line(session)}")
        return self.sessions[key]

    def close(self) -> None:
        self.model = self.caches = None
        shutil.rmtree(self.directory, ignore_errors=True)


_SETUPS: dict[tuple[int, int, bool], GpuSetup] = {}


def setup_for(ctx: BenchContext, tokens: int) -> GpuSetup:
    """The shared setup of ``tokens`` in this run (one per context and length)."""
    key = (id(ctx), tokens, ctx.quick)
    if key not in _SETUPS:
        for other in [k for k in _SETUPS if k[0] == id(ctx) and k[1] != tokens]:
            _SETUPS.pop(other).close()  # one model on the device at a time
        _SETUPS[key] = GpuSetup(ctx, tokens, model_config(ctx))
    return _SETUPS[key]


def release_all() -> None:
    for setup in _SETUPS.values():
        setup.close()
    _SETUPS.clear()


def environment() -> dict[str, Any]:
    """Device facts for a figure's notes."""
    import mlx.core as mx

    from kvstore.codecs import cuda

    info: dict[str, Any] = {"device": str(mx.default_device()), "cuda_staging": cuda.available()}
    try:
        info["gpu"] = mx.device_info().get("device_name")  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        pass
    info["cores"] = os.cpu_count()
    info["settings"] = settings()
    return info


def settings() -> dict[str, str]:
    """The settings of the path measured that the environment gave a figure
    (``KVSTORE_CUDA_LOCK_SPANS=auto``, say; its sessions inherit them): the library's
    tuning variables and MLX's. Not the bench's own choices (``KVSTORE_BENCH_*``), nor
    anything else a caller keeps there (a store's URL may hold a password)."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(_SETTING_PREFIXES)
    }


#: The families of environment variables that tune the restore and save paths.
_SETTING_PREFIXES = (
    "KVSTORE_CUDA_",
    "KVSTORE_VERIFY_",
    "KVSTORE_COPY_",
    "KVSTORE_HOST_",
    "KVSTORE_STACKED_",
    "KVSTORE_TQ_",
    "KVSTORE_DEQUANTIZED_",
    "KVSTORE_EARLY_",
    "MLX_",
)
