"""The local cloud caps glibc's malloc arenas (sdflow.local.native_memory): its hundreds of threads share two
arenas instead of holding up to 8 per core. Counted by glibc itself (malloc_info's <heap> entries), in a fresh
process whose threads allocate at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc arenas are glibc's")

# Threads allocating and freeing at once, then glibc's own count of its arenas ("<heap nr=…>") on stdout.
CHURN = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys, threading
    sys.path.insert(0, {root!r})
    from sdflow.local import native_memory
    if {cap}:
        assert native_memory.cap_malloc_arenas()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    start = threading.Barrier(16)
    def churn():
        start.wait()
        for _ in range(2000):
            blocks = [bytearray(700) for _ in range(50)]
            del blocks
    threads = [threading.Thread(target=churn) for _ in range(16)]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
    libc.fdopen.restype = ctypes.c_void_p
    out = libc.fdopen(1, b"w")
    libc.malloc_info(0, ctypes.c_void_p(out))
    libc.fflush(ctypes.c_void_p(out))
    """
)


def _arenas(cap: bool) -> int:
    code = CHURN.format(root=str(REPO_ROOT), cap=cap)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.count("<heap nr=")


def test_cap_malloc_arenas_threads_share_two_arenas() -> None:
    assert 1 <= _arenas(cap=True) <= 2


def test_cap_malloc_arenas_uncapped_threads_take_more() -> None:
    # What the cap changes: the same churn without it spreads over more arenas.
    assert _arenas(cap=False) > 2
