"""Write a legacy-layout mlx-lm prompt-cache fixture under tests/fixtures/mlx_lm/.

The file must come from a real older mlx-lm, not from our imitation of it, so
run this with that mlx-lm first on the path: 0.28.0 (the last release whose
``meta_state`` fields begin with the cache's step) and 0.31.3 (the last release of
the legacy layout, what Python 3.10 gets) are there::

    .venv/bin/pip download mlx-lm==0.31.3 --no-deps -d /tmp/mlx-lm-wheel
    .venv/bin/python -m zipfile -e /tmp/mlx-lm-wheel/mlx_lm-0.31.3-py3-none-any.whl /tmp/mlx-lm-0.31
    PYTHONPATH=/tmp/mlx-lm-0.31 .venv/bin/python tools/write_mlx_lm_fixture.py --write

It writes the prompt cache itself, the rows fed to each layer (so the test can
rebuild the same caches with kvstore's families and compare bit for bit), and
a config.json. Existing files are never overwritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mlx_lm"

#: One layer per entry: mlx-lm class, its arguments, dtype, update sizes.
LAYERS = [
    {"class": "KVCache", "args": [], "dtype": "float16", "updates": [30, 1, 1, 1]},
    {"class": "QuantizedKVCache", "args": [64, 4], "dtype": "bfloat16", "updates": [30, 1, 1, 1]},
    # wraps and rotates: newest rows at [keep, _idx)
    {"class": "RotatingKVCache", "args": [16, 2], "dtype": "float16", "updates": [30, 1, 1, 1, 1]},
    # a chunk after a prefill: holds window + chunk - 1 rows in temporal order
    {"class": "RotatingKVCache", "args": [16, 0], "dtype": "bfloat16", "updates": [10, 12]},
]
HEADS, HEAD_DIM = 2, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fixture files")
    args = parser.parse_args(argv)
    import mlx_lm
    from mlx_lm.models import cache as lm_cache

    version = mlx_lm.__version__
    target = OUT / f"prompt-cache-mlx-lm-{version}.safetensors"
    if target.exists():
        print(f"{target} exists; fixtures are never regenerated.")
        return 1
    if not args.write:
        print(f"would write {target} with mlx-lm {version}; pass --write")
        return 0
    caches, inputs = [], {}
    for i, spec in enumerate(LAYERS):
        cache = getattr(lm_cache, spec["class"])(*spec["args"])
        for j, n in enumerate(spec["updates"]):
            key = mx.random.key(1000 * i + j)
            k, v = (
                mx.random.normal((1, HEADS, n, HEAD_DIM), key=sub).astype(
                    getattr(mx, spec["dtype"])
                )
                for sub in mx.random.split(key)
            )
            cache.update_and_fetch(k, v)
            inputs[f"layer.{i}.update.{j}.keys"] = k
            inputs[f"layer.{i}.update.{j}.values"] = v
        caches.append(cache)
    OUT.mkdir(parents=True, exist_ok=True)
    lm_cache.save_prompt_cache(str(target), caches, {"written_by": f"mlx-lm {version}"})
    mx.save_safetensors(str(OUT / f"inputs-mlx-lm-{version}.safetensors"), inputs)
    config = {"mlx_lm": version, "heads": HEADS, "head_dim": HEAD_DIM, "layers": LAYERS}
    (OUT / f"config-mlx-lm-{version}.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
