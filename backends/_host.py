"""Facts about the host (CPU) shared by the CPU backends."""

from __future__ import annotations

import os
import time

#: Seconds a reading of the free host memory is reused.  Default memory budgets are a share
#: of it and are computed on every ``gram`` call; reading ``/proc/meminfo`` costs ~30-80 us,
#: which shows on small repeated calls (SENG refreshes), while the figure moves slowly.
FREE_MEMORY_TTL_S = 0.25
_last: tuple[float, int | None] | None = None
_clock = time.monotonic


def _read_free_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def host_free_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``).

    Falls back to ``sysconf`` free pages elsewhere, and to ``None`` when neither is known.
    A reading is reused for ``FREE_MEMORY_TTL_S`` seconds.
    """
    global _last
    now = _clock()
    if _last is None or now - _last[0] > FREE_MEMORY_TTL_S:
        _last = (now, _read_free_memory())
    return _last[1]
