"""What the host machine has to spare: memory available to this process (checked before starting ranks)."""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes this process can still allocate (MemAvailable, lowered by a cgroup limit); None if unknown."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    # A container's limit (cgroup v2, then v1) can be far below the machine's free memory.
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), g.read().strip()
            if limit.isdigit() and usage.isdigit():
                found.append(max(0, int(limit) - int(usage)))
                break
        except OSError:
            continue
    return min(found) if found else None
