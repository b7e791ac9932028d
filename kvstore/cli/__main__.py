"""``python -m kvstore.cli``: the same as the ``kvstore`` console script."""

from __future__ import annotations

import sys

from kvstore.cli import main

if __name__ == "__main__":  # importing the module (tools walk packages) must not run it
    sys.exit(main())
