"""Tiered prefix stores: memory -> local LMDB -> shared Redis, each a whole prefix store.

``open_store("tiered", tiers=["memory://", "lmdb:///var/kv", "redis://cache:6379/0"])``
(or the URL form in :func:`kvstore.store.open_store`) stacks complete stores,
fastest first. Each tier keeps its own index, budget and eviction, so a small
memory tier and a large shared Redis simply hold different amounts.

* **Lookups go fast to slow** and stop at the first tier that matches all it
  can (every prompt token but the last); otherwise the longest match of any
  tier wins. A tier that is unreachable counts as a miss of that tier.
  Tiers the lookup did not need to ask are told of the use (``touch``,
  batched), so their eviction still sees what is in use.
* **Reads** take each block from the fastest tier holding it, in runs.
* **Promotion**: blocks read from a slower tier are written into every faster
  tier, in a background thread (the restore does not wait for it); a block
  is promotable when the lookup knows its tokens (it lies wholly inside the
  prompt). Payloads from Redis are promoted without a copy.
* **Saves write through** (default): every tier, fastest first, each encoding
  only what it lacks and no block encoded twice; a tier that is unreachable
  does not stop the others, and its ``StoreUnavailableError`` is raised after
  them. **Write back** (``write="back"``): the fastest tier now, the others
  in the background from the fastest tier's copy.

Stats report the slowest tier's contents and evictions (it holds the
authoritative copy) and this store's activity as its callers saw it:
lookups, hits, saves, and a read miss (with its reason, a corruption
counted) only when no tier could serve a block; ``stats().backend["tiers"]``
has each tier's own figures.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from functools import partial
from typing import Any, Literal

import numpy as np

from kvstore.abc.store import (
    BlockRef,
    BlockSpan,
    Match,
    MissReason,
    PrefixStore,
    RecordEncoder,
    SaveResult,
    StoreSettings,
    StoreStats,
    VerifyReport,
)
from kvstore.errors import StoreConfigError, StoreUnavailableError
from kvstore.store import keys as K
from kvstore.store.blocks.stats import Counters
from kvstore.store.kv import CacheMethods
from kvstore.store.settings import parse_byte_size

__all__ = ["TieredPrefixStore", "WRITE_MODES"]

WRITE_MODES = ("through", "back")
_REMEMBERED = 4096  # blocks of recent lookups whose tier and tokens are kept for reads


class _Background:
    """One daemon thread running jobs in order; :meth:`drain` waits for the queue."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-tiers", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - a failed copy is a cache miss later
                self.last_error = exc
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def drain(self) -> None:
        if self._thread is not None:
            self._jobs.join()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


class _Records:
    """An encoder that calls the caller's ``encode`` at most once per block, across tiers."""

    def __init__(
        self,
        encode: RecordEncoder | None,
        fallback: Callable[[list[BlockSpan]], list[Any]] | None = None,
    ) -> None:
        self._encode = encode
        self._fallback = fallback
        self.by_key: dict[bytes, Any] = {}

    def __call__(self, spans: Sequence[BlockSpan]) -> list[Any]:
        todo = [s for s in spans if s.key not in self.by_key]
        if todo:
            source = self._encode if self._encode is not None else self._fallback
            if source is None:
                raise LookupError("no record for these blocks")
            records = list(source(todo))
            if len(records) != len(todo):
                return records  # the tier's own check names the mismatch
            self.by_key.update((s.key, r) for s, r in zip(todo, records))
        return [self.by_key[s.key] for s in spans]


def _owned(view: memoryview) -> Any:
    """The bytes behind ``view`` without a copy when it wraps a whole bytes object
    (a Redis payload), else a copy (an LMDB page must not outlive its transaction)."""
    base = view.obj
    if isinstance(base, bytes) and len(base) == view.nbytes:
        return base
    return view.tobytes()


def _new_miss(before: dict[str, int], after: dict[str, int]) -> str | None:
    """The miss reason a tier counted between two activity snapshots."""
    for reason, count in after.items():
        if count > before.get(reason, 0):
            return reason
    return None


def _known_stop(match: Match, ref: BlockRef) -> int | None:
    """Where ``ref``'s stored tokens end, if they all lie in the prompt (else ``None``).

    A block is wholly in the prompt when the match uses all its rows, or all
    but the last only because one prompt token is always left to the model.
    """
    stop = ref.start + ref.stored_rows
    if not ref.trimmed or (stop == match.prompt_tokens and ref.stop == stop - 1):
        return stop
    return None


class TieredPrefixStore(CacheMethods, PrefixStore):
    """Prefix stores stacked fastest first (see the module docstring).

    Args:
        tiers: open stores, fastest first (at least two; same block size).
        write: ``"through"`` (default) or ``"back"``.
        promote: copy blocks read from a slower tier into the faster ones.
        url: how to name the store in messages.
    """

    def __init__(
        self,
        tiers: Sequence[PrefixStore],
        *,
        write: Literal["through", "back"] = "through",
        promote: bool = True,
        url: str | None = None,
    ) -> None:
        tiers = list(tiers)
        if len(tiers) < 2:
            raise StoreConfigError(
                f"[open_store] A tiered store needs at least two tiers, fastest first; "
                f"received {len(tiers)}.",
                found=len(tiers),
            )
        sizes = {t.block_size for t in tiers}
        if len(sizes) > 1:
            raise StoreConfigError(
                f"[open_store] Every tier must use one block size (keys name blocks); the "
                f"tiers have {', '.join(f'{t.url}: {t.block_size}' for t in tiers)}. Open "
                f"them with the same block_size.",
                found=sorted(sizes),
            )
        if write not in WRITE_MODES:
            raise StoreConfigError(
                f"[open_store] write is 'through' or 'back'; received {write!r}.",
                setting="write",
                found=write,
            )
        super().__init__(None)
        self.tiers = tiers
        self.write = write
        self.promote = promote
        self._url = url or "tiered://?tiers=" + ",".join(t.url for t in tiers)
        self._counters = Counters()
        # block key -> (fastest tier holding it, namespace, tokens up to its end or None)
        self._seen: OrderedDict[bytes, tuple[int, str, np.ndarray | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._background = _Background()

    @property
    def url(self) -> str:
        return self._url

    @property
    def read_only(self) -> bool:
        return any(t.read_only for t in self.tiers)

    @property
    def settings(self) -> StoreSettings:
        return self.tiers[-1].settings

    @property
    def background_error(self) -> BaseException | None:
        """The error of the last background promotion or write-back, if it failed."""
        return self._background.last_error

    # ------------------------------------------------------------------ lookup

    def lookup(self, namespace: str, tokens: Any, *, checkpoints: bool = False) -> Match:
        self._check_open("lookup")
        toks = K.as_tokens(tokens, "lookup")
        self.wait_for_saves(namespace, toks)  # a process reads its own saves handed off
        self._counters.add(lookups=1)
        best: Match | None = None
        holders: dict[bytes, int] = {}
        asked = 0
        for i, tier in enumerate(self.tiers):
            asked = i + 1
            try:
                match = tier.lookup(namespace, toks, checkpoints=checkpoints)
            except StoreUnavailableError:
                self._counters.miss(MissReason.UNAVAILABLE)
                continue
            for ref in match.blocks:
                holders.setdefault(ref.key, i)
            if best is None or (match.tokens, match.kv_matched) > (best.tokens, best.kv_matched):
                best = match
            if match.prompt_tokens < 2 or match.tokens >= match.prompt_tokens - 1:
                break  # nothing slower can match more
        if best is None:
            raise StoreUnavailableError(
                f"[lookup] No tier of {self.url} could be reached.", url=self.url
            )
        if not best.hit:
            if best.prompt_tokens < 2:
                self._counters.miss(MissReason.SHORT_PROMPT)
            elif best.kv_matched:
                self._counters.miss(MissReason.NO_CHECKPOINT)
            else:
                self._counters.miss(MissReason.COLD)
            return best
        self._counters.add(hits=1, hit_tokens=best.tokens)
        self._remember(best, toks, holders)
        keys = [ref.key for ref in best.blocks]
        for tier in self.tiers[asked:]:
            tier.touch(keys)
        return best

    def _remember(self, match: Match, toks: np.ndarray, holders: dict[bytes, int]) -> None:
        with self._lock:
            for ref in match.blocks:
                stop = _known_stop(match, ref)
                prefix = None if stop is None else toks[:stop]
                self._seen[ref.key] = (holders[ref.key], match.namespace, prefix)
                self._seen.move_to_end(ref.key)
            while len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)

    # ------------------------------------------------------------------ read

    def _plan(self, blocks: Sequence[BlockRef]) -> list[int | None]:
        """The fastest tier holding each block (what the lookup saw, else asked now)."""
        with self._lock:
            plan = [self._seen[b.key][0] if b.key in self._seen else None for b in blocks]
        unknown = [i for i, t in enumerate(plan) if t is None]
        for t, tier in enumerate(self.tiers):
            if not unknown:
                break
            held = tier.holds([blocks[i].key for i in unknown])
            for i, present in zip(list(unknown), held):
                if present:
                    plan[i] = t
                    unknown.remove(i)
        return plan

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether any tier holds each block (tiers that cannot be reached hold nothing)."""
        self._check_open("holds")
        held = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(held) if not h]
            if not todo:
                break
            try:
                for i, present in zip(todo, tier.holds([keys[i] for i in todo])):
                    held[i] = present
            except StoreUnavailableError:
                continue
        return held

    @contextmanager
    def read(self, blocks: Sequence[BlockRef]) -> Iterator[list[memoryview]]:
        """Verified views of ``blocks``, each from the fastest tier holding a good copy.

        A block a tier cannot serve (corrupt, vanished, evicted by its server)
        is tried in the slower tiers holding it before the read stops short.
        """
        self._check_open("read")
        plan = self._plan(blocks)
        views: list[memoryview] = []
        promoted: dict[bytes, Any] = {}
        reason: str | None = None
        with ExitStack() as stack:
            i = 0
            while i < len(blocks):
                tier = plan[i]
                if tier is None:
                    reason = reason or MissReason.VANISHED
                    break
                j = i
                while j < len(blocks) and plan[j] == tier:
                    j += 1
                run = blocks[i:j]
                before = self.tiers[tier].activity().get("misses", {})
                got = stack.enter_context(self.tiers[tier].read(run))
                views += got
                if tier and self.promote:
                    promoted.update((ref.key, (tier, _owned(v))) for ref, v in zip(run, got))
                i += len(got)
                if len(got) < len(run):
                    reason = _new_miss(before, self.tiers[tier].activity().get("misses", {}))
                    plan[i] = self._slower_holder(blocks[i].key, tier)
                    continue
                reason = None
            if i < len(blocks):
                self._counters.miss(reason or MissReason.VANISHED)
                if reason == MissReason.CORRUPT:
                    self._counters.add(corruptions=1)
            yield views
        if promoted:
            self._schedule_promotion(promoted)

    def _slower_holder(self, key: bytes, tier: int) -> int | None:
        """The fastest tier slower than ``tier`` that holds ``key``."""
        for t in range(tier + 1, len(self.tiers)):
            if self.tiers[t].holds([key])[0]:
                return t
        return None

    def _schedule_promotion(self, promoted: dict[bytes, tuple[int, Any]]) -> None:
        """Queue a save, into every tier faster than the slowest source, of the longest
        known prefix per namespace among the promoted blocks (the rest deduplicates)."""
        longest: dict[str, np.ndarray] = {}
        with self._lock:
            for key in promoted:
                seen = self._seen.get(key)
                if seen is not None and seen[2] is not None:
                    namespace, prefix = seen[1], seen[2]
                    if namespace not in longest or len(prefix) > len(longest[namespace]):
                        longest[namespace] = prefix
        slowest = max(tier for tier, _ in promoted.values())
        records = _Records(None)
        records.by_key.update((key, record) for key, (_, record) in promoted.items())
        for namespace, prefix in longest.items():
            self._background.submit(
                partial(self._copy_into, self.tiers[:slowest], namespace, prefix, records)
            )

    @staticmethod
    def _copy_into(
        tiers: Sequence[PrefixStore], namespace: str, tokens: np.ndarray, records: _Records
    ) -> None:
        for tier in tiers:
            try:
                tier.put_blocks(namespace, tokens, records)
            except LookupError:
                continue  # this tier lacks a block nobody read: leave it to a later save

    # ------------------------------------------------------------------ save

    def put_blocks(
        self,
        namespace: str,
        tokens: Any,
        encode: RecordEncoder,
        *,
        family: str = "",
        checkpoints: Collection[int] = (),
    ) -> SaveResult:
        self._check_open("save")
        records = _Records(encode)
        self._counters.add(saves=1)
        if self.write == "back":
            toks = np.array(K.as_tokens(tokens, "save"))  # owned: the caller may reuse its list
            result = self.tiers[0].put_blocks(
                namespace, toks, records, family=family, checkpoints=checkpoints
            )
            self._count_save(result)
            fallback = _Records(None, self._reader_of(self.tiers[0]))
            fallback.by_key.update(records.by_key)
            self._background.submit(
                lambda: self._write_back(namespace, toks, fallback, family, checkpoints)
            )
            return result
        results: list[SaveResult] = []
        unavailable: StoreUnavailableError | None = None
        for tier in self.tiers:
            try:
                results.append(
                    tier.put_blocks(
                        namespace, tokens, records, family=family, checkpoints=checkpoints
                    )
                )
            except StoreUnavailableError as exc:
                unavailable = unavailable or exc
        if unavailable is not None:
            raise unavailable
        self._count_save(results[-1])
        return results[-1]

    def _count_save(self, result: SaveResult) -> None:
        self._counters.add(
            saved_blocks=len(result.written),
            saved_bytes=result.written_bytes,
            deduplicated_blocks=result.deduplicated,
        )

    def _write_back(
        self,
        namespace: str,
        toks: np.ndarray,
        records: _Records,
        family: str,
        checkpoints: Collection[int] = (),
    ) -> None:
        for tier in self.tiers[1:]:
            tier.put_blocks(namespace, toks, records, family=family, checkpoints=checkpoints)

    @staticmethod
    def _reader_of(tier: PrefixStore) -> Callable[[list[BlockSpan]], list[Any]]:
        """Records of ``spans`` read back from ``tier`` (copies), for a write-back."""

        def read(spans: list[BlockSpan]) -> list[Any]:
            refs = [BlockRef(s.key, s.index, s.start, s.tokens, s.tokens) for s in spans]
            with tier.read(refs) as views:
                if len(views) < len(refs):
                    raise LookupError("a block left the fast tier before it was written back")
                return [v.tobytes() for v in views]

        return read

    # ------------------------------------------------------------------ the rest: every tier

    def delete(self, namespace: str, tokens: Any = ()) -> int:
        self._check_writable("delete")
        self.wait_for_saves()  # after the saves handed off before this call
        self._background.drain()  # a queued promotion must not bring deleted blocks back
        with self._lock:
            self._seen.clear()
        return [t.delete(namespace, tokens) for t in self.tiers][-1]

    def evict(self, *, namespace: str | None = None, max_bytes: int | str | None = None) -> int:
        """Evict in every tier; returns the bytes the slowest tier freed."""
        self._check_writable("evict")
        self.wait_for_saves()  # after the saves handed off before this call
        limit = None if max_bytes is None else parse_byte_size(max_bytes, "max_bytes")
        return [t.evict(namespace=namespace, max_bytes=limit) for t in self.tiers][-1]

    def set_budget(self, max_bytes: int | str | None, *, namespace: str | None = None) -> None:
        """Set the byte budget of the store or of a namespace in every tier."""
        self._check_writable("set_budget")
        for tier in self.tiers:
            tier.set_budget(max_bytes, namespace=namespace)

    def activity(self) -> dict[str, Any]:
        """This store's own activity (no tier is asked, so it works with one down)."""
        return self._counters.snapshot()

    def touch(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            tier.touch(keys)

    def flush(self) -> None:
        self._check_open("flush")
        self.wait_for_saves()
        self._background.drain()
        for tier in self.tiers:
            tier.flush()

    def stats(self, *, by_family: bool = False) -> StoreStats:
        self._check_open("stats")
        self.wait_for_saves()  # after the saves handed off before this call
        per_tier = [t.stats(by_family=by_family) for t in self.tiers]
        own = self._counters.snapshot()
        for name in ("evictions", "evicted_bytes", "evicted_checkpoint_bytes"):
            del own[name]  # the slowest tier's: it holds the authoritative copy
        last = per_tier[-1]
        return replace(
            last,
            backend={
                "engine": "tiered",
                "write": self.write,
                "tiers": [{"url": t.url, **asdict(s)} for t, s in zip(self.tiers, per_tier)],
            },
            **own,
        )

    def verify(self, *, repair: bool = False) -> VerifyReport:
        self._check_open("verify")
        self.wait_for_saves()  # after the saves handed off before this call
        reports = [t.verify(repair=repair) for t in self.tiers]

        def union(name: str) -> tuple[Any, ...]:
            return tuple(dict.fromkeys(x for r in reports for x in getattr(r, name)))

        return replace(
            reports[-1],
            corrupt=union("corrupt"),
            newer_format=union("newer_format"),
            orphans=union("orphans"),
            dangling=union("dangling"),
            totals_mismatch=union("totals_mismatch"),
            repaired=any(r.repaired for r in reports),
        )

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.stop_writer()
            self._background.close()
        finally:
            self._closed = True
            with ExitStack() as closing:  # every tier closes, even after one raised
                for tier in self.tiers:
                    closing.callback(tier.close)

    def __repr__(self) -> str:
        return f"TieredPrefixStore({self.url!r}, write={self.write!r})"
