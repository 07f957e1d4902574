"""Facts about the host (CPU) shared by the CPU backends."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Seconds a reading of the free host memory is reused.  Default memory budgets are a share
#: of it and are computed on every ``gram`` call; reading ``/proc/meminfo`` costs ~30-80 us,
#: which shows on small repeated calls (SENG refreshes), while the figure moves slowly.
FREE_MEMORY_TTL_S = 0.25
_last: tuple[float, int | None] | None = None
_clock = time.monotonic
_MEMINFO = Path("/proc/meminfo")
# cgroup v2 (memory.max, "max" when unlimited) and v1 (memory.limit_in_bytes) of this process's
# container: (directory, limit file, usage file, the memory.stat key of reclaimable page cache)
_CGROUPS = ((Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),
            (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes",
             "total_inactive_file"))


def _read_int(path: Path) -> int | None:
    """The integer in ``path``; ``None`` when it is missing, unreadable or ``max``."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cgroup_free_memory() -> int | None:
    """Bytes the cgroup memory limit still allows: limit minus the usage that page cache cannot
    give back (``usage - inactive_file``, the working set that container runtimes report);
    ``None`` without a limit (no cgroup files, v2 ``max`` or the v1 "unlimited" value)."""
    for base, limit_file, usage_file, cache_key in _CGROUPS:
        limit = _read_int(base / limit_file)
        if limit is None or limit >= 1 << 60:
            continue
        usage = _read_int(base / usage_file) or 0
        cache = 0
        try:
            for line in (base / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - max(0, usage - cache))
    return None


def _read_free_memory() -> int | None:
    """The smaller of the host's available memory and what the cgroup limit allows."""
    host = None
    try:
        with _MEMINFO.open() as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if host is None:
        try:
            host = int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    known = [m for m in (host, _cgroup_free_memory()) if m is not None]
    return min(known) if known else None


def host_free_memory() -> int | None:
    """Bytes of host memory available to new allocations.

    Linux ``MemAvailable`` (``sysconf`` free pages elsewhere), capped inside a container by
    its cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus the
    container's working set; ``None`` when nothing is known.  A reading is reused for
    ``FREE_MEMORY_TTL_S`` seconds.
    """
    global _last
    now = _clock()
    if _last is None or now - _last[0] > FREE_MEMORY_TTL_S:
        _last = (now, _read_free_memory())
    return _last[1]
