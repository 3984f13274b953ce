"""What the process and the machine hold in memory: the numbers a KV budget starts from.

Why `release_to_os`: glibc serves a freed block back to later allocations from its heap, and after
the first large free it raises its mmap threshold (up to 32 MiB), so a KV buffer freed by an
eviction stays in the process's RSS. Fixing the threshold at 1 MiB makes every KV buffer its own
mapping, returned to the kernel the moment it is freed, so RSS follows the budget down as well as
up.
"""
from __future__ import annotations

import ctypes
import os
import resource

import structlog
import torch

log = structlog.get_logger(__name__)

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


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


def release_to_os() -> bool:
    """Pin glibc's mmap threshold (see the module doc); False where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 20))
    except (OSError, AttributeError):
        log.info("memstat.no_glibc")
        return False
