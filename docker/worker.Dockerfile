# syntax=docker/dockerfile:1
#
# The worker sidecar image: the common runtime image (docker/bcstack.Dockerfile: the `bcstack`
# package, CPU torch, transformers for the tokenizer) set up to run `bcstack serve worker`, the
# worker episode service. It runs no model itself: it renders the chat template with the
# checkpoint's tokenizer and generates token-in-token-out through an SGLang server
# (BCSTACK_WORKER_ENGINE_URL, by default SGLang on the same pod/host at 127.0.0.1:30000). SGLang
# runs from its own CUDA image (lmsysorg/sglang); charts/bcstack puts the two in one pod.
#
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=worker \
#     --build-arg WITH_TORCH=false -t ghcr.io/browsecomp-stack/bcstack:0.1.0-worker .
#   docker build -f docker/worker.Dockerfile -t ghcr.io/browsecomp-stack/bcstack-worker:0.1.0 .
#   docker run --rm --network host -v "$PWD/checkpoints:/checkpoints:ro" \
#     -e BCSTACK_WORKER_TOKENIZER=/checkpoints/qwen3-4b-worker-sft \
#     -e BCSTACK_WORKER_RETRIEVAL_ADDRESS=127.0.0.1:50051 \
#     ghcr.io/browsecomp-stack/bcstack-worker:0.1.0
#
# Settings beyond the command line come from BCSTACK_WORKER_* env vars (`bcstack serve worker
# --help` lists them: budgets, sampling, addresses); the admin token (BCSTACK_ADMIN_TOKEN) is
# passed at run time, never baked in. Under Kubernetes the chart sets command and args itself and
# probes GET /health; Docker's HEALTHCHECK below is for `docker run`/compose.

# The common image of the same release with the [worker] extra (docker/bcstack.Dockerfile
# --build-arg BCSTACK_EXTRA=worker --build-arg WITH_TORCH=false), pinned by version (a digest pins it harder:
# --build-arg BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack@sha256:...).
ARG BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack:0.1.0-worker

FROM ${BCSTACK_IMAGE}

ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack-worker" \
      org.opencontainers.image.description="browsecomp-stack worker episode service (sidecar of an SGLang server)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# SGLang beside it, as in the chart's pods.
ENV BCSTACK_WORKER_ENGINE_URL=http://127.0.0.1:30000

# 8002: HTTP (/health, /metrics, admin: hot reload); 50052: gRPC (the worker episode service).
EXPOSE 8002 50052

# urllib raises on any non-2xx answer, so no curl is needed in the image. The start period covers
# an SGLang server that is still loading the model next to it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8002/health', timeout=4)"]

USER 10001:10001

ENTRYPOINT ["bcstack", "serve", "worker"]
CMD ["--host", "0.0.0.0", "--port", "8002", "--grpc-port", "50052"]
