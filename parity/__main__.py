"""``python -m parity``: see `parity.cli`.

``check`` (a golden file against the JAX side, `parity.golden`) is answered before `parity.cli`
is imported: it runs where torch is not installed, and the other commands import torch.
"""

import os
import sys

# Before anything loads torch (libgomp reads it once): torch's idle OpenMP threads sleep instead
# of spinning on the cores XLA's pool needs (`parity.measure.set_threads`; recorded per run).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from parity import golden  # noqa: E402

if sys.argv[1:2] == ["check"]:
    sys.exit(golden.main(sys.argv[2:]))

from parity.cli import main  # noqa: E402  (imports torch: after the torch-free command)

sys.exit(main())
