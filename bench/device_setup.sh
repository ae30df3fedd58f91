# Sourced by the scripts that run on the GPU machine (bench/gpu_check.sh, bench/train_head_gpu.sh),
# from the repository root: makes $OUT, and installs the wheels carried in .whl/ (packages that
# machine lacks; git-ignored, see docs/benchmarks.md) without network into /tmp/site.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
