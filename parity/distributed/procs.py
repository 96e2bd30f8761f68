"""Worker processes that the harness owns: started, bounded by a timeout, and ended by PID.

Every worker is started in its own session (process group), its PID recorded in the owning
`WorkerGroup`. The group ends its workers (SIGTERM to each worker's process group, then SIGKILL
after a grace period) when the run finishes, fails, times out, on Ctrl-C (SIGINT) and SIGTERM to
the harness, and at interpreter exit (atexit). Ports are picked free on 127.0.0.1 only.

A worker is a process of its own (`WorkerGroup.start`: a command) or forked by a zygote that
imported its modules once (`forking`, `WorkerGroup.start_forked`: see
`parity.distributed.zygote`); the group owns and ends both alike.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from parity.distributed.zygote import ForkedWorker, Zygote, can_fork

__all__ = [
    "WorkerError",
    "WorkerGroup",
    "WorkerResult",
    "forking",
    "free_port",
    "live_worker_pids",
]

_GRACE_S = 5.0
# Every group (and zygote) alive in this process (ended by the signal handlers and at exit).
_GROUPS: set[WorkerGroup | Zygote] = set()
_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


class WorkerError(RuntimeError):
    """A worker failed or timed out; the message names the worker and ends with its output tail."""


@dataclass(frozen=True)
class WorkerResult:
    """One finished worker: its name, PID, exit code, and output (stdout+stderr) tail."""

    name: str
    pid: int
    returncode: int
    output: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call (bound to port 0, then released).

    Example:
      >>> 1024 <= free_port() < 65536
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_worker_pids() -> list[int]:
    """PIDs of workers started by this process that are still running (for tests and cleanup)."""
    with _LOCK:
        groups = list(_GROUPS)
    return [p.pid for g in groups for p in g._procs if p.poll() is None]


def _end_all(*_: object) -> None:
    with _LOCK:
        groups = list(_GROUPS)
    # Workers first, then the zygotes that forked them (their parents, reaping them).
    for group in sorted(groups, key=lambda g: not isinstance(g, WorkerGroup)):
        group.terminate()


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_end_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _end_all()
            if callable(previous):
                previous(signum, frame)
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                sys.exit(128 + signum)

        signal.signal(sig, handler)


@contextlib.contextmanager
def forking(preload: Sequence[str], env: dict[str, str], log: str | os.PathLike) -> Iterator:
    """A `parity.distributed.zygote.Zygote` for the block: `preload` imported once in a process
    with environment `env` (its output in `log`), forking the workers that
    `WorkerGroup.start_forked` starts. Ended at the block's end, on Ctrl-C (SIGINT), SIGTERM and
    at exit as every worker; None where workers cannot be forked (they start as processes)."""
    if not can_fork():
        yield None
        return
    _install_handlers()
    zygote = Zygote(preload, env, log)
    with _LOCK:
        _GROUPS.add(zygote)
    try:
        yield zygote
    finally:
        zygote.close(_GRACE_S)
        with _LOCK:
            _GROUPS.discard(zygote)


class WorkerGroup:
    """Starts worker commands, waits for all of them under one timeout, ends them all by PID.

    Use as a context manager: leaving the block ends every worker still running.

    Example:
      >>> with WorkerGroup(timeout_s=60) as group:
      ...     group.start("echo", [sys.executable, "-c", "print('hi')"])
      ...     results = group.wait()
      >>> results[0].output.strip()
      'hi'
    """

    def __init__(self, timeout_s: float, log_dir: str | os.PathLike | None = None):
        if not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"WorkerGroup: `timeout_s` must be a number > 0; got {timeout_s!r}.")
        self.timeout_s = float(timeout_s)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._procs: list[subprocess.Popen | ForkedWorker] = []
        self._names: list[str] = []
        self._logs: list[Path] = []
        self._files: list = []
        self._temp_logs: list[Path] = []
        self._started = time.monotonic()

    def __hash__(self) -> int:
        return id(self)

    def __enter__(self) -> WorkerGroup:
        _install_handlers()
        with _LOCK:
            _GROUPS.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()
        with _LOCK:
            _GROUPS.discard(self)

    @property
    def pids(self) -> list[int]:
        """PIDs of every worker started (running or not)."""
        return [p.pid for p in self._procs]

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Starts one worker in its own process group; returns its PID."""
        log = self._new_log(name)
        handle = open(log, "w")  # noqa: SIM115 - closed in terminate()
        stdin = open(os.devnull)  # noqa: SIM115 - read-only, closed right after the start
        try:
            proc = subprocess.Popen(
                list(cmd),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=stdin,
                env=env,
                start_new_session=True,  # its own process group: ended as a unit, by PID
            )
        finally:
            stdin.close()
        return self._own(name, proc, log, handle)

    def start_forked(
        self,
        name: str,
        zygote: Zygote | None,
        module: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
    ) -> int:
        """Starts one worker running ``module.main(args)``, forked by `zygote` (which has
        imported `module`), in its own process group; returns its PID. Without a zygote, or
        when it refuses, the worker starts as ``python -m module ARGS`` with `env` (`start`)."""
        if zygote is not None:
            log = self._new_log(name)
            left = self.timeout_s - (time.monotonic() - self._started)
            proc = zygote.fork(module, args, log, timeout_s=max(left, 1.0))
            if proc is not None:
                handle = open(log)  # noqa: SIM115 - kept (closed) for `_tail`'s bookkeeping
                handle.close()
                return self._own(name, proc, log, handle)
        return self.start(name, [sys.executable, "-m", module, *map(str, args)], env=env)

    def _own(self, name: str, proc: subprocess.Popen | ForkedWorker, log: Path, handle) -> int:
        """Keeps a started worker (its name, log and log handle) to wait for and end; its PID."""
        self._procs.append(proc)
        self._names.append(name)
        self._logs.append(log)
        self._files.append(handle)
        return proc.pid

    def _new_log(self, name: str) -> Path:
        """An empty log file for worker `name` (in `log_dir`, else a temporary one)."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = self.log_dir / f"{name}.log"
            log.write_text("")
            return log
        import tempfile

        fd, path = tempfile.mkstemp(prefix=f"parity-{name}-", suffix=".log")
        os.close(fd)
        self._temp_logs.append(Path(path))
        return Path(path)

    def _tail(self, i: int, chars: int = 4000) -> str:
        if not self._files[i].closed:
            self._files[i].flush()
        try:
            return self._logs[i].read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait(self) -> list[WorkerResult]:
        """Waits for every worker; on a failure or the timeout ends the others and raises."""
        deadline = self._started + self.timeout_s
        pending = set(range(len(self._procs)))
        while pending:
            for i in sorted(pending):
                code = self._procs[i].poll()
                if code is None:
                    continue
                pending.discard(i)
                if code != 0:
                    tail = self._tail(i)
                    self.terminate()
                    raise WorkerError(
                        f"worker {self._names[i]} (pid {self._procs[i].pid}) exited with "
                        f"code {code}; the others were ended. Output tail:\n{tail}"
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(self._names[i] for i in sorted(pending))
                tails = "\n".join(f"--- {self._names[i]}:\n{self._tail(i, 1500)}" for i in pending)
                self.terminate()
                raise WorkerError(
                    f"workers {names} still running after the {self.timeout_s:.0f} s timeout; "
                    f"all were ended.\n{tails}"
                )
            if pending:
                time.sleep(0.05)
        return [
            WorkerResult(self._names[i], p.pid, p.returncode, self._tail(i, 20000))
            for i, p in enumerate(self._procs)
        ]

    def terminate(self) -> None:
        """Ends every worker still running: SIGTERM to its process group, SIGKILL after a grace."""
        running = [p for p in self._procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in running:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self._procs:
            # Reap, and end anything left in the worker's group (children it forked).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1)
        for handle in self._files:
            with contextlib.suppress(OSError):
                handle.close()
        # Temporary logs (no log_dir) are removed once; nothing else is ever unlinked.
        while self._temp_logs:
            with contextlib.suppress(OSError):
                self._temp_logs.pop().unlink()
