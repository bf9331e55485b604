"""What a long `fxopt inspect` / `fxopt bench` is doing, on stderr, with the time elapsed.

On a terminal: one status line, rewritten in place and cleared at the end (so an error stays a
single line). Elsewhere (a log, a pipe): with `lines=True`, one line per phase; statuses are
shown on a terminal only.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, name: str, lines: bool, stream=None):
        self.name = name
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.lines = lines
        self.start = time.perf_counter()

    def _elapsed(self) -> str:
        return f"[{time.perf_counter() - self.start:.1f} s]"

    def status(self, text: str) -> None:
        """Show what is running now (on a terminal only)."""
        if self.interactive:
            self._write(f"{self.name}: {text} {self._elapsed()}", final=False)

    def phase(self, text: str) -> None:
        """A phase starts: a status on a terminal, a line in a log when `lines`."""
        if self.interactive:
            self.status(text)
        elif self.lines:
            self._write(f"{self.name}: {text} {self._elapsed()}", final=True)

    def step(self, text: str, done: int, total: int) -> None:
        self.status(f"{text} {done}/{total}")

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _write(self, text: str, final: bool) -> None:
        prefix = "\r\033[K" if self.interactive else ""
        self.stream.write(prefix + text + ("\n" if final else ""))
        self.stream.flush()
