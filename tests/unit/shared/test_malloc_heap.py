"""malloc's figures follow what the C heap holds, and a trim gives free pages back."""

from __future__ import annotations

import asyncio
import ctypes
import sys

import pytest

from spillway.shared.malloc_heap import heap_figures, trim, trim_every

pytestmark = pytest.mark.skipif(
    heap_figures() is None, reason="not glibc: malloc's figures are not readable"
)
CHUNK = 64 * 1024  # below glibc's mmap threshold: served from the heap, kept when freed
COUNT = 400


def test_in_use_follows_live_buffers_and_free_memory_stays_until_trimmed() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = heap_figures()
    assert before is not None
    chunks = [libc.malloc(CHUNK) for _ in range(COUNT)]
    held = heap_figures()
    assert held is not None and held.in_use - before.in_use >= COUNT * CHUNK * 0.9
    keep_last = chunks.pop()  # holds the heap's top: the freed chunks below cannot shrink it
    for c in chunks:
        libc.free(c)
    freed = heap_figures()
    assert freed is not None and freed.free - held.free >= (COUNT - 1) * CHUNK * 0.9
    assert trim() or sys.platform != "linux"
    libc.free(keep_last)


async def test_the_heap_is_trimmed_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("spillway.shared.malloc_heap.trim", lambda: calls.append(1) or True)
    task = asyncio.create_task(trim_every(0.01))
    async with asyncio.timeout(10):
        while len(calls) < 3:
            await asyncio.sleep(0.01)
    task.cancel()
    assert len(calls) >= 3
