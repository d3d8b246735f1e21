# syntax=docker/dockerfile:1
#
# The common runtime image of browsecomp-stack: the `bcstack` package and its dependencies on
# CPU torch, run as uid 10001. Every CPU service (retrieval, coordinator gateway, judge proxy,
# worker sidecar) runs from it as `bcstack serve <service>`; service images build FROM it or
# copy /opt/venv out of its `build` stage.
#
#   docker build -f docker/bcstack.Dockerfile -t bcstack:0.1.0 .
#
# GPU images (the SGLang worker servers, the trainer) install the CUDA build of the same torch
# version (constraints.txt pins torch==2.13.0) from the CUDA wheel index instead of the CPU one.
#
# probe: no HEALTHCHECK here. Which service this image runs, and on which port, is chosen at
# deploy time, so health is checked by the Kubernetes probes of charts/bcstack: an httpGet of
# GET /health on the service's HTTP port (every `bcstack serve X` serves it). Docker ignores a
# HEALTHCHECK under Kubernetes anyway.

# One base for both stages, pinned by version so a rebuild gets the same Python and Debian.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

# --- build: resolve and install everything into a self-contained virtualenv ----------------
FROM ${PYTHON_IMAGE} AS build

# The CPU wheel index keeps pip from resolving torch to the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Dependencies first, so a source-only change reuses the torch layer.
COPY constraints.txt ./
RUN pip install -c constraints.txt --index-url "${TORCH_INDEX_URL}" torch

COPY pyproject.toml README.md ./
COPY core ./core
COPY devkit ./devkit
COPY bcstack ./bcstack
COPY services ./services
COPY trainer ./trainer
# Not editable: the runtime stage gets the installed package, not /src.
RUN pip install -c constraints.txt . \
    && pip check

# --- runtime: the venv on a clean base, no build tools, non-root ----------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack" \
      org.opencontainers.image.description="browsecomp-stack common runtime (CPU)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# uid/gid 10001 match podSecurityContext in charts/bcstack/values.yaml; a uid above the
# host's usual range cannot collide with a host user's files on a shared volume.
RUN groupadd --gid 10001 bcstack \
    && useradd --uid 10001 --gid 10001 --home-dir /home/bcstack --create-home \
       --shell /usr/sbin/nologin bcstack

COPY --from=build /opt/venv /opt/venv

# The chart mounts the root filesystem read-only, with writable volumes on /tmp and $HOME
# (model and tokenizer caches live under $HOME/.cache).
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/bcstack \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /home/bcstack
USER 10001:10001

ENTRYPOINT ["bcstack"]
CMD ["--help"]
