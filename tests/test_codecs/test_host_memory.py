"""The host allocator setting that opening a store or a CPU restore applies
(kvstore.codecs.host_memory): freed blocks are kept for the next arrays and values instead
of given back and faulted in again. Each case runs in a fresh process, since the setting
is the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

#: What applies the setting: a CPU restore's fill, opening a store or a backend (whatever
#: is done with it after), or a save (made now or behind) on an opened store.
TRIGGERS = {
    "open_store": (
        "import tempfile; from kvstore.store import open_store; "
        'open_store("lmdb://" + tempfile.mkdtemp() + "/s").close()'
    ),
    "open_backend": (
        'from kvstore.store import open_backend; open_backend("memory://heap").close()'
    ),
    "restore": 'fill.filled_arrays([((2, 3), "float32")], lambda i, view: view.fill(1))',
    "save": (
        "import mlx.core as mx; from kvstore.caches import KVCache; "
        "from kvstore.store import open_store; cache = KVCache(); "
        "cache.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8))); "
        'open_store("memory://", block_size=4).save("ns", [1, 2, 3, 4], [cache])'
    ),
    # A process that only saves behind (a server, G3) applies it too: its writer's LMDB
    # pages were faulted in afresh on every commit.
    "save_behind": (
        "import mlx.core as mx; from kvstore.caches import KVCache; "
        "from kvstore.store import open_store; cache = KVCache(); "
        "cache.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8))); "
        'store = open_store("memory://", block_size=4); '
        'store.save_behind("ns", [1, 2, 3, 4], [cache]); store.flush()'
    ),
}

SCRIPT = """
import numpy as np
from kvstore.codecs import fill, host_memory

def rss_kib():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1])

{trigger}
print(host_memory._APPLIED)
block = np.ones({block_bytes}, np.uint8)  # every page touched
peak = rss_kib()
del block
print(peak - rss_kib())  # KiB the free gave back to the kernel
"""

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's (elsewhere keep_freed_memory does nothing)",
)


def _run(trigger: str = "restore", block_bytes: int = 64 << 20, **env: str) -> tuple[str, int]:
    script = SCRIPT.replace("{trigger}", TRIGGERS[trigger])
    out = subprocess.run(
        [sys.executable, "-c", script.replace("{block_bytes}", str(block_bytes))],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_each_trigger_keeps_freed_blocks_for_the_next_arrays(trigger):
    applied, given_back_kib = _run(trigger)
    assert applied == "True"
    assert given_back_kib < 16 << 10  # the 64 MiB stayed in the heap, for reuse


def test_a_freed_restore_bigger_than_a_gib_stays_for_the_next():
    # A 1 GiB restore (llama-8B, 8192 tokens) freed more than 1 GiB at the heap's top,
    # which a 1 GiB trim threshold gave back: every repeat faulted it in again.
    applied, given_back_kib = _run(block_bytes=(5 << 30) // 4)
    assert applied == "True"
    assert given_back_kib < 16 << 10


def test_kvstore_host_malloc_os_leaves_the_allocator_as_it_was():
    applied, given_back_kib = _run(KVSTORE_HOST_MALLOC="os")
    assert applied == "False"
    assert given_back_kib > 48 << 10  # glibc's own way: the block went back to the kernel


# ---------------------------------------------------------------- huge pages

HUGE_SCRIPT = """
import mlx.core as mx
from kvstore.codecs import fill

def anon_huge_kib():
    with open("/proc/self/smaps_rollup") as f:
        return int(next(l for l in f if l.startswith("AnonHugePages")).split()[1])

before = anon_huge_kib()
specs = [((1, 8, 2048, 128), "bfloat16")] * 8  # 32 MiB through the loader: fresh buffers
arrays = fill.filled_arrays(specs, lambda i, view: view.fill(i), direct=True)
mx.eval(arrays)
print(anon_huge_kib() - before)
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def _printed(script: str, **env: str) -> list[str]:
    """What ``script`` printed, run in a fresh process with ``env`` added."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout.split()


def _huge_kib(**env: str) -> int:
    return int(_printed(HUGE_SCRIPT, **env)[-1])


@pytest.mark.skipif(
    _thp_mode() != "madvise",
    reason=f"transparent huge pages are {_thp_mode()!r} here, not given on advice",
)
def test_a_restores_fresh_buffers_are_backed_by_huge_pages_only_when_asked():
    # MLX allocates the loader's buffers without advice (numpy advises its own large
    # arrays): asked, a fresh process's first restore faults 2 MiB pages.
    assert _huge_kib() == 0  # off by default: a fault may wait for compaction
    # Asked: 2 MiB pages, as many as the kernel has whole (most of the 32 MiB on a quiet
    # machine; 14 MiB once on a CI VM after the whole suite had fragmented its memory).
    assert _huge_kib(KVSTORE_HUGE_PAGES="1") >= 4 << 10
    assert _huge_kib(KVSTORE_HUGE_PAGES="1", KVSTORE_HOST_MALLOC="os") == 0


def test_the_advice_covers_the_whole_huge_pages_inside_a_buffer_only(monkeypatch):
    import numpy as np

    from kvstore.codecs import host_memory

    advised = []
    monkeypatch.setattr(
        host_memory, "_madvise", lambda: lambda start, n, advice: advised.append((start, n))
    )
    buffer = np.empty(9 << 20, np.uint8)
    address = buffer.ctypes.data
    host_memory.advise_huge_pages(buffer)
    ((start, n),) = [(s.value, n.value) for s, n in advised]
    huge = 2 << 20
    assert start % huge == 0 and n % huge == 0
    assert address <= start < address + huge and start + n <= address + buffer.nbytes
    assert start + n > address + buffer.nbytes - huge  # none left out at the end
    advised.clear()
    host_memory.advise_huge_pages(np.empty(host_memory.HUGE_MIN_BYTES - 1, np.uint8))
    assert advised == []  # too small to be worth a call


PINNED_SCRIPT = """
from kvstore.codecs import cuda

def anon_huge_kib():
    with open("/proc/self/smaps_rollup") as f:
        return int(next(l for l in f if l.startswith("AnonHugePages")).split()[1])

before = anon_huge_kib()
buffer = cuda.PinnedBuffer(32 << 20, None)  # no driver: mapped and touched, not locked
buffer.array[:] = 7
print(anon_huge_kib() - before, int(buffer.array.sum()) == 7 * (32 << 20))
buffer.release()
"""


@pytest.mark.skipif(
    _thp_mode() != "madvise",
    reason=f"transparent huge pages are {_thp_mode()!r} here, not given on advice",
)
def test_pinned_buffers_take_huge_pages_only_when_asked():
    def run(**env: str) -> tuple[int, str]:
        kib, whole = _printed(PINNED_SCRIPT, **env)
        return int(kib), whole

    assert run() == (0, "True")  # shared memory: 4 KiB pages, as always
    kib, whole = run(KVSTORE_PINNED_PAGES="huge")
    assert kib >= 16 << 10 and whole == "True"
