"""What every benchmark report starts with: the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "commit": commit or "unknown",
    }


def print_machine() -> None:
    for key, value in machine().items():
        print(f"  {key:9s} {value}")
