"""``python -m parity``: see `parity.cli.commands`.

``check`` and ``bisect`` (a golden file against the JAX side, `parity.golden.check`,
`parity.bisect`) are answered before `parity.cli.commands`
is imported: it runs where torch is not installed, and the other commands import torch.
"""

import os
import sys

# Before anything loads torch (libgomp reads it once, when torch loads): torch's idle OpenMP
# threads sleep instead of spinning on the cores XLA's pool needs (`parity.perf.measure.
# set_threads` would set it, but `parity.cli.commands` has imported torch by then).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from parity import bisect  # noqa: E402
from parity.golden import check as golden  # noqa: E402

if sys.argv[1:2] == ["check"]:
    sys.exit(golden.main(sys.argv[2:]))
if sys.argv[1:2] == ["bisect"]:
    sys.exit(bisect.main(sys.argv[2:]))

from parity.cli.commands import main  # noqa: E402  (imports torch: after the torch-free command)

sys.exit(main())
