"""``python -m ntkcore``: the command line of :mod:`ntkcore.cli`."""

import sys

from ntkcore.cli import main

if __name__ == "__main__":
    sys.exit(main())
