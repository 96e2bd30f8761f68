"""``python -m parity``: see `parity.cli.commands`.

``check`` and ``bisect`` (a golden file against the JAX side, `parity.golden.check`,
`parity.bisect`) are answered before `parity.cli.commands`
is imported: it runs where torch is not installed, and the other commands import torch.
"""

import sys

from parity import bisect
from parity.golden import check as golden

if sys.argv[1:2] == ["check"]:
    sys.exit(golden.main(sys.argv[2:]))
if sys.argv[1:2] == ["bisect"]:
    sys.exit(bisect.main(sys.argv[2:]))

from parity.cli.commands import main  # noqa: E402  (imports torch: after the torch-free command)

sys.exit(main())
