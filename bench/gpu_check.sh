#!/usr/bin/env bash
# The GPU check, in one go on a CUDA machine: installs the carried wheels, runs the GPU tests, then bench/gpu_bench.py.
# Usage: bash bench/gpu_check.sh [gpu_bench.py flags]   (results in $OUT, default ./gpu-results)
#
# The machine needs python3 with torch (CUDA), triton, transformers, pytest. Packages it lacks travel
# as wheels in .whl/ (git-ignored; see docs/benchmarks.md for the download command) and are installed
# here without network into /tmp/site. The exit status is non-zero if the tests or the bench failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
source bench/device_setup.sh
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# On CUDA the engine, kernel and sampler unit tests run compiled (no interpreter), plus the gpu-marked tests.
# The SmolLM2 tests are left to the CPU suite: the demo model's package (94 MB) cannot travel.
python3 -m pytest -p no:cacheprovider -q -rs -k "not smollm2" tests/gpu tests/unit/workers/engine \
    tests/unit/workers/speculation/test_triton_rejection.py tests/unit/workers/speculation/test_tree_rejection.py \
    2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 bench/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, gpu bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
