"""What a TurboQuant snapshot records about its encoding, and what a reader checks.

Every ``kv:turboquant`` / ``kv:rotating-turboquant`` snapshot carries, in
``meta["tq"]`` (spec ``specs/turboquant.md``; bits are in the signature)::

    {"head_dim": 128, "seed": 0, "center": False, "codebook": "gauss-lm-v1",
     "k": {"bits": 4, "scale_mode": "matched", "centroids": [16 floats],
           "rotation": {"method": "rht", "signs": ["++-+--+-...", ...]}},  # a string per round
     "v": {..., "rotation": {"method": "dense", "sha256": "9f2c..."}}}

and, beside its rows, ``keys.mu`` (float32 ``[H, D]``) when keys are
mean-centred, and ``keys.rotation`` / ``values.rotation`` (float32 ``[D, D]``)
for a dense rotation in the snapshot that starts at token 0.

What travels in every block record and what is only identified, weighed
against a block of 256 tokens, whose rows cost ``256*H*(4W + 2)`` bytes per
layer and kind (102 KiB at 8 KV heads, D=128, 3 bits; 13 KiB at 2 heads, D=64):

* The codebook table (``2**b`` floats: 147 bytes of header per kind at 4 bits, 291 at 5)
  and the RHT sign vectors (``rounds * D`` characters): in every snapshot,
  well under 1% of a block at 8 heads, so every record decodes on its own on
  any host. A reader checks them against their ids: the table of
  ``gauss-lm-v1``, and SplitMix64 of (seed, kind, round).
* The key mean ``mu`` (``4*H*D`` bytes) is data, not derivable: in every snapshot.
* A dense rotation (non-power-of-two D) is ``4*D*D`` bytes per kind -- 36 KiB
  at D=96, as much as the block's own codes at 8 heads. Every snapshot names
  it by the sha256 of its float32 bytes; only the snapshot starting at token 0
  carries it, so it is stored once per prefix, not once per block. A reader
  takes it from that snapshot (a growing cache is always restored from token
  0), else from the matrices this process has already read or written, else
  from the reference generator *if* it gives the same bytes here. The spec
  makes the stored matrix normative (LAPACK and RNG bits differ across
  platforms), so a regenerated matrix is never used unverified: with no
  match the entry cannot be decoded on this host (``CorruptEntryError``, a miss).
  sha256, not a fast hash: a crafted record must not be able to pass its
  matrix off under another matrix's name.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import Snapshot
from kvstore.codecs.arrays import as_mlx, as_numpy, dtype_name
from kvstore.turboquant.codebook import CODEBOOK_ID, codebook
from kvstore.turboquant.packing import packed_words
from kvstore.turboquant.quantizer import (
    DEFAULT_SCALE_MODE,
    SCALE_MODES,
    ScaleMode,
    TurboQuantizer,
    quantizer_for,
)
from kvstore.turboquant.rotation import Rotation, is_power_of_two, rotation_for

__all__ = [
    "MAX_HEAD_DIM",
    "SIDES",
    "SideParams",
    "TurboQuantParams",
    "Unreadable",
    "matrix_digest",
    "read_params",
    "check_described",
]

#: The largest head_dim a reader accepts (real models stop at 256); it bounds the
#: work a crafted record can ask for (a dense reference matrix is a D x D QR).
MAX_HEAD_DIM = 1024
#: Tensor-name prefix and spec kind of each side.
SIDES: tuple[tuple[str, str], ...] = (("keys", "k"), ("values", "v"))
# Dense matrices this process has read or written, by sha256 (most recent last).
_MATRICES: OrderedDict[str, Rotation] = OrderedDict()
_MATRICES_KEPT = 64
_LOCK = threading.Lock()


class Unreadable(ValueError):
    """What makes a snapshot's TurboQuant description unusable (a codec turns it
    into ``CorruptEntryError``)."""


def _digest(matrix: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(matrix, dtype="<f4").tobytes()).hexdigest()


@functools.lru_cache(maxsize=_MATRICES_KEPT)
def matrix_digest(rotation: Rotation) -> str:
    """The sha256 (hex) of a dense rotation's float32 little-endian bytes."""
    assert rotation.matrix is not None
    return _digest(rotation.matrix)


def _remember(rotation: Rotation) -> str:
    digest = matrix_digest(rotation)
    with _LOCK:
        _MATRICES[digest] = rotation
        _MATRICES.move_to_end(digest)
        while len(_MATRICES) > _MATRICES_KEPT:
            _MATRICES.popitem(last=False)
    return digest


def _signs_text(signs: np.ndarray) -> str:
    return "".join("+" if s > 0 else "-" for s in signs.tolist())


@dataclass(frozen=True)
class SideParams:
    """How one side (keys or values) is encoded."""

    bits: int
    scale_mode: ScaleMode
    rotation: Rotation

    def describe(self) -> dict[str, Any]:
        table = codebook(self.bits).centroids.astype(np.float32)
        if self.rotation.signs is not None:
            rotation: dict[str, Any] = {
                "method": "rht",
                "signs": [_signs_text(row) for row in self.rotation.signs],
            }
        else:
            rotation = {"method": "dense", "sha256": _remember(self.rotation)}
        return {
            "bits": self.bits,
            "scale_mode": self.scale_mode,
            "centroids": [float(c) for c in table],
            "rotation": rotation,
        }


@dataclass(frozen=True)
class TurboQuantParams:
    """Everything besides the rows that encoding and decoding one layer needs."""

    head_dim: int
    seed: int
    keys: SideParams
    values: SideParams
    mu: mx.array | None = None  # float32 [H, D]: the key mean (spec option ``center``)

    @classmethod
    def of_cache(cls, cache: Any) -> TurboQuantParams:
        """The parameters a live TurboQuant cache encodes with."""
        dim = int(cache.head_dim)
        return cls(
            dim,
            int(cache.seed),
            SideParams(cache.kbits, cache.key_scale_mode, cache.rotation("k", dim)),
            SideParams(cache.vbits, cache.value_scale_mode, cache.rotation("v", dim)),
            cache.mu,
        )

    @classmethod
    def defaults(cls, kbits: int, vbits: int, head_dim: int) -> TurboQuantParams:
        """The spec's defaults: seed 0, one RHT round (or the dense matrix), keys
        ``matched``, values ``ls``, no centering -- what a new cache uses."""
        return cls(
            head_dim,
            0,
            SideParams(kbits, DEFAULT_SCALE_MODE["k"], rotation_for(head_dim, "k")),
            SideParams(vbits, DEFAULT_SCALE_MODE["v"], rotation_for(head_dim, "v")),
        )

    def quantizers(self) -> tuple[TurboQuantizer, TurboQuantizer]:
        """The key and value quantizers (shared with caches of the same parameters)."""
        return cast(
            tuple[TurboQuantizer, TurboQuantizer],
            tuple(
                quantizer_for(
                    side.bits,
                    self.head_dim,
                    kind,
                    self.seed,
                    side.scale_mode,
                    rotation=side.rotation,
                )
                for side, (_, kind) in zip((self.keys, self.values), SIDES, strict=True)
            ),
        )

    def key_mean(self) -> mx.array | None:
        """``mu`` shaped to broadcast over ``[B, H, T, D]`` keys."""
        return None if self.mu is None else self.mu[:, None, :]

    def describe(self, start: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(meta["tq"], side tensors)`` of a snapshot starting at ``start``."""
        meta = {
            "head_dim": self.head_dim,
            "seed": self.seed,
            "center": self.mu is not None,
            "codebook": CODEBOOK_ID,
            "k": self.keys.describe(),
            "v": self.values.describe(),
        }
        tensors: dict[str, Any] = {}
        if self.mu is not None:
            tensors["keys.mu"] = self.mu
        for (name, _), side in zip(SIDES, (self.keys, self.values), strict=True):
            if start == 0 and side.rotation.matrix is not None:
                tensors[f"{name}.rotation"] = mx.array(side.rotation.matrix)
        return meta, tensors


# -- reading ------------------------------------------------------------------------------


def read_params(snap: Snapshot, kbits: int, vbits: int) -> TurboQuantParams:
    """The parameters ``snap`` was encoded with, each checked against its id.

    Matrices a snapshot carries are remembered, so later blocks of the same
    prefix find them.

    Raises:
        Unreadable: a malformed description, a table or rotation that does not
            match its id, side tensors that do not fit, or a dense rotation
            this host cannot obtain.
    """
    params = _read_params(snap, kbits, vbits, values=True)
    assert params is not None
    return params


def check_described(snap: Snapshot, kbits: int, vbits: int) -> None:
    """:func:`read_params`'s checks of what a record header describes (``snap``'s tensors
    are shapes and dtypes, not values): everything but a dense rotation's matrix and the
    key mean's values, which the restore checks (issue 18: meta validated on decode).

    Raises:
        Unreadable: as :func:`read_params`.
    """
    _read_params(snap, kbits, vbits, values=False)


#: The four tensors of a snapshot whose parameters are its description alone (no key
#: mean, no carried rotation).
_ROWS_ONLY = frozenset(f"{n}.{p}" for n, _ in SIDES for p in ("codes", "scales"))
#: Descriptions already read, by the identity of their ``meta["tq"]`` map: ``id ->
#: (the map, (kbits, vbits), params, full)``. A record's header parse shares one such
#: map among its layers' snapshots and the records of a prefix (its template), so a
#: 4096-token llama-8B restore reads 32 maps, not 1040 (15.8 -> ~4 ms of its Python
#: on the CI VM). The map is held, so its id stays its own while remembered. ``full``:
#: the parameters came from a full read (``values``); a check's (``check_described``)
#: has a stand-in for a dense rotation, so it serves later checks only. The header
#: parse checks every record's map, and the records of a template share theirs: checked
#: once (a TurboQuant restore's header parse ~7.6 -> ~5.9 ms on the CI VM).
_KNOWN: OrderedDict[int, tuple[Any, tuple[int, int], TurboQuantParams, bool]] = OrderedDict()
_KNOWN_MAX = 256
_KNOWN_LOCK = threading.Lock()


def _read_params(
    snap: Snapshot, kbits: int, vbits: int, *, values: bool
) -> TurboQuantParams | None:
    tq = snap.meta.get("tq")
    rows_only = frozenset(snap.tensors) == _ROWS_ONLY
    if rows_only:
        with _KNOWN_LOCK:
            known = _KNOWN.get(id(tq))
        if (
            known is not None
            and known[0] is tq
            and known[1] == (kbits, vbits)
            and (known[3] or not values)
        ):
            params = known[2]  # the description read before; the rows are this snapshot's
            for (name, _), side in zip(SIDES, (params.keys, params.values), strict=True):
                _check_rows(snap, name, side.bits, params.head_dim)
            return params if values else None
    params = _read_described(snap, tq, kbits, vbits, values=values)
    # A full read only of RHT rotations (a dense matrix is loaded per prefix); a check
    # of any, never in place of a full read's entry.
    rht = params.keys.rotation.method == params.values.rotation.method == "rht"
    if rows_only and params.mu is None and (rht or not values):
        with _KNOWN_LOCK:
            held = _KNOWN.get(id(tq))
            if values or held is None or not held[3]:
                _KNOWN[id(tq)] = (tq, (kbits, vbits), params, values)
            while len(_KNOWN) > _KNOWN_MAX:
                _KNOWN.popitem(last=False)
    return params if values else None


def _read_described(
    snap: Snapshot, tq: Any, kbits: int, vbits: int, *, values: bool
) -> TurboQuantParams:
    """Every check of :func:`_read_params`, and the parameters (``mu`` read only with
    ``values``)."""
    if not isinstance(tq, Mapping):
        raise Unreadable(f"meta 'tq' must be a map; received {type(tq).__name__}")
    expected = {"head_dim", "seed", "center", "codebook", "k", "v"}
    if set(tq) != expected:
        raise Unreadable(f"meta 'tq' has fields {sorted(tq)}, not {sorted(expected)}")
    dim, seed, center = tq["head_dim"], tq["seed"], tq["center"]
    if not (type(dim) is int and 0 < dim <= MAX_HEAD_DIM):
        raise Unreadable(f"tq head_dim {dim!r} is not an int in [1, {MAX_HEAD_DIM}]")
    if not (type(seed) is int and 0 <= seed < 1 << 64):
        raise Unreadable(f"tq seed {seed!r} is not a uint64")
    if type(center) is not bool:
        raise Unreadable(f"tq center {center!r} is not a bool")
    if tq["codebook"] != CODEBOOK_ID:
        raise Unreadable(f"codebook {tq['codebook']!r} is not {CODEBOOK_ID!r}")
    sides = []
    for (name, kind), bits in zip(SIDES, (kbits, vbits), strict=True):
        _check_rows(snap, name, bits, dim)
        sides.append(_read_side(snap, name, kind, bits, dim, seed, values))
    mu = _read_mean(snap, dim, values) if center else None
    allowed = {f"{n}.{p}" for n, _ in SIDES for p in ("codes", "scales", "rotation")}
    allowed |= {"keys.mu"} if center else set()
    stray = sorted(set(snap.tensors) - allowed)
    if stray:
        raise Unreadable(f"tensors {stray} do not belong to this snapshot")
    rounds = {s.rotation.rounds for s in sides}
    if len(rounds) != 1:
        raise Unreadable(f"keys and values use RHT rounds {sorted(rounds)}; one cache has one")
    return TurboQuantParams(dim, seed, sides[0], sides[1], mu)


def _read_side(
    snap: Snapshot, name: str, kind: str, bits: int, dim: int, seed: int, values: bool
) -> SideParams:
    desc = snap.meta["tq"][kind]
    fields = {"bits", "scale_mode", "centroids", "rotation"}
    if not isinstance(desc, Mapping) or set(desc) != fields:
        raise Unreadable(f"tq '{kind}' must be a map with fields {sorted(fields)}")
    if desc["bits"] != bits:
        raise Unreadable(f"tq '{kind}' bits {desc['bits']!r} differ from the signature's {bits}")
    if desc["scale_mode"] not in SCALE_MODES:
        raise Unreadable(
            f"tq '{kind}' scale_mode {desc['scale_mode']!r} is not one of {SCALE_MODES}"
        )
    table = codebook(bits).centroids.astype(np.float32).tolist()
    if desc["centroids"] != table:
        raise Unreadable(
            f"tq '{kind}' centroids {desc['centroids']!r} are not the {bits}-bit "
            f"{CODEBOOK_ID} table"
        )
    carried = snap.tensors.get(f"{name}.rotation")
    rotation = _read_rotation(desc["rotation"], kind, dim, seed, carried, name, values)
    return SideParams(bits, desc["scale_mode"], rotation)


def _read_rotation(
    desc: Any, kind: str, dim: int, seed: int, carried: Any, name: str, values: bool = True
) -> Rotation:
    method = desc.get("method") if isinstance(desc, Mapping) else None
    if method == "rht" and set(desc) == {"method", "signs"}:
        if carried is not None:
            raise Unreadable(f"tensor '{name}.rotation' given with an RHT rotation")
        return _rht_rotation(desc["signs"], kind, dim, seed)
    if method == "dense" and set(desc) == {"method", "sha256"}:
        if not values:
            return _described_dense(desc["sha256"], kind, dim, carried, name)
        return _dense_rotation(desc["sha256"], kind, dim, seed, carried, name)
    raise Unreadable(
        f"tq '{kind}' rotation {desc!r} is neither {{method: rht, signs}} nor "
        f"{{method: dense, sha256}}"
    )


@functools.lru_cache(maxsize=256)
def _expected_signs(dim: int, kind: str, seed: int, rounds: int) -> list[str]:
    """The sign strings an RHT rotation's description must hold. Remembered: every
    block record of a prefix describes the same rotation (the text was 60% of the
    header parse of a kv:turboquant:4:4 record, in 128 layers x kinds per record)."""
    rotation = rotation_for(dim, kind, seed, rounds)
    assert rotation.signs is not None
    return [_signs_text(row) for row in rotation.signs]


def _rht_rotation(signs: Any, kind: str, dim: int, seed: int) -> Rotation:
    if not is_power_of_two(dim):
        raise Unreadable(f"an RHT rotation needs a power-of-two head_dim; received {dim}")
    if not (isinstance(signs, list) and len(signs) in (1, 2)):
        raise Unreadable(f"tq '{kind}' signs must be a list of 1 or 2 strings")
    rotation = rotation_for(dim, kind, seed, len(signs))
    if signs != _expected_signs(dim, kind, seed, len(signs)):
        raise Unreadable(
            f"tq '{kind}' signs are not SplitMix64's for seed {seed} (D={dim}, {len(signs)} rounds)"
        )
    return rotation


def _described_dense(digest: Any, kind: str, dim: int, carried: Any, name: str) -> Rotation:
    """A dense rotation's description checked (its matrix is checked at restore); a
    stand-in rotation for the rest of the checks."""
    if not (isinstance(digest, str) and len(digest) == 64):
        raise Unreadable(f"tq '{kind}' sha256 {digest!r} is not 64 hex digits")
    if carried is not None and (
        dtype_name(carried) != "float32" or tuple(carried.shape) != (dim, dim)
    ):
        raise Unreadable(
            f"tensor '{name}.rotation' is {dtype_name(carried)} {tuple(carried.shape)}, "
            f"not float32 ({dim}, {dim})"
        )
    return _stand_in(dim)


@functools.lru_cache(maxsize=16)
def _stand_in(dim: int) -> Rotation:
    return Rotation(dim, matrix=np.eye(dim, dtype=np.float32))


def _dense_rotation(
    digest: Any, kind: str, dim: int, seed: int, carried: Any, name: str
) -> Rotation:
    if not (isinstance(digest, str) and len(digest) == 64):
        raise Unreadable(f"tq '{kind}' sha256 {digest!r} is not 64 hex digits")
    if carried is not None:
        if dtype_name(carried) != "float32" or tuple(carried.shape) != (dim, dim):
            raise Unreadable(
                f"tensor '{name}.rotation' is {dtype_name(carried)} {tuple(carried.shape)}, "
                f"not float32 ({dim}, {dim})"
            )
        matrix = as_numpy(carried)
        if _digest(matrix) != digest:
            raise Unreadable(f"tensor '{name}.rotation' does not hash to its sha256 {digest}")
    with _LOCK:
        known = _MATRICES.get(digest)
    if known is not None and known.dim == dim:
        return known
    if carried is not None:
        # An owned copy: the table outlives the record the view points into.
        rotation = Rotation(dim, matrix=np.array(matrix, dtype=np.float32))
        _remember(rotation)
        return rotation
    reference = rotation_for(dim, kind, seed)
    if reference.matrix is not None and matrix_digest(reference) == digest:
        _remember(reference)
        return reference
    raise Unreadable(
        f"the dense {kind} rotation (sha256 {digest[:16]}...) is not in this snapshot and "
        f"this host's reference matrix for seed {seed} differs; restore it together with "
        f"the snapshot starting at token 0, which carries it"
    )


def _check_rows(snap: Snapshot, name: str, bits: int, dim: int) -> None:
    codes, scales = snap.tensors[f"{name}.codes"], snap.tensors[f"{name}.scales"]
    words = packed_words(dim, bits)
    if len(codes.shape) != 4 or int(codes.shape[3]) != words:
        raise Unreadable(
            f"{name}.codes is {tuple(codes.shape)}; {bits}-bit codes of D={dim} are "
            f"[B, H, T, {words}]"
        )
    if tuple(scales.shape) != tuple(codes.shape[:3]):
        raise Unreadable(f"{name}.scales is {tuple(scales.shape)}, not {tuple(codes.shape[:3])}")


def _read_mean(snap: Snapshot, dim: int, values: bool = True) -> mx.array | None:
    mu = snap.tensors.get("keys.mu")
    heads = int(snap.tensors["keys.codes"].shape[1])
    if mu is None or dtype_name(mu) != "float32" or tuple(mu.shape) != (heads, dim):
        found = None if mu is None else (dtype_name(mu), tuple(mu.shape))
        raise Unreadable(f"centred keys need keys.mu float32 ({heads}, {dim}); received {found}")
    return as_mlx(mu) if values else None
