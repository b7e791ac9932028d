"""Host memory that a restore's arrays and a store's values reuse instead of faulting in afresh.

On Linux, MLX's CPU arrays come from ``malloc``, and glibc serves each one
of more than 128 KiB to 32 MiB (its ``M_MMAP_THRESHOLD``, which it raises as
big blocks are freed) from a fresh ``mmap``, returned to the kernel on free.
Every restore then faults in and zero-fills every page of its caches, and it
costs more than copying the rows: a 2048-token llama-8B restore (256 MiB) took
315 ms on the 2-core CI VM, of which the copy into the arrays was 250 ms;
mlx-lm's ``load_prompt_cache`` of the same cache, 72 ms.

:func:`keep_freed_memory` makes glibc keep freed blocks up to 2 GiB in its
heap for the next allocation (``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` at
:data:`KEEP_BYTES`), the way MLX's GPU allocators keep a buffer cache: the same
restore then takes 97 ms, and 8192 tokens 1254 -> 360 ms (mlx-lm's load 72 -> 21 ms
in the same process: the setting is the process's, so it helps every
allocation there). The process's resident memory stays near its peak instead
of shrinking after a restore is dropped. Opening a store applies it
(``kvstore.store.open_store`` and ``open_backend``), and so does a CPU restore's fill
of its arrays (records may be restored without a store). Every large value a store
moves is such a block: LMDB copies each record into pages it allocates per
transaction and frees at the commit, so every save faulted them in afresh (LMDB's put
of 128 MiB: 62-81 ms -> 28 ms on the same VM, ``tools/bench/save_profile.py``; P2's
durable save of 2048 tokens of llama-8B 342 -> 255 ms, of 8192 1.95 s -> 925 ms; 8
records of 32 MiB through ``put_blocks`` 1.3 s -> 0.73 s); a Redis reply is a fresh
block as large as its chunk (P9's 256 MiB: 368 -> 213 ms, ``tools/bench/redis_transfer.py``).
A server opens its store before it loads the model (``kvstore serve``), so on the CPU
the load's freed temporaries stay in the heap too, for the caches after them. Until the
thirtieth session a save applied it when its encoder was made, and a process
that had only saved behind once before that never had it: on an H200, G3's 512 MiB
lossless save took 743 ms against 381 with it (``tools/bench/results/gpu/1f9aae7/``).

Memory faulted in for the first time is slow on these machines (the microVMs fault a
guest page in at 1.4-2 GB/s, ``kvstore bench``'s machine line), and a process's first
restore writes its arrays into such memory. :func:`advise_huge_pages` asks Linux to
back a fresh buffer with 2 MiB pages (``MADV_HUGEPAGE``; transparent huge pages are
commonly enabled for memory so advised only, as here), as numpy does for its own large
arrays but MLX does not: one fault per 2 MiB instead of 512, and fewer TLB misses in
every copy after (256 MiB copied in 19.6 ms against 21.3-22.2 on 4 KiB pages here). A
fresh process's first 2048-token llama-8B restore took 48-57 ms against 104-119
(``tools/bench/first_restore.py``, ``tools/bench/results/cpu-thp/``).

It is off unless ``KVSTORE_HUGE_PAGES=1``. Huge pages have to be found whole: where
free memory is in pieces (a server's page cache full of model weights, a VM that has
run a while), each fault of an advised buffer waits for the kernel to compact memory.
In ``kvstore bench``'s D2 (a fresh process's first restore) a 1 GiB restore (llama-8B,
8192 tokens) took 591-1146 ms advised against 353-602 not, the kernel's direct
compactions counted meanwhile, while a 256 MiB one took 47-88 ms (one 250) against
96-107.

``KVSTORE_HOST_MALLOC=os`` leaves the allocator and the pages as they are. Elsewhere
(macOS, musl, a GPU's memory) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import threading
from typing import Any

import numpy as np

from kvstore.knobs import choice_from_env

__all__ = [
    "HUGE_MIN_BYTES",
    "HUGE_PAGES",
    "KEEP_BYTES",
    "MALLOC",
    "advise_huge_pages",
    "keep_freed_memory",
]

#: Blocks up to this size are served from (and freed back to) glibc's heap: the largest
#: value ``mallopt`` takes (an ``int``). At 1 GiB, freeing a 1 GiB restore (llama-8B,
#: 8192 tokens) left more than that free at the heap's top, which glibc trimmed: every
#: later restore of it faulted its 262K pages in again (350 ms against 150 kept, on
#: the 2-core CI VM).
KEEP_BYTES = (1 << 31) - 1

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Linux's mman.h, and the size of the pages it advises
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
#: Buffers smaller than this are not advised (no 2 MiB page fits them reliably, and the
#: call would cost more than it saves).
HUGE_MIN_BYTES = 4 << 20

#: ``KVSTORE_HOST_MALLOC``: ``keep`` (freed blocks kept, as above) or ``os`` (the
#: allocator left as it is); read when this module loads.
MALLOC = choice_from_env("KVSTORE_HOST_MALLOC", ("keep", "os"), "keep")
#: ``KVSTORE_HUGE_PAGES=1``: a CPU restore advises its fresh buffers 2 MiB pages (off
#: by default: see the module).
HUGE_PAGES = choice_from_env("KVSTORE_HUGE_PAGES", ("0", "1"), "0") == "1"

_LOCK = threading.Lock()
_APPLIED: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the setting once per process (see the module); whether it is in force."""
    global _APPLIED
    with _LOCK:
        if _APPLIED is None:
            _APPLIED = _apply()
        return _APPLIED


def _apply() -> bool:
    if MALLOC == "os":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # Both or neither: a high mmap threshold alone would still trim the heap back.
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)
    )


def advise_huge_pages(buffer: np.ndarray) -> None:
    """Ask Linux to back ``buffer``'s pages not yet faulted in with 2 MiB pages (the
    whole 2 MiB pages inside it; see the module). Call it on fresh memory, before
    writing it: pages already there stay as they are. Nothing with
    ``KVSTORE_HOST_MALLOC=os``, off Linux, or for buffers under :data:`HUGE_MIN_BYTES`;
    a kernel that refuses the advice changes nothing. Whether to ask is the caller's
    (a restore: :data:`HUGE_PAGES`)."""
    madvise = _madvise()
    if buffer.nbytes < HUGE_MIN_BYTES or madvise is None:
        return
    address = int(buffer.ctypes.data)
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + buffer.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, or ``None`` where huge pages are not to be advised."""
    if MALLOC == "os" or platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
