#!/usr/bin/env bash
# Train the shipped demo model on the GPU machine (one H200, MLX's CUDA backend) and write
# its mlx-lm directory to $OUT/demo-model/ (6 files, ~7 MB; the device tool brings them back).
#
# On the device, after `source .gpu/b/setup.sh` (../shared/gpu/README.md), from the tree
# this folder travels in:  bash .gpuwork/demo_model/gpu_train.sh   (or tools/demo_model/...)
# About 5 minutes: the tokenizer (~10 s), encoding (~10 s), 270 s of training, the export
# and its check. Extra arguments go to `python -m demo_model train` (--time-budget S, ...).
# A tokenizer.json placed beside this script is reused instead of training a new one.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$here/out}/demo-model
# The folder is a package of relative imports: run it under its own name from its parent,
# so it needs neither tools/ nor an installed kvstore (kvstore, when on the path, is only
# used to check the export).
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
args=(train --recipe h200 --out "$out")
[ -f "$here/tokenizer.json" ] && args+=(--tokenizer "$here/tokenizer.json")
# The device's Python 3.12 has no test/ package (10 MB of sources instead of 31 MB): a
# stdlib.tar.xz beside this script (python3.11/**/*.py, 4.8 MB) is trained on instead.
if [ -f "$here/stdlib.tar.xz" ]; then
  mkdir -p /tmp/demo-corpus && tar -xJf "$here/stdlib.tar.xz" -C /tmp/demo-corpus
  args+=(--corpus "$(ls -d /tmp/demo-corpus/python3*)")
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
python3 -m "$(basename "$here")" "${args[@]}" "$@"
ls -l "$out"
