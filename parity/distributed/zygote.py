"""One process per distributed run that imports the workers' modules once and forks each worker.

A worker started as ``python -m parity.distributed.worker SPEC`` spends most of its start on
imports (torch, torch._dynamo for DDP, JAX, Flax, the harness: about 2.5 CPU s), and a run
starts one worker per torch rank and per JAX process. A `Zygote` is started once per run with
the workers' environment (the script `parity.distributed.fork_server`): it imports the modules
it is given, then, single-threaded, with no JAX backend, torch process group or OpenMP pool
started, forks one child per worker. Each child
starts its own session (process group), points its standard streams at its log (stdin at
``/dev/null``), runs ``module.main(args)`` and exits with its code after the interpreter's exit
functions, as the ``python -m module ARGS`` process it stands for would: the same environment
and modules, nothing initialised before the fork.

The zygote reports each child's PID and exit status to its owner (a `WorkerGroup`, which ends
children by PID as it ends the processes it starts). A zygote that is not single-threaded when
asked to fork refuses, and the owner starts that worker as a process of its own.

Not the standard library's ``multiprocessing`` fork server: there is one per launching process,
started with the launcher's environment, while a run's workers need the run's own (the host
device count and platform that JAX reads when it loads), and its children are
``multiprocessing`` processes, not sessions of their own that a `WorkerGroup` ends by group.

Protocol, one JSON object a line: owner to zygote ``{"module", "args", "log"}``; zygote to owner
``{"started": PID}`` or ``{"refused": REASON}`` in answer, and ``{"exited": PID, "code": CODE}``
when a child ends (CODE as `subprocess.Popen.returncode`: negative for a signal). The zygote
exits once its input is closed and its children have ended, with ``os._exit`` (no interpreter
shutdown, which walks every object torch and JAX made; a child runs its exit functions first).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ForkedWorker", "Zygote", "can_fork"]


def can_fork() -> bool:
    """Whether workers can be forked here (Linux: ``os.fork`` and ``/proc`` to count threads)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class ForkedWorker:
    """A worker forked by a `Zygote`: ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)``
    as a `subprocess.Popen` (what `WorkerGroup` uses of one)."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote._exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            with self._zygote._changed:
                if self._zygote._exit_code(self.pid) is None:
                    self._zygote._changed.wait(0.05 if left is None else min(left, 0.05))
        return self.returncode


class Zygote:
    """The owner's handle of a zygote process (see the module docstring).

    Args:
      preload: modules the zygote imports once (each child's module among them).
      env: the zygote's environment, hence every child's.
      log: file for the zygote's own output (an import that fails says why there).
    """

    def __init__(self, preload: Sequence[str], env: dict[str, str], log: str | os.PathLike):
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "parity.distributed.fork_server", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            start_new_session=True,  # ended as a unit, by PID, as every worker
        )
        self._exits: dict[int, int] = {}
        self._answers: list[dict] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def _procs(self) -> list[subprocess.Popen]:
        # What `parity.distributed.procs.live_worker_pids` lists of a running zygote.
        return [self._proc]

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if self._ended and self._proc.poll() is not None:
                # The zygote is gone without a word on this child (it was killed): the child's
                # status is lost with it, so an ended child counts as failed.
                if _gone(pid):
                    return self._exits.setdefault(pid, 1)
        return None

    def fork(
        self, module: str, args: Sequence[str], log: str | os.PathLike, timeout_s: float
    ) -> ForkedWorker | None:
        """Forks a child running ``module.main(args)`` with its output in `log`; None when the
        zygote refused, is gone, or did not answer within `timeout_s` (it is then ended): the
        caller starts the worker as a process."""
        if self._proc.poll() is not None:
            return None
        command = {"module": module, "args": [str(a) for a in args], "log": str(log)}
        try:
            self._proc.stdin.write((json.dumps(command) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._answers and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            answer = self._answers.pop(0) if self._answers else None
        if answer is None:
            # No answer in time (still importing?): the command would be run later, by nobody's
            # worker. The zygote is ended, and a child it started meanwhile with it.
            self.terminate()
            self._reader.join(timeout=5.0)
            for late in self._answers:
                if "started" in late:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(late["started"], signal.SIGKILL)
            self._answers.clear()
            return None
        if "started" not in answer:
            print(
                f"parity: {answer.get('refused')}; the worker starts as a process", file=sys.stderr
            )
            return None
        return ForkedWorker(self, answer["started"])

    def close(self, grace_s: float = 5.0) -> None:
        """Closes the zygote's input: it exits once its children have ended (their owner ends
        them first); killed after `grace_s` if it has not."""
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.terminate()
        self._reader.join(timeout=grace_s)
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdout.close()
        self._log_file.close()

    def terminate(self) -> None:
        """Ends the zygote (SIGKILL to its process group; its children have their own)."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
