"""``python -m parity``: see `parity.cli.commands`.

``check`` and ``bisect`` (a golden file against the JAX side, `parity.golden.check`,
`parity.bisect`) are answered before `parity.cli.commands`
is imported: it runs where torch is not installed, and the other commands import torch.
"""

import gc
import os
import sys

# Before anything loads torch (libgomp reads it once, when torch loads): torch's idle OpenMP
# threads sleep instead of spinning on the cores XLA's pool needs (`parity.perf.measure.
# set_threads` would set it, but `parity.cli.commands` has imported torch by then).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from parity import bisect  # noqa: E402
from parity.golden import check as golden  # noqa: E402


def _exit(code: int) -> None:
    """Exits with `code` without the interpreter's last garbage collection. Every result is
    written and closed by then; that collection would only walk the objects torch and JAX
    made (about 0.7 CPU s of a command's exit). ``atexit`` functions and stream flushes run."""
    gc.freeze()
    sys.exit(code)


if sys.argv[1:2] == ["check"]:
    _exit(golden.main(sys.argv[2:]))
if sys.argv[1:2] == ["bisect"]:
    _exit(bisect.main(sys.argv[2:]))

from parity.cli.commands import main  # noqa: E402  (imports torch: after the torch-free command)

_exit(main())
