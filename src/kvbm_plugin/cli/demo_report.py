"""What ``kvbm-plugin demo`` shows the user: the progress bar while the run goes, and the
summary and checks once it ends.

:class:`Progress` is redrawn by the demo's per-step callback on the CLI's main thread;
:func:`print_summary` is called once at the end by every demo (the plain, two-engine and
sliding-window runs), on the same thread.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbm_plugin.cli.demo_checks import Check


class Progress:
    """A one-line progress bar on stderr (no dependency), redrawn at most 10 times a second;
    drawn only when stderr is a terminal (a log file or pipe gets no ``\\r`` frames)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def update(self, done: int, note: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // max(1, self.total)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self.total} requests  {note}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def print_summary(summary: list[tuple[str, str]], checks: list[Check], seconds: float) -> None:
    width = max(len(k) for k, _ in summary)
    print(f"\nkvbm-plugin demo: {seconds:.1f} s")
    for key, value in summary:
        print(f"  {key.ljust(width)}  {value}")
    print()
    for check in checks:
        print(f"  [{'PASS' if check.ok else 'FAIL'}] {check.name}: {check.detail}")
    print("\nall checks passed" if all(c.ok for c in checks) else "\nSOME CHECKS FAILED")
