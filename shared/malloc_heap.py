"""The C heap under the interpreter (glibc's malloc), read and trimmed through ctypes.

Python's own small objects live in its arenas (`sys.getallocatedblocks` counts them); every
larger buffer (a bus message's bytes, a JSON body, a list's table) comes from malloc. When
such buffers come and go on several threads, glibc keeps the freed memory in its heaps
instead of handing it back, and the RSS climbs with no live object behind it. The heap's
figures tell that apart from a leak: memory in use flat, memory free in the heap growing.
`trim` asks malloc to give free pages back (`malloc_trim(0)`), which it does only when asked;
every service does so once a minute (`trim_every`, started by shared/lifecycle.py).

Elsewhere than glibc (musl, macOS) both answer None: nothing to read, nothing done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class HeapFigures:
    in_use: int  # bytes handed out by malloc, live (small chunks and mmap-ed ones)
    free: int  # bytes malloc holds free in its heaps, not given back to the system


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2  # glibc 2.33 and later
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def heap_figures() -> HeapFigures | None:
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()  # summed over every arena, the threads' included
    return HeapFigures(in_use=info.uordblks + info.hblkhd, free=info.fordblks)


def trim() -> bool:
    """Gives malloc's free pages back to the system; True when some were."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


async def trim_every(every_s: float) -> None:
    """Gives malloc's free pages back every `every_s` seconds until cancelled: a service
    that runs for days otherwise keeps the high-water mark of every burst in its RSS. A
    trim with little to give back takes well under a millisecond."""
    if _libc() is None:
        return
    while True:
        await asyncio.sleep(every_s)
        trim()
