"""Per-layer cache layouts chosen by measured sensitivity (issue 17, item 2).

:func:`tune` measures, per layer and per candidate family, the next-token KL
of encoding that layer alone in the family, on the user's text, and picks one
family per layer meeting a budget (average bits per value, or bytes per token)
with the least total KL. ``kvstore tune`` is its command line.

The measure is BENCHMARKS.md's next-token protocol: for each of ``windows``
evenly spaced windows of the text, prefill ``prefill`` tokens with the caches
under test, feed the next ``continuation`` tokens as one chunk, and take
KL(plain || test) of the chunk's next-token distributions, per position,
against a run with plain caches (and top-1 agreement: the same argmax). The
model runs in the dtype it is given (the protocol casts it to float32, so the
figure judges the cache encoding, not bfloat16 arithmetic). Layers before the
one under test see exactly what they see with plain caches, so each run starts
from the plain run's hidden states at that layer (:meth:`DecoderModel.run_layers`):
the same numbers, computed once.

Choosing is a multiple-choice knapsack: one family per layer, cost = that
layer's bytes per token in the family (what its cache reports), value = the
layer's KL; minimise the summed KL subject to the summed cost. It is solved
exactly, by dynamic programming over the Pareto frontier of (cost, KL) of the
layers so far, so a layer that is cheap to quantise hard pays for one that is
not. A greedy that buys, step by step, the upgrade saving the most KL per byte
is not optimal: it can spend the budget on small steps and then not afford a
large one worth more (``tests/test_model/test_tune.py`` has one), and per-layer
KL is not convex in the bits across families (TurboQuant 4/4 loses less than
affine 5/64 at fewer bits), which is where such steps arise. Summed single-layer KL is the
model of the layout's KL; the chosen layout is then measured as a whole
(:func:`measure_policy`), and that is the number reported.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.family import families, windowed_family
from kvstore.layout import LayerLayout, kind_of_layer
from kvstore.model.policy import CachePolicy, make_caches
from kvstore.signature import parse_signature

__all__ = [
    "Budget",
    "parse_budget",
    "candidate_signatures",
    "layer_bytes_per_token",
    "text_windows",
    "Measured",
    "Sweep",
    "choose_layout",
    "measure_policy",
    "TuneResult",
    "tune",
]

#: The protocol's defaults (BENCHMARKS.md "Fidelity").
WINDOWS, PREFILL, CONTINUATION = 4, 1024, 256


@dataclass(frozen=True)
class Budget:
    """A budget: ``value`` average bits per stored value, or bytes per token (all layers)."""

    value: float
    unit: str  # "bits" or "bytes"

    def bytes_per_token(self, values_per_token: int) -> float:
        """The budget in bytes per token for a model storing ``values_per_token``."""
        return self.value if self.unit == "bytes" else self.value * values_per_token / 8

    def __str__(self) -> str:
        return (
            f"{self.value:g} bits per value" if self.unit == "bits" else f"{self.value:g} B/token"
        )


_BUDGET = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z/]*)\s*", re.IGNORECASE)
_BYTE_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 10**6, "mib": 1 << 20}


def parse_budget(text: str) -> Budget:
    """``"4.5"`` or ``"4.5bits"``: bits per value; ``"1152B"``, ``"64KiB"``: bytes per token.

    Raises:
        ValueError: anything else, or a budget that is not positive.
    """
    m = _BUDGET.fullmatch(str(text))
    unit = "" if m is None else m[2].lower().removesuffix("/token").removesuffix("/tok")
    if m is not None and float(m[1]) > 0:
        if unit in ("", "bit", "bits", "bpv"):
            return Budget(float(m[1]), "bits")
        if unit in _BYTE_UNITS:
            return Budget(float(m[1]) * _BYTE_UNITS[unit], "bytes")
    raise ValueError(
        f"[tune] --budget takes average bits per value (4.5, 3.125bits) or bytes per token "
        f"(1152B, 64KiB); received {text!r}."
    )


def candidate_signatures(kinds: Sequence[str] | None = None) -> list[str]:
    """Every signature of every registered growing KV family (``kinds``: only those
    kinds, or exact signatures), plain first: what each layer may get."""
    out = []
    for family in families():
        if family.windowed or not family.holds_kv or family.factory is None:
            continue
        for values in itertools.product(*(p.allowed for p in family.params)):
            out.append(family.signature(*values))
    if kinds is not None:
        wanted = set(kinds)
        out = [s for s in out if s in wanted or parse_signature(s).kind in wanted]
        unknown = wanted - set(out) - {parse_signature(s).kind for s in out}
        if unknown:
            raise ValueError(
                f"[tune] Unknown candidate families {sorted(unknown)}; candidates are kinds or "
                f"signatures of registered growing families ({', '.join(_kinds())})."
            )
    return sorted(out, key=lambda s: (s != "kv:plain", s))


def _kinds() -> list[str]:
    return [f.kind for f in families() if not f.windowed and f.holds_kv]


def layer_bytes_per_token(signature: str, layer: dict[str, Any]) -> int | None:
    """Bytes one token costs in a layer of geometry ``layer`` holding ``signature``'s
    family, as its cache reports it (float16 rows in; ``None`` if it cannot hold them)."""
    try:
        policy = CachePolicy(layout=LayerLayout(layers=((0, signature),)))
        cache = make_caches([layer], policy)[0]
        rows = mx.zeros((1, layer["n_kv_heads"], 1, layer["head_dim"]), mx.float16)
        cache.update_and_fetch(rows, rows)
        return int(cache.bytes_per_token())
    except Exception:  # noqa: BLE001 - a family that cannot hold this geometry is no candidate
        return None


def text_windows(tokens: Sequence[int], windows: int, span: int) -> list[np.ndarray]:
    """``windows`` evenly spaced windows of ``span`` tokens.

    Raises:
        ValueError: fewer tokens than one window needs.
    """
    data = np.asarray(tokens, dtype=np.int64)
    if len(data) < span:
        raise ValueError(
            f"[tune] The text has {len(data)} tokens; one window needs {span} (prefill + "
            f"continuation). Give a longer text or a shorter --prefill."
        )
    starts = np.linspace(0, len(data) - span, windows).astype(int)
    return [data[s : s + span] for s in starts]


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Measured:
    """Next-token fidelity against plain caches: KL per position (mean), top-1 agreement."""

    kl: float
    top1: float


class _Reference:
    """One window's plain run: each layer's input hidden states and masks, per phase."""

    def __init__(self, model: Any, tokens: np.ndarray, prefill: int) -> None:
        inner = model.model
        caches = model.make_cache()
        self.inputs: list[list[mx.array]] = []
        self.masks: list[list[Any]] = []
        ids = mx.array(tokens.astype(np.int32))[None]
        for part in (ids[:, :prefill], ids[:, prefill:]):
            masks = inner.masks(part.shape[1], caches)
            h = inner.embed(part)
            seen = []
            for i in range(len(inner.layers)):
                seen.append(h)
                h = inner.run_layers(h, caches, start=i, stop=i + 1, masks=masks)
            mx.eval(h, seen)
            self.inputs.append(seen)
            self.masks.append(masks)
        self.logp = _log_softmax(model.logits(inner.norm(h))[0])
        self.top = mx.argmax(self.logp, axis=-1)
        mx.eval(self.logp, self.top)

    def compare(self, model: Any, caches: list[Any], start: int) -> tuple[mx.array, mx.array]:
        """KL per position and top-1 matches of a run whose layers from ``start`` on
        use ``caches`` (the layers before it see what the plain run saw)."""
        inner = model.model
        for phase in (0, 1):
            h = inner.run_layers(
                self.inputs[phase][start], caches, start=start, masks=self.masks[phase]
            )
            if phase == 0:
                mx.eval(h, [c.state for c in caches[start:]])
        logq = _log_softmax(model.logits(inner.norm(h))[0])
        p = mx.exp(self.logp)
        kl = mx.sum(mx.where(p > 0, p * (self.logp - logq), 0.0), axis=-1)
        same = mx.argmax(logq, axis=-1) == self.top
        mx.eval(kl, same)
        return kl, same


def measure_policy(
    model: Any, references: Sequence[_Reference], policy: CachePolicy, start: int = 0
) -> Measured:
    """KL and top-1 of ``policy``'s caches over every window (all layers from ``start``)."""
    kls, tops = [], []
    for ref in references:
        kl, same = ref.compare(model, model.make_cache(policy), start)
        kls.append(np.array(kl, dtype=np.float64))
        tops.append(np.array(same, dtype=np.float64))
    return Measured(float(np.mean(np.concatenate(kls))), float(np.mean(np.concatenate(tops))))


def choose_layout(
    costs: Sequence[Sequence[float]], kls: Sequence[Sequence[float]], budget: float
) -> list[int] | None:
    """One option per layer with summed cost within ``budget`` and the least summed KL
    (exact: dynamic programming over the Pareto frontier); ``None`` if none fits.

    ``costs[l][j]``, ``kls[l][j]``: option ``j`` of layer ``l`` (``math.inf`` cost: not
    an option). Ties go to the cheaper choice.
    """
    frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for layer_costs, layer_kls in zip(costs, kls, strict=True):
        merged = [
            (cost + c, kl + k, chosen + (j,))
            for cost, kl, chosen in frontier
            for j, (c, k) in enumerate(zip(layer_costs, layer_kls, strict=True))
            if cost + c <= budget * (1 + 1e-12)
        ]
        merged.sort(key=lambda t: (t[0], t[1]))
        frontier, best = [], math.inf
        for cost, kl, chosen in merged:  # keep the points no cheaper one beats
            if kl < best:
                frontier.append((cost, kl, chosen))
                best = kl
        if not frontier:
            return None
    return list(frontier[-1][2])


@dataclass
class TuneResult:
    """What :func:`tune` measured and chose.

    Attributes:
        sweep: the measurements it was chosen from (costs, KL per layer).
        choice: per tuned layer, the family chosen.
        policy: the chosen :class:`CachePolicy` (the most common family as
            default, the others by layer index).
        predicted_kl: the summed single-layer KL of the choice.
        measured: the chosen layout measured as a whole.
        uniform: uniform layouts measured as a whole, by signature.
    """

    budget: Budget
    sweep: Sweep
    choice: dict[int, str]
    policy: CachePolicy
    predicted_kl: float
    measured: Measured
    uniform: dict[str, Measured]

    @property
    def costs(self) -> dict[int, dict[str, int]]:
        return self.sweep.costs

    def bytes_per_token(self, choice: dict[int, str] | None = None) -> int:
        chosen = self.choice if choice is None else choice
        return sum(self.costs[i][s] for i, s in chosen.items())

    def bits_per_value(self, choice: dict[int, str] | None = None) -> float:
        return self.bytes_per_token(choice) * 8 / self.sweep.values_per_token

    def uniform_bits(self, signature: str) -> float:
        return self.bits_per_value({i: signature for i in self.choice})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the budget, the table, the choice and every measurement."""
        return {
            "budget": {"value": self.budget.value, "unit": self.budget.unit},
            "bits_per_value": self.bits_per_value(),
            "bytes_per_token": self.bytes_per_token(),
            "choice": {str(i): s for i, s in self.choice.items()},
            "predicted_kl": self.predicted_kl,
            "measured": vars(self.measured),
            "uniform": {
                s: {**vars(m), "bits_per_value": self.uniform_bits(s)}
                for s, m in self.uniform.items()
            },
            "table": {
                str(i): {
                    s: {
                        "kl": self.sweep.kl[i][s],
                        "top1": self.sweep.top1[i][s],
                        "bytes_per_token": self.costs[i][s],
                    }
                    for s in self.sweep.kl[i]
                }
                for i in self.sweep.layers
            },
            "skipped": {f"{i} {s}": why for (i, s), why in self.sweep.skipped.items()},
        }


def _layout_of(choice: dict[int, str]) -> LayerLayout:
    """The choice as a layout: the most common family as default, the rest by index."""
    counts: dict[str, int] = {}
    for s in choice.values():
        counts[s] = counts.get(s, 0) + 1
    default = max(counts, key=lambda s: counts[s])
    return LayerLayout(default, (), tuple((i, s) for i, s in choice.items() if s != default))


class Sweep:
    """Per layer and candidate family, the KL of encoding that layer alone; then
    the layout of least summed KL within a budget (:meth:`choose`, as often as wanted).

    Build with :meth:`plan` (costs only, cheap: a budget can be checked before
    anything runs), then :meth:`measure`.

    Attributes:
        signatures: the candidates.
        layers: the layers tuned (every layer but recurrent ones).
        costs: ``costs[layer][signature]``: bytes per token (what its cache reports).
        values_per_token: stored values one token adds across the tuned layers.
        kl: ``kl[layer][signature]`` (mean over windows and positions).
        top1: same shape, top-1 agreement.
        skipped: ``(layer, signature) -> why`` for a candidate that failed to run.
    """

    def __init__(
        self,
        model: Any,
        signatures: list[str],
        layers: list[int],
        costs: dict[int, dict[str, int]],
        values_per_token: int,
    ) -> None:
        self.model = model
        self.signatures = signatures
        self.layers = layers
        self.costs = costs
        self.values_per_token = values_per_token
        self.kl: dict[int, dict[str, float]] = {}
        self.top1: dict[int, dict[str, float]] = {}
        self.skipped: dict[tuple[int, str], str] = {}
        self._refs: list[_Reference] = []
        self._uniform: dict[str, Measured] = {}  # measured once, whatever the budget

    @classmethod
    def plan(cls, model: Any, candidates: Sequence[str] | None = None) -> Sweep:
        """The candidates of every layer and their costs; nothing measured yet."""
        geometry = model.layer_layout()
        layers = [i for i, g in enumerate(geometry) if kind_of_layer(g) != "recurrent"]
        signatures = candidate_signatures(candidates)
        if "kv:plain" not in signatures:
            signatures.insert(0, "kv:plain")
        costs: dict[int, dict[str, int]] = {}
        for i in layers:
            sliding = kind_of_layer(geometry[i]) == "sliding"
            costs[i] = {}
            for s in signatures:
                if sliding and windowed_family(parse_signature(s).kind) is None:
                    continue
                cost = layer_bytes_per_token(s, geometry[i])
                if cost is not None:
                    costs[i][s] = cost
        values = sum(2 * geometry[i]["n_kv_heads"] * geometry[i]["head_dim"] for i in layers)
        return cls(model, signatures, layers, costs, values)

    @property
    def runs(self) -> int:
        """Measured runs :meth:`measure` makes (plain needs none)."""
        return sum(len(c) - ("kv:plain" in c) for c in self.costs.values())

    def check(self, budget: Budget) -> None:
        """Raise unless some layout of the candidates meets ``budget``.

        Raises:
            ValueError: the cheapest layout costs more (the message says how much).
        """
        least = sum(min(self.costs[i].values()) for i in self.layers)
        if least > budget.bytes_per_token(self.values_per_token) * (1 + 1e-12):
            raise ValueError(
                f"[tune] No layout meets {budget}: the cheapest candidates cost {least} "
                f"B/token ({least * 8 / self.values_per_token:.3f} bits per value). Raise the "
                f"budget or add candidates."
            )

    def measure(
        self,
        tokens: Sequence[int],
        *,
        windows: int = WINDOWS,
        prefill: int = PREFILL,
        continuation: int = CONTINUATION,
        progress: Callable[[int, int], None] | None = None,
    ) -> Sweep:
        """Measure every candidate on every layer over ``windows`` of ``tokens``; returns self.

        Raises:
            ValueError: a text too short for one window.
        """
        texts = text_windows(tokens, windows, prefill + continuation)
        self._refs = [_Reference(self.model, t, prefill) for t in texts]
        total, done = self.runs, 0
        for i in self.layers:
            self.kl[i], self.top1[i] = {"kv:plain": 0.0}, {"kv:plain": 1.0}
            for s in list(self.costs[i]):
                if s == "kv:plain":
                    continue
                try:
                    policy = CachePolicy(layout=LayerLayout(layers=((i, s),)))
                    got = measure_policy(self.model, self._refs, policy, start=i)
                except Exception as exc:  # noqa: BLE001 - a family that cannot run is skipped
                    self.skipped[(i, s)] = f"{type(exc).__name__}: {exc}"
                    del self.costs[i][s]
                else:
                    self.kl[i][s], self.top1[i][s] = got.kl, got.top1
                done += 1
                if progress is not None:
                    progress(done, total)
        return self

    def choose(self, budget: Budget, compare: Sequence[str] | None = None) -> TuneResult:
        """The layout of least summed KL within ``budget``, measured as a whole, and the
        uniform layouts ``compare`` names (default: the best of each kind within it).

        Raises:
            ValueError: no layout meets the budget.
        """
        self.check(budget)
        limit = budget.bytes_per_token(self.values_per_token)
        costs = self.costs
        options = [sorted(costs[i], key=lambda s: (costs[i][s], s)) for i in self.layers]
        picked = choose_layout(
            [[costs[i][s] for s in opts] for i, opts in zip(self.layers, options)],
            [[self.kl[i][s] for s in opts] for i, opts in zip(self.layers, options)],
            limit,
        )
        assert picked is not None  # check() passed: the cheapest layout fits
        choice = {i: opts[j] for i, opts, j in zip(self.layers, options, picked)}
        policy = CachePolicy(layout=_layout_of(choice))
        measured = measure_policy(self.model, self._refs, policy)
        uniform = {}
        for s in _comparisons(compare, choice, costs, self, limit):
            if s not in self._uniform:
                self._uniform[s] = measure_policy(self.model, self._refs, CachePolicy(family=s))
            uniform[s] = self._uniform[s]
        predicted = sum(self.kl[i][s] for i, s in choice.items())
        return TuneResult(budget, self, choice, policy, predicted, measured, uniform)


def tune(
    model: Any,
    tokens: Sequence[int],
    budget: Budget,
    *,
    candidates: Sequence[str] | None = None,
    windows: int = WINDOWS,
    prefill: int = PREFILL,
    continuation: int = CONTINUATION,
    compare: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """Measure each layer's sensitivity to each candidate family and choose a layout
    (:class:`Sweep` for several budgets over one sweep).

    Args:
        model: a :class:`~kvstore.model.Model` (float32 for the protocol).
        tokens: the text, as token ids.
        budget: average bits per value, or bytes per token.
        candidates: families to consider (kinds or signatures; every registered
            growing family by default, ``kv:plain`` always among them).
        windows, prefill, continuation: the protocol's windows.
        compare: uniform layouts to measure beside the choice (default: for each
            candidate kind, the uniform family within the budget whose summed
            single-layer KL is least).
        progress: ``progress(done, total)`` after each measured run.

    Raises:
        ValueError: a text too short, a bad candidate, or a budget no layout meets
            (the message says the least one can).
    """
    sweep = Sweep.plan(model, candidates)
    sweep.check(budget)
    sweep.measure(
        tokens, windows=windows, prefill=prefill, continuation=continuation, progress=progress
    )
    return sweep.choose(budget, compare)


def _comparisons(
    compare: Sequence[str] | None,
    choice: dict[int, str],
    costs: dict[int, dict[str, int]],
    sweep: Sweep,
    limit: float,
) -> list[str]:
    """The uniform layouts to compare with: ``compare``, or per kind the one within
    the budget of least summed single-layer KL."""
    if compare is not None:
        return [str(parse_signature(s)) for s in compare]
    best: dict[str, tuple[float, str]] = {}
    for s in sweep.signatures:
        if s == "kv:plain" or not all(s in costs[i] for i in choice):
            continue
        if sum(costs[i][s] for i in choice) > limit * (1 + 1e-12):
            continue
        total = sum(sweep.kl[i][s] for i in choice)
        kind = parse_signature(s).kind
        if kind not in best or total < best[kind][0]:
            best[kind] = (total, s)
    return [s for _, s in sorted(best.values(), key=lambda t: t[1])]
