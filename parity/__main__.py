"""``python -m parity``: see `parity.cli`."""

import sys

from parity.cli import main

sys.exit(main())
