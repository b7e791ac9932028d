"""Run ``kvstore`` with the process's GIL switch interval set first.

    python3 tools/bench/with_switch_interval.py MS kvstore-args...
    python3 tools/bench/with_switch_interval.py 0.5 bench --only G3 --out DIR

Python hands the GIL from a thread running Python to one waiting for it every switch
interval (5 ms by default). While a save's writer runs Python (planning records,
headers), a generating thread that released the GIL (an evaluation) may wait that long
to take it back, more than once a step: G3's ``step during save ms`` and ``longest step
during save ms``, run at 5 and at 0.5, say what that costs the tokens a save overlaps
(the library already shortens the interval while CUDA page registrations run:
``KVSTORE_CUDA_SWITCH_MS``). On this 2-core CPU a thread waking every 0.5 ms beside a
lossless llama-8B-shaped save of 4096 tokens waited 1.44-1.58 ms at the 99th percentile
with 5 ms, 1.13-1.15 with 0.5 (the cores' contention blurs the rest).
"""

from __future__ import annotations

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.setswitchinterval(float(sys.argv[1]) / 1e3)
    sys.argv = ["kvstore", *sys.argv[2:]]
    raise SystemExit(main())
