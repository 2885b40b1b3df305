"""Host memory allocator settings for CPU inference.

glibc serves allocations above its mmap threshold (at most 32 MiB with the default dynamic
threshold) with fresh ``mmap``s and unmaps them on free, so a buffer of that size made every step,
such as the logits of a large batch (256 rows x 49,152 vocabulary x 4 bytes = 50 MB), is
page-faulted and zeroed by the kernel every step. Measured on the 2-core EPYC:
``F.linear`` [256, 32] x [32, 49152] 40 ms -> 22 ms, oneDNN packed [256, 576] x [576, 49152]
84 ms -> 63 ms; SmolLM2 offline (2 threads, 128+64 tokens) 299 -> 359 tok/s at 32 requests,
345 -> 376 at 64, unchanged at 1 and 4 (their buffers are under the threshold). (vLLM's CPU guide preloads
tcmalloc for the same reason; this machine has none, and ``mallopt`` needs nothing installed.)
The price: the heap settles a few buffers above its peak (torch's 64-byte-aligned allocations
fragment it; a 50 MB buffer per step settled after 4 steps at +150 MB resident) and is not
returned to the OS while the process runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger("lorastar")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30

_applied = False


def keep_freed_memory(threshold: int = KEEP_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to ``threshold`` bytes (once per process): large
    buffers then come from the heap and stay mapped for reuse. False where there is no glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))
    if not ok:
        logger.info("lorastar: mallopt refused the thresholds; large CPU buffers stay mmapped")
    _applied = ok
    return ok
