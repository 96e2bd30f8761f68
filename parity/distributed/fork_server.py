"""The zygote process of `parity.distributed.zygote` (``python -m parity.distributed.fork_server
MODULE...``): imports the modules it is given, then forks a child per command read on its input.

The protocol, and why a zygote, are in `parity.distributed.zygote`, whose `Zygote` starts this
script and is its only client. A script of its own: the package's ``__init__`` imports its
owner's side, and a module run with ``python -m`` must not be imported before it runs.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import sys
import time
import traceback
from collections.abc import Sequence


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


# -- the zygote process --------------------------------------------------------------------------


def _child(command: dict, reply_fd: int, ready_fd: int) -> None:
    """In the forked child: its own session, its log, ``module.main(args)``, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        os.close(ready_fd)  # the zygote reports the child once it leads its own process group
        os.close(reply_fd)
        log = os.open(command["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        module = importlib.import_module(command["module"])
        sys.argv = [str(getattr(module, "__file__", command["module"])), *command["args"]]
        try:
            result = module.main(list(command["args"]))
            code = result if isinstance(result, int) else 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(preload: Sequence[str]) -> int:
    """The zygote's loop: imports `preload`, then forks a child per command read on stdin."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # the zygote's own output (and its modules') goes to its log
    for name in preload:
        importlib.import_module(name)

    def reply(message: dict) -> None:
        os.write(reply_fd, (json.dumps(message) + "\n").encode())

    children: set[int] = set()
    pending = b""
    closed = False
    while not closed or children:
        if not closed and select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            closed = not data
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                command = json.loads(line)
                threads = _threads()
                if threads != 1:
                    reply({"refused": f"the zygote runs {threads} threads; forking needs one"})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    _child(command, reply_fd, ready_w)
                os.close(ready_w)
                os.read(ready_r, 1)  # end of file: the child has its own session (or is gone)
                os.close(ready_r)
                children.add(pid)
                reply({"started": pid})
        elif closed:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    code = _serve(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The zygote holds nothing to finalise (no file, lock or process group of its own), and an
    # interpreter's shutdown walks every object torch and JAX made: ~1.2 CPU s skipped.
    os._exit(code)
