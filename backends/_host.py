"""Facts about the host (CPU) shared by the CPU backends."""

from __future__ import annotations

import os


def host_free_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``).

    Falls back to ``sysconf`` free pages elsewhere, and to ``None`` when neither is known.
    """
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
