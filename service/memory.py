"""Keep tensor-sized allocations out of glibc's heap, so a policy swap gives its memory back.

glibc serves blocks above its mmap threshold with mmap and returns them to the OS on free, but
it *raises* that threshold (up to 32 MiB) each time such a block is freed. After the first policy
is dropped, the next policy's tensors land in the heap, where the API's many small, longer-lived
allocations pin the pages around them: in a 10-minute soak `serve`'s RSS stepped up at every
canary swap (347 -> 520 MiB). With the threshold fixed at 128 KiB (setting it turns the dynamic
adjustment off) the steps are smaller (+102 instead of +173 MiB in 10 minutes) and the trainer's
RSS fell by a quarter; serve's is not flat yet (docs/RELIABILITY.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024


def fix_mmap_threshold() -> bool:
    """Set glibc's mmap threshold to 128 KiB for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt, nothing to tune
        return False
