"""glibc malloc's heap padding for a serving relay.

A relay that forwards to other instances builds one buffer per read for each of them (the bus
records `feed` writes in Rust, handed to Python as bytes) and reads back entries of up to a
megabyte from Redis: buffers of hundreds of kilobytes, allocated and freed thousands of times a
second. glibc serves them from the top of the heap and, with its defaults, gives the top back
to the kernel (`brk` shrinks) as soon as more than 128 KiB there is free; the next buffer grows
the heap again and faults in fresh zeroed pages. Measured on the cross-instance benchmark
(`python -m bench.cluster --scenarios local,cross`, 10 pairs x 1 KiB, 2 cores): 400,000-415,000
msg/s with the defaults, 462,000-478,000 with `M_TOP_PAD` at 16 MiB, the relays' CPU per
message 1.0-1.2 -> 0.8 us (sender) and 0.8-0.9 -> 0.7-0.8 us (receiver).

`M_TOP_PAD` keeps `TOP_PAD` bytes at the top of the heap whenever it grows or shrinks, so the
pages such buffers use stay mapped. It costs at most that much resident memory per arena and
leaves glibc's other decisions alone: raising the trim or mmap thresholds instead turns the
dynamic mmap threshold off, and then every buffer above 128 KiB is an mmap/munmap pair (slower
than the defaults, measured). An operator's own `MALLOC_TOP_PAD_` wins; on a C library other
than glibc nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: bytes glibc keeps at the top of the heap beyond what is in use
TOP_PAD = 16 << 20
#: mallopt's parameter number for the top pad (malloc.h)
M_TOP_PAD = -2


def tune_for_serving() -> bool:
    """Set the heap's top pad; True when it was set here (glibc, no `MALLOC_TOP_PAD_`)."""
    if "MALLOC_TOP_PAD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_TOP_PAD, TOP_PAD))
