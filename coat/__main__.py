"""``python -m coat <command>`` (and ``torchrun ... -m coat train``): the ``coat`` command line."""

import sys

from coat.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
