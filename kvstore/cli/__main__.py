"""``python -m kvstore.cli``: the same as the ``kvstore`` console script."""

from __future__ import annotations

import sys

from kvstore.cli import main

sys.exit(main())
