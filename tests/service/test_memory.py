"""glibc's mmap threshold is fixed by the CLI and each API worker (service/memory.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# In a fresh interpreter: free a 16 MiB block, which raises glibc's dynamic mmap threshold to
# 16 MiB, then ask for 1 MiB and read glibc's chunk header (the size word just before the
# pointer; bit 1 is IS_MMAPPED). Prints 1 if the 1 MiB block was mmapped (so free gives it back
# to the OS), 0 if it came from the heap.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from service.memory import fix_mmap_threshold
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "fix":
        assert fix_mmap_threshold()
    libc.free(libc.malloc(16 << 20))
    p = libc.malloc(1 << 20)
    size_word = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value
    print(int(bool(size_word & 2)))
    """
)


def mmapped(mode: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() == "1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_tensor_sized_blocks_stay_mmapped_after_a_big_free() -> None:
    assert not mmapped("default")  # glibc's dynamic threshold: 1 MiB now comes from the heap
    assert mmapped("fix")  # fixed at 128 KiB: still mmapped, returned to the OS on free
