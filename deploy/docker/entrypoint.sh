#!/bin/sh
# Container entrypoint: run any Tandem component by name. The image names no etcd or NATS: give a
# component --etcd/--nats (or TANDEM_ETCD/TANDEM_NATS, as compose and k8s do); `up` starts its own.
#   docker run tandem frontend --http-port 8000 --host 0.0.0.0
#   docker run tandem target --model /models/llama --health-port 9100
#   docker run tandem draft --draft-method ngram --health-port 9100
#   docker run tandem router --http-port 8001 --mode kv
#   docker run tandem mock --served-model-name mock --health-port 9100
#   docker run tandem up --mock --host 0.0.0.0       (the whole local stack in one container)
# Anything else is executed as given (e.g. `docker run -it tandem bash`).
set -eu
PYTHON="${TANDEM_PYTHON:-python}"

if [ "$#" -eq 0 ]; then
    set -- frontend --help
fi

component="$1"
case "$component" in
    frontend) shift; exec "$PYTHON" -m frontend "$@" ;;
    router)   shift; exec "$PYTHON" -m router "$@" ;;
    target)   shift; exec "$PYTHON" -m workers.target "$@" ;;
    draft)
        shift
        # Targets dial the gRPC address a draft registers, so it must be routable: with
        # TANDEM_DRAFT_GRPC_HOST=auto (compose) the draft binds and registers the container's IP.
        if [ "${TANDEM_DRAFT_GRPC_HOST:-}" = "auto" ]; then
            ip="$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
            set -- --grpc-host "$ip" "$@"
        elif [ -n "${TANDEM_DRAFT_GRPC_HOST:-}" ]; then
            set -- --grpc-host "$TANDEM_DRAFT_GRPC_HOST" "$@"
        fi
        exec "$PYTHON" -m workers.draft "$@" ;;
    mock)     shift; exec "$PYTHON" -m workers.mock "$@" ;;
    up)       shift; exec "$PYTHON" -m deploy.cli up "$@" ;;
    tandem)   shift; exec "$PYTHON" -m deploy.cli "$@" ;;
    *)        exec "$@" ;;
esac
