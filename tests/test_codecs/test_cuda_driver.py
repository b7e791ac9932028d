"""kvstore.codecs.cuda_driver.Driver and DeviceStaging against a stand-in ``libcuda.so.1``.

No CUDA driver exists here, so a small C library with the driver's names and
signatures is built (``cc``) and loaded in its place in a child process. Its "device"
memory is host memory and its copies are ``memcpy``: what this checks is the
plumbing the device machine would otherwise be the first to run -- the ctypes types
of each argument, bytes landing at the offset asked, a stream per staging made and
dropped, the context bound once per thread, and that every call lets the GIL go.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_DRIVER = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
#define CTX ((void*)0x1234)

/* Counts by call, and how many of each were made holding the GIL. */
enum { BIND, REGISTER, POINTER, UNREGISTER, STREAM, ALLOC, COPY, SYNC, FREE, DROP, CALLS };
static int made[CALLS], with_gil[CALLS];

static void count(int call) {
    int (*held)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    made[call]++;
    if (held && held()) with_gil[call]++;
}

int fake_made(int call) { return made[call]; }
int fake_with_gil(int call) { return with_gil[call]; }

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
CUresult cuDeviceGet(int* device, int ordinal) { *device = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) { *ctx = CTX; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { count(BIND); return ctx == CTX ? 0 : 201; }
CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned flags) {
    count(REGISTER); return p && n ? 0 : 1;
}
CUresult cuMemHostGetDevicePointer_v2(uint64_t* device, void* p, unsigned flags) {
    count(POINTER); *device = (uint64_t)(uintptr_t)p; return 0;
}
CUresult cuMemHostUnregister(void* p) { count(UNREGISTER); return 0; }
CUresult cuStreamCreate(void** stream, unsigned flags) {
    count(STREAM); *stream = malloc(1); return flags == 1 ? 0 : 1;  /* non-blocking */
}
CUresult cuMemAllocAsync(uint64_t* device, size_t n, void* stream) {
    count(ALLOC); *device = (uint64_t)(uintptr_t)malloc(n); return stream ? 0 : 1;
}
CUresult cuMemcpyHtoDAsync_v2(uint64_t device, const void* host, size_t n, void* stream) {
    count(COPY); memcpy((void*)(uintptr_t)device, host, n); return stream ? 0 : 1;
}
CUresult cuStreamSynchronize(void* stream) { count(SYNC); return stream ? 0 : 1; }
CUresult cuMemFreeAsync(uint64_t device, void* stream) {
    count(FREE); free((void*)(uintptr_t)device); return stream ? 0 : 1;
}
CUresult cuStreamDestroy_v2(void* stream) { count(DROP); free(stream); return 0; }
"""

CHILD = """
import ctypes, threading
import numpy as np
from kvstore.codecs import cuda

fake = ctypes.CDLL("libcuda.so.1")
CALLS = "bind register pointer unregister stream alloc copy sync free drop".split()

driver = cuda.Driver()
host = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
assert driver.register_pages(int(host.ctypes.data), host.nbytes) == int(host.ctypes.data)
staging = cuda.DeviceStaging(driver, host.nbytes + 4096)
staging.copy(4096, int(host.ctypes.data), host.nbytes)  # as a locking thread does

def elsewhere():
    staging.copy(0, int(host.ctypes.data) + 100, 16)
    # A copy route's chunk: on this thread's own stream, waited for (twice: one stream).
    staging.copy_now(16, int(host.ctypes.data) + 200, 16)
    staging.copy_now(32, int(host.ctypes.data) + 300, 16)

thread = threading.Thread(target=elsewhere)
thread.start()
thread.join()
staging.wait()
landed = (ctypes.c_uint8 * (host.nbytes + 4096)).from_address(staging.address)
data = np.frombuffer(landed, np.uint8)
assert np.array_equal(data[4096:], host), "the copy's bytes are not where asked"
assert np.array_equal(data[:16], host[100:116]), "the other thread's copy"
assert np.array_equal(data[16:48], np.concatenate([host[200:216], host[300:316]]))
driver.unregister_pages(int(host.ctypes.data))
staging.free()
staging.free()  # a second free gives nothing back twice
for i, name in enumerate(CALLS):
    print(name, fake.fake_made(i), fake.fake_with_gil(i))
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver (apt-get install gcc)")
    folder = tmp_path_factory.mktemp("fake-libcuda")
    source = folder / "fake.c"
    source.write_text(FAKE_DRIVER)
    library = folder / "libcuda.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library, source, "-ldl"],
        check=True,
    )
    return folder


def driver_calls(folder: Path, **env: str) -> dict[str, tuple[int, int]]:
    """Each call's count, and how many held the GIL, in a child on the stand-in driver."""
    environment = {**os.environ, "LD_LIBRARY_PATH": str(folder), **env}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    return {name: (int(n), int(gil)) for name, n, gil in map(str.split, done.stdout.splitlines())}


def test_the_driver_calls_land_bytes_where_asked_and_all_let_the_gil_go(fake_driver):
    assert driver_calls(fake_driver) == {
        # Once per thread: the main one, then the one that queued the second copy.
        "bind": (2, 0),
        "register": (1, 0),
        "unregister": (1, 0),
        "pointer": (1, 0),
        # One stream per staging, made and dropped once, its memory given back once;
        # one more for the thread that copied now (kept for it), each such copy waited
        # for; the staging's stream waited for once made (the others copy after it).
        "stream": (2, 0),
        "alloc": (1, 0),
        "copy": (4, 0),
        "sync": (4, 0),
        "free": (1, 0),
        "drop": (1, 0),
    }
