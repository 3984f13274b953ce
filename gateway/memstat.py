"""What the process and the machine hold in memory: the numbers a KV budget starts from, and the
allocator settings that keep memory outside the budget bounded.

Why `tune_allocator`: glibc serves a freed block back to later allocations from its heap, and
after the first large free it raises its mmap threshold (up to 32 MiB), so a KV buffer freed by an
eviction stayed in the process's RSS. Fixing the threshold at 128 KiB makes every KV buffer, every
prefill activation and every logits vector (192 KiB for SmolLM2) its own mapping, returned to the
kernel the moment it is freed, so RSS follows the budget down as well as up; measured under floods
of 24 concurrent sessions, the heaps then stayed at their start-up size instead of growing by
~240 MB of free but fragmented pages (a mapping costs a syscall and page faults: noise next to a
forward pass). glibc also gives each thread that contends for the heap an arena of its own (up to
8 per core), each keeping its own freed pages: capped at 2, the freed pages of many turn threads
are pooled instead of multiplied. `trim` hands the free pages in the middle of the heaps back
(malloc_trim, 1-70 ms), which the heap's own top-only trimming never does; the gateway calls it
when the last running turn ends and every `service.TRIM_EVERY` turns.

The stated overhead (`overhead_bytes`): what the process may hold beyond the KV budget under load,
over what it held before the load (after start-up and one warm turn): a fixed part (the model
thread's activations, at most PREFILL_PIECE rows at a time, and its MKL state; allocator slack;
one offload plane per eviction in flight; sockets and request bodies) and a part per turn thread
(a compiled Rego VM and Hyperscan scratch of its own, and its stack: ~7 MB measured), of which
there are at most LETHE_MAX_INFLIGHT. Bounds set from measurements with a margin, not derived;
`lethe bench memory` checks peak RSS against them, and the README gives the figures.
"""
from __future__ import annotations

import ctypes
import functools
import os
import resource

import structlog
import torch

log = structlog.get_logger(__name__)

M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 << 10
FIXED_OVERHEAD_BYTES = 192 << 20
TURN_THREAD_BYTES = 8 << 20


def overhead_bytes(turn_threads: int) -> int:
    """What the process may hold beyond the KV budget with `turn_threads` turn threads (module doc)."""
    return FIXED_OVERHEAD_BYTES + TURN_THREAD_BYTES * turn_threads


def mem_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); total physical memory where that is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss_bytes() -> int:
    """This process's resident set size now (bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_kv_budget(device: torch.device, share: float) -> int:
    """`share` of the free GPU memory on CUDA, of MemAvailable on CPU, measured at start-up (after
    the model is loaded, so the weights are not counted twice)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * share)
    return int(mem_available() * share)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_allocator() -> bool:
    """Pin glibc's mmap threshold and cap its arenas (see the module doc); False where glibc is
    not the allocator."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
            and bool(libc.mallopt(M_ARENA_MAX, 2))
    except AttributeError:
        log.info("memstat.no_glibc")
        return False


def trim() -> None:
    """Return the heaps' free pages to the OS (glibc's malloc_trim; nothing elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
