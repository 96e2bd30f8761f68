"""Progress that suits where the output goes: a tqdm bar on a terminal, plain lines elsewhere.

Redirected to a file or a CI log, a tqdm bar writes a new line on every refresh (about 1,000 lines
per matrix). `progress` shows the bar only when the stream is a terminal; otherwise it prints one
plain line every `every_s` seconds and one when the loop ends, so a long job still shows it is
alive without flooding the log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["progress", "is_terminal"]


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default: stderr) is an interactive terminal.

    Example:
      >>> import io
      >>> is_terminal(io.StringIO())
      False
    """
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


def progress(
    iterable: Iterable[Any],
    desc: str,
    *,
    total: int | None = None,
    unit: str = "step",
    every_s: float = 30.0,
    stream: TextIO | None = None,
    leave: bool = False,
) -> Iterator[Any]:
    """Iterates `iterable`, reporting progress as a bar (terminal) or periodic lines (otherwise).

    Args:
      iterable: what to iterate.
      desc: what is running, e.g. ``"torch cnn bf16-mixed"``.
      total: the number of items (default: ``len(iterable)`` where it has one).
      unit: the item's name in the lines.
      every_s: seconds between plain lines (not on a terminal).
      stream: where to write (default: stderr).
      leave: keep the finished bar on the terminal.

    Yields:
      The items of `iterable`.

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> list(progress(range(3), "demo", stream=out))
      [0, 1, 2]
      >>> out.getvalue().startswith("demo: 3/3 steps done in")
      True
    """
    if every_s <= 0:
        raise ValueError(f"progress: `every_s` must be > 0; got {every_s!r}.")
    stream = sys.stderr if stream is None else stream
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if is_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=stream)
        return
    yield from _plain(iterable, desc, total, unit, every_s, stream)


def _plain(iterable, desc, total, unit, every_s, stream) -> Iterator[Any]:
    start = last = time.monotonic()
    done = 0
    of = f"/{total}" if total is not None else ""
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            print(f"{desc}: {done}{of} {unit}s, {now - start:.0f} s", file=stream, flush=True)
    print(
        f"{desc}: {done}{of} {unit}s done in {time.monotonic() - start:.1f} s",
        file=stream,
        flush=True,
    )
