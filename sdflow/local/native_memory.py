"""The local cloud's native heap: glibc malloc arenas capped for its many threads.

The local cloud runs hundreds of threads at once (moto's threaded server, a Distributed Map's children, the
no-op jobs and the Lambda invocations: 430 at the peak of a 10,000-shard no-op run). glibc gives threads their
own malloc arenas, up to 8 per core, and each arena keeps the memory its threads freed for its own later use,
so the process's RSS grows far past its live heap: a 1,000-shard run's traced Python heap was ~200 MB
(bench/bench_local_runtime.py --profile-memory: botocore's service models 83 MB, imports 27 MB, the run's
records the rest) while the process held several times that. Capping the arenas (glibc's M_ARENA_MAX, as the
MALLOC_ARENA_MAX environment variable does) makes threads share them, at a little lock contention. Called before
the cloud starts its threads; elsewhere than glibc (macOS, musl) it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

LOG = logging.getLogger(__name__)
M_ARENA_MAX = -8  # glibc malloc.h
ARENAS = 2


def cap_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's malloc arenas; True when glibc took it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: no mallopt, nothing to cap
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = bool(mallopt(M_ARENA_MAX, arenas))
    if not taken:
        LOG.debug("mallopt(M_ARENA_MAX, %d) refused; malloc arenas left as they are", arenas)
    return taken
