#!/usr/bin/env bash
# One call on a lent CUDA machine whose Python has torch and Triton but not Hearth's other dependencies:
# the kernel tests compiled for the GPU, then each kernel timed against its torch reference.
#   bash benchmarks/gpu.sh        (writes kernels-tests.log and kernels.md under $OUT when set)
set -euo pipefail
out="${OUT:-$(mktemp -d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/kernels >"$out/kernels-tests.log" 2>&1 || status=$?
tail -5 "$out/kernels-tests.log"
python3 -m benchmarks.kernels | tee "$out/kernels.md"
exit "${status:-0}"
