"""Files for the disk tier: whole writes and reads, and page-cache control measured by mincore.

Why apart: whether a disk reload was really cold decides what the figure means (the
seed's "cold" reads were probably warm), so eviction is attempted and then *measured*.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import torch


def write_file(fd: int, data: memoryview, fsync: bool) -> None:
    """Write all of `data` at offset 0 (pwrite may write less than asked: loop)."""
    off = 0
    while off < len(data):
        off += os.pwrite(fd, data[off:], off)
    if fsync:
        os.fsync(fd)


def read_file(fd: int, into: memoryview) -> None:
    off = 0
    while off < len(into):
        n = os.preadv(fd, [into[off:]], off)
        if n == 0:
            raise EOFError(f"file ended after {off} of {len(into)} bytes")
        off += n


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(fd: int, size: int) -> tuple[int, int]:
    """(resident, total) pages of the file's first `size` bytes in the page cache, by mincore(2)."""
    total = -(-size // mmap.PAGESIZE)
    if size == 0:
        return 0, 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = (ctypes.c_ubyte * total)()
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()), total
    finally:
        _libc.munmap(addr, size)


def drop_page_cache(fd: int, size: int) -> dict:
    """Try to evict the file from the page cache, then measure what is still resident.

    fadvise(DONTNEED) only drops clean pages, hence the fsync first. Only if pages stay
    resident is the whole machine's page cache dropped (needs root and a writable
    /proc/sys). `cold` is measured by mincore, never assumed from the calls succeeding.
    """
    os.fsync(fd)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        fadvise = True
    except OSError:
        fadvise = False
    resident, total = resident_pages(fd, size)
    tried = drop_caches = False
    if resident:
        tried = True
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            drop_caches = True
        except OSError:
            pass
        resident, total = resident_pages(fd, size)
    return dict(fadvise=fadvise, drop_caches_tried=tried, drop_caches=drop_caches,
                resident_pages=resident, total_pages=total, cold=resident == 0)
