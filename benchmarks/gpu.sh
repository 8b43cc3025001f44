#!/usr/bin/env bash
# Hearth on a lent CUDA machine in one call. Its Python has torch, Triton and transformers but not Hearth's other
# dependencies; nothing can be fetched there and only 64 MiB of the working tree travel. So `make gpu-pack` fills
# .gpu/ here first (the few wheels the engine needs beyond that Python, and each model's files minus its weights)
# and the call carries `.gpu/whl` and `.gpu/models` (all of `.gpu`, with the fleet's wheels, is over 64 MiB); the
# models get random weights there (benchmarks/random_models.py).
#
#   bash benchmarks/gpu.sh [STEP ...]      default: host kernels engine tests
#     host     python -m benchmarks.host_probe (CPU quota, Python and launch speed, the CPU GEMM at 1-16 threads)
#     tests    the Triton kernel tests and tests/engine on CUDA (tiny random models against transformers)
#     kernels  python -m benchmarks.kernels (bandwidth against a copy measured in the same run)
#     engine   python -m benchmarks.engine --concurrent 32 256 (SmolLM2-135M; `qwen`: Qwen2.5-Coder-0.5B)
#     kv       python -m benchmarks.kv --throughput-only --quick (1x, 8x, 64x at a fixed KV pool)
#     spec     python -m benchmarks.speculation --step-grid (step time, 1-64 sequences x 0-8 drafts)
#     lora     python -m benchmarks.lora (32 requests over 8 adapters against the base model)
#     fleet    python -m benchmarks.fleet_scaling: 1 vs 4 CPU engine replicas on Ray Serve, on the host's 16 cores
#              (needs .gpu/fleet, Ray Serve's wheels; carry .gpu/whl, .gpu/fleet and the one model it uses:
#              all of .gpu is over the 64 MiB that travel)
#
# Each step runs under its own time limit, so one that hangs cannot eat the call; its end is printed as it finishes
# and every log goes into $OUT/logs.tgz (refreshed after each step). The limits add up to more than one call may
# run (10 minutes). On 2026-11-27 one call of every step on an H200 finished only kernels and kv: the host ran
# transformers.generate at a tenth of its usual speed, so `host` comes first and says why before anything else.
set -uo pipefail
out="${OUT:-$(mktemp -d)}"
logs=/tmp/hearth-logs
rm -rf "$logs" && mkdir -p "$logs"
[ $# -gt 0 ] && steps=("$@") || steps=(host kernels engine tests)

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
if [[ " ${steps[*]} " =~ \ fleet\  ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/fleet/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c 'import torch, triton, transformers, xgrammar; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "xgrammar imports", xgrammar.Grammar is not None, "cpus", __import__("os").cpu_count())'

# Tests build tiny random models and need only a tokenizer: with no model "installed", tests of real weights skip.
tests_data=/tmp/hearth-tests/models/smollm2-135m-instruct
mkdir -p "$tests_data" && cp .gpu/models/smollm2-135m-instruct/tokenizer*.json "$tests_data/"
# The CPU kernels, all at once (16 compilers): built inside the tests, AVX-512 and AMX gemm.c alone took longer
# than a test's time limit there.
HEARTH_DATA_DIR=/tmp/hearth-tests timeout 300 python3 -m kernels.cpu_build
bench_data=/tmp/hearth-bench
if [[ " ${steps[*]} " =~ \ (engine|qwen|kv|spec|lora|fleet)\  ]]; then
    python3 -m benchmarks.random_models unpack .gpu/models "$bench_data" || exit 1
fi

step() {  # step NAME SECONDS COMMAND...: run it under its limit, then show its end at once (a later step may be cut)
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    echo "== $name: exit $?, $((SECONDS - t0)) s" | tee -a "$logs/summary.log"
    if [ "$name" = tests ]; then grep -E "(FAILED|ERROR) |[0-9]+ (passed|failed)" "$logs/$name.log" | cut -c1-200 | tail -n 40
    else grep -v -E "Loading weights|it/s\]|Warning|warn" "$logs/$name.log" | tail -n 24; fi
    tar -czf "$out/logs.tgz" -C "$logs" .
}

for s in "${steps[@]}"; do
    case $s in
        host) HEARTH_DATA_DIR=/tmp/hearth-tests step host 120 python3 -m benchmarks.host_probe ;;
        tests) HEARTH_DATA_DIR=/tmp/hearth-tests step tests 150 python3 -m pytest -p no:cacheprovider -o addopts= \
                   -m "not slow" -n 14 -v -rfE --timeout 60 tests/kernels/test_triton_decode.py \
                   tests/kernels/test_triton_kv_compress.py tests/kernels/test_triton_lora.py \
                   tests/kernels/test_kernel_bench.py tests/kernels/test_triton_globals.py tests/engine ;;
        kernels) step kernels 90 python3 -m benchmarks.kernels ;;
        engine) HEARTH_DATA_DIR=$bench_data step engine 150 python3 -m benchmarks.engine --concurrent 32 256 --runs 2 ;;
        qwen) HEARTH_DATA_DIR=$bench_data step qwen 90 python3 -m benchmarks.engine \
                  --model @hearth/qwen2.5-coder-0.5b-instruct --concurrent 32 256 --runs 1 ;;
        kv) HEARTH_DATA_DIR=$bench_data step kv 60 python3 -m benchmarks.kv --throughput-only --quick ;;
        spec) HEARTH_DATA_DIR=$bench_data step spec 45 python3 -m benchmarks.speculation \
                  --step-grid @hearth/qwen2.5-coder-0.5b-instruct ;;
        lora) HEARTH_DATA_DIR=$bench_data step lora 60 python3 -m benchmarks.lora ;;
        fleet) HEARTH_DATA_DIR=$bench_data step fleet 300 python3 -m benchmarks.fleet_scaling --replicas 1 4 \
                   --rounds 2 --requests 128 --max-tokens 32
               cp -r /tmp/ray/session_latest/logs/serve "$logs/ray-serve" 2>/dev/null ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
cat "$logs/summary.log"
