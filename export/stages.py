"""Where an export's time and memory go: each long stage's wall time and the process's peak RSS when it ended.

An export prints one line per stage as it ends ("torch.export: 41 s, peak RSS 5.2 GiB") and records the
rows in its manifest entry (`stages`), so a slow or memory-hungry export names its stage.
"""

from __future__ import annotations

import resource
import sys
import time


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


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
        row = {"stage": name, "seconds": round(now - self._start, 1), "peak_rss_bytes": peak_rss_bytes()}
        self.rows.append(row)
        self._start = now
        if self.say:
            self.say(f"{name}: {row['seconds']:.0f} s, peak RSS {format_bytes(row['peak_rss_bytes'])}"
                     + (f" ({detail})" if detail else ""))
