"""``python -m zerostall ...``: the same command line as the ``zerostall`` console script."""

from __future__ import annotations

import sys

from zerostall.cli import main

if __name__ == "__main__":
    sys.exit(main())
