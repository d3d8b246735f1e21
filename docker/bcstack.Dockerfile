# syntax=docker/dockerfile:1
#
# The common runtime image of browsecomp-stack: the `bcstack` package with one extra of its
# dependencies (pyproject.toml: all, or one service's), run as uid 10001. Each service image
# builds FROM the variant with its own extra, so the coordinator and judge images carry no torch,
# transformers, Locust or matplotlib:
#
#   docker build -f docker/bcstack.Dockerfile -t ghcr.io/browsecomp-stack/bcstack:0.1.0 .   # all
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=coordinator \
#     --build-arg WITH_TORCH=false -t ghcr.io/browsecomp-stack/bcstack:0.1.0-coordinator .
#   (judge and worker: WITH_TORCH=false too; retrieval and trainer: the default true)
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
# The package extra this image carries, and whether that extra needs torch (installed first, from
# the CPU index; an extra without it must not pull it in, which the install step checks).
ARG BCSTACK_EXTRA=all
ARG WITH_TORCH=true
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Dependencies first, so a source-only change reuses the torch layer.
COPY constraints.txt ./
RUN if [ "${WITH_TORCH}" = "true" ]; then \
      pip install -c constraints.txt --index-url "${TORCH_INDEX_URL}" torch; \
    fi

COPY pyproject.toml README.md ./
COPY core ./core
COPY devkit ./devkit
COPY bcstack ./bcstack
COPY services ./services
COPY trainer ./trainer
# Not editable: the runtime stage gets the installed package, not /src.
RUN pip install -c constraints.txt ".[${BCSTACK_EXTRA}]" \
    && pip check \
    && if [ "${WITH_TORCH}" != "true" ] && pip show torch >/dev/null 2>&1; then \
         echo "[${BCSTACK_EXTRA}] pulled in torch: build it with WITH_TORCH=true" >&2; exit 1; \
       fi

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
