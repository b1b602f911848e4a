"""Where an export's time and memory go: each long stage's wall time and the process's peak RSS when it ended.

An export prints one line per stage as it ends ("torch.export: 41 s, RSS 3.1 GiB, peak 5.2 GiB") and
records the rows in its manifest entry (`stages`), so a slow or memory-hungry export names its stage.
"""

from __future__ import annotations

import os
import resource
import sys
import time


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc/self/statm; None where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class StageClock:
    """Times consecutive stages: done(name) closes the stage that began at the previous done (or at the
    clock's start), prints it through `say` and keeps it as a plain row for the manifest."""

    def __init__(self, say=None):
        self.say = say
        self.rows: list[dict] = []
        self.began = self._start = time.perf_counter()

    def done(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        rss = rss_bytes()  # the kernel's high-water mark can lag the resident count by a few pages
        row = {"stage": name, "seconds": round(now - self._start, 1), "rss_bytes": rss,
               "peak_rss_bytes": max(peak_rss_bytes(), rss or 0)}
        self.rows.append(row)
        self._start = now
        if self.say:
            now_rss = f"RSS {format_bytes(row['rss_bytes'])}, " if row["rss_bytes"] is not None else ""
            self.say(f"{name}: {row['seconds']:.0f} s, {now_rss}peak {format_bytes(row['peak_rss_bytes'])}"
                     + (f" ({detail})" if detail else ""))
