"""The benchmark harness from a checkout: the same as ``kvstore bench``.

    .venv/bin/python tools/bench/run.py [--quick] [--only P1,P4] [--out DIR] [--repeats N]

Results of record go in ``tools/bench/results/`` (``--out tools/bench/results``).
"""

from __future__ import annotations

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
