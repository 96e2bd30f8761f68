"""Where a run's time goes: the wall and CPU seconds of each phase of a cell.

A cell (`parity.cell.run_cell`) opens a `PhaseClock` with `clock()`; the code of each phase marks
itself with ``with phase("step 0/layer probe"):`` wherever it runs (step 0, the trainers, the
speed blocks, the calibration runs, the report), without the clock being passed down. Outside
an open clock `phase` does nothing, so a function called on its own (a test, a notebook) pays
nothing for it.

A phase entered inside another is named by its path (``phase("layer probe")`` inside
``phase("step 0")`` is ``"step 0/layer probe"``), so the same code reports under whoever calls it
(the JAX compile inside the main run is ``"train jax/compile"``, inside a calibration run
``"calibration/train jax/compile"``). A phase entered twice under the same path (two calibration
runs) adds up. CPU seconds are the process's
(``time.process_time``: every thread, XLA's and torch's intra-op pools included), so on a loaded
machine they are the steadier figure; wall seconds say what the user waited.

The record keeps the list (``"phases"`` in every main run record, `as_records`); `format_line`
is the one line ``run``/``matrix`` print at the end, and the report's "Where the time went"
table reads the same list.

With ``PARITY_PHASE_TRACE=1`` in the environment, each phase also prints a line to stderr as it
begins and as it ends (its wall and CPU seconds): a run stopped part-way (a time cap, a hang on
a new device) still says which phase it was in and what the finished ones cost.

Example:
  >>> with clock() as phases:
  ...     with phase("step 0"):
  ...         with phase("layer probe"):
  ...             pass
  >>> [entry["phase"] for entry in phases.as_records()]
  ['step 0', 'step 0/layer probe']
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "PhaseClock",
    "clock",
    "current",
    "format_line",
    "phase",
    "top_level",
]


@dataclasses.dataclass
class PhaseClock:
    """Wall and CPU seconds per phase path, in the order the phases were first entered."""

    wall: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        """Adds one measured interval to phase `name` (creating it)."""
        self.wall[name] = self.wall.get(name, 0.0) + max(wall_s, 0.0)
        self.cpu[name] = self.cpu.get(name, 0.0) + max(cpu_s, 0.0)

    def open(self, name: str) -> None:
        """Lists phase `name` now (at 0 s if new), so phases keep the order they began in."""
        self.wall.setdefault(name, 0.0)
        self.cpu.setdefault(name, 0.0)

    def merge(self, entries: list[dict[str, Any]] | None) -> None:
        """Adds the entries of another clock's `as_records` (a worker's, a record's)."""
        for entry in entries or []:
            self.add(entry["phase"], entry["wall_s"], entry["cpu_s"])

    def as_records(self) -> list[dict[str, Any]]:
        """``[{"phase", "wall_s", "cpu_s"}, ...]``: what a run record stores under ``"phases"``."""
        return [
            {"phase": name, "wall_s": round(wall, 4), "cpu_s": round(self.cpu[name], 4)}
            for name, wall in self.wall.items()
        ]


_CURRENT: contextvars.ContextVar[PhaseClock | None] = contextvars.ContextVar(
    "parity_phase_clock", default=None
)
_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("parity_phase_path", default="")


def current() -> PhaseClock | None:
    """The open clock, or None outside `clock`."""
    return _CURRENT.get()


@contextlib.contextmanager
def clock(existing: PhaseClock | None = None) -> Iterator[PhaseClock]:
    """Opens a clock (a new one, or `existing` to add to it) for the phases run inside."""
    opened = existing if existing is not None else PhaseClock()
    token, path = _CURRENT.set(opened), _PATH.set("")
    try:
        yield opened
    finally:
        _PATH.reset(path)
        _CURRENT.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Times the block as phase `name` (under the enclosing phase's path) on the open clock;
    nothing when none is open.

    The interval is recorded even when the block raises (the time was spent)."""
    opened = _CURRENT.get()
    if opened is None:
        yield
        return
    parent = _PATH.get()
    path = f"{parent}/{name}" if parent else name
    token = _PATH.set(path)
    opened.open(path)
    trace = os.environ.get("PARITY_PHASE_TRACE", "") not in ("", "0")
    if trace:
        print(f"[phase] {path}: begins", file=sys.stderr, flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        opened.add(path, wall, cpu)
        _PATH.reset(token)
        if trace:
            print(
                f"[phase] {path}: {_seconds(wall)} s wall / {_seconds(cpu)} s CPU",
                file=sys.stderr,
                flush=True,
            )


def top_level(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries whose path has no parent (``"step 0"``, not ``"step 0/layer probe"``)."""
    return [e for e in entries if "/" not in e["phase"]]


def _seconds(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def format_line(entries: list[dict[str, Any]], total: tuple[float, float] | None = None) -> str:
    """One line: each phase's wall seconds and CPU seconds, its parts in brackets.

    Args:
      entries: `PhaseClock.as_records` (or a record's ``"phases"``).
      total: ``(wall, cpu)`` of the whole command, or None.

    Example:
      >>> format_line([{"phase": "step 0", "wall_s": 2.0, "cpu_s": 3.0},
      ...              {"phase": "step 0/layer probe", "wall_s": 1.0, "cpu_s": 1.5}])
      'time (wall s / CPU s): step 0 2 / 3 [layer probe 1 / 1.5]'
    """
    parts = []
    for entry in top_level(entries):
        prefix = entry["phase"] + "/"
        children = [e for e in entries if e["phase"].startswith(prefix)]
        text = f"{entry['phase']} {_seconds(entry['wall_s'])} / {_seconds(entry['cpu_s'])}"
        if children:
            text += (
                " ["
                + ", ".join(
                    f"{c['phase'][len(prefix) :]} {_seconds(c['wall_s'])} / {_seconds(c['cpu_s'])}"
                    for c in children
                )
                + "]"
            )
        parts.append(text)
    line = "time (wall s / CPU s): " + "; ".join(parts)
    if total is not None:
        line += f"; total {_seconds(total[0])} / {_seconds(total[1])}"
    return line
