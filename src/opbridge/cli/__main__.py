"""``python -m opbridge.cli``: the ``opbridge`` command."""

import sys

from opbridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
