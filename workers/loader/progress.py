"""A progress bar on stderr while weights load (a redrawn bar on a terminal, a few lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
WIDTH = 30


def with_progress(items: Iterable[T], total: int, label: str = "Loading weights") -> Iterator[T]:
    stream = sys.stderr
    tty = stream.isatty()
    start = time.monotonic()
    next_mark = 0.25  # without a terminal: one line per quarter

    def draw(done: int, final: bool = False) -> None:
        frac = min(done / total, 1.0) if total else 1.0
        elapsed = time.monotonic() - start
        bar = "#" * int(frac * WIDTH)
        line = f"{label} [{bar:<{WIDTH}}] {done}/{total} tensors {elapsed:5.1f}s"
        if tty:
            stream.write("\r" + line + ("\n" if final else ""))
        else:
            stream.write(line + "\n")
        stream.flush()

    done = 0
    for item in items:
        yield item
        done += 1
        if tty:
            if done % 8 == 0:
                draw(done)
        elif total and done / total >= next_mark and done < total:
            draw(done)
            next_mark += 0.25
    draw(done, final=True)
