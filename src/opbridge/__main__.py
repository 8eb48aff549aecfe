"""``python -m opbridge``: the ``opbridge`` command (see :mod:`opbridge.cli`)."""

import sys

from opbridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
