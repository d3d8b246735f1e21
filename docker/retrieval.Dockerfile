# syntax=docker/dockerfile:1
#
# The retrieval service image: the common runtime image (docker/bcstack.Dockerfile: the
# `bcstack` package, CPU torch, the offline all-MiniLM-L6-v2 embedder, bm25s, Qdrant Edge) set up
# to run `bcstack serve retrieval` over an index directory at /data/index.
#
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=retrieval \
#     --build-arg WITH_TORCH=true -t ghcr.io/browsecomp-stack/bcstack:0.1.0-retrieval .
#   docker build -f docker/retrieval.Dockerfile -t ghcr.io/browsecomp-stack/bcstack-retrieval:0.1.0 .
#   docker run --rm -p 8001:8001 -p 50051:50051 -v "$PWD/index:/data/index" \
#     ghcr.io/browsecomp-stack/bcstack-retrieval:0.1.0
#
# Build the index first, with the same image:
#   docker run --rm -v "$PWD/index:/data/index" -v "$PWD/corpus:/data/corpus:ro" \
#     --entrypoint bcstack ghcr.io/browsecomp-stack/bcstack-retrieval:0.1.0 \
#     index --corpus /data/corpus/corpus.jsonl --index-dir /data/index
#
# Settings beyond the command line come from BCSTACK_RETRIEVAL_* env vars (`bcstack serve
# retrieval --help` lists them); secrets (ELASTICSEARCH_PASSWORD, QDRANT_API_KEY, ...) are passed
# at run time, never baked in. Under Kubernetes (charts/bcstack) the Deployment sets command and
# args itself and probes GET /health; Docker's HEALTHCHECK below is for `docker run`/compose.

# The common image of the same release with the [retrieval] extra (docker/bcstack.Dockerfile
# --build-arg BCSTACK_EXTRA=retrieval --build-arg WITH_TORCH=true), pinned by version (a digest pins it harder:
# --build-arg BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack@sha256:...).
ARG BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack:0.1.0-retrieval

FROM ${BCSTACK_IMAGE}

ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack-retrieval" \
      org.opencontainers.image.description="browsecomp-stack hybrid retrieval service (BM25 + dense, RRF)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# The index directory, owned by the runtime user so an anonymous or fresh volume is writable.
USER 0:0
RUN mkdir -p /data/index \
    && chown 10001:10001 /data/index
USER 10001:10001

ENV BCSTACK_RETRIEVAL_INDEX_DIR=/data/index
VOLUME ["/data/index"]

# 8001: HTTP (/search, /open, /v1/search, /health, /metrics); 50051: gRPC
# (core.v1.RetrievalService, grpc.health.v1).
EXPOSE 8001 50051

# 200 once the indexes are loaded; 503 while loading (start period) or when both retrievers are
# down. urllib raises on any non-2xx answer, so no curl is needed in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=4)"]

ENTRYPOINT ["bcstack", "serve", "retrieval"]
CMD ["--host", "0.0.0.0", "--port", "8001", "--grpc-port", "50051", "--index-dir", "/data/index"]
