# syntax=docker/dockerfile:1
#
# The coordinator gateway image: the common runtime image (docker/bcstack.Dockerfile: the `bcstack`
# package) set up to run `bcstack serve coordinator`, which runs coordinator episodes (HTTP 8003,
# gRPC 50053), calls the coordinator LLM through its endpoint registry (OpenAI-compatible
# endpoints) and dispatches branches to the worker services over gRPC. It runs no model itself.
# Finished episodes go to a SQLite file under /data/records: mount a volume there to keep them.
#
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=coordinator \
#     --build-arg WITH_TORCH=false -t ghcr.io/browsecomp-stack/bcstack:0.1.0-coordinator .
#   docker build -f docker/coordinator.Dockerfile -t ghcr.io/browsecomp-stack/bcstack-coordinator:0.1.0 .
#   docker run --rm --network host -v "$PWD/records:/data/records" \
#     -v "$PWD/coordinator.yaml:/etc/bcstack/coordinator/config.yaml:ro" \
#     -e MINIMAX_API_KEY -e BCSTACK_COORDINATOR_WORKERS=127.0.0.1:50052 \
#     ghcr.io/browsecomp-stack/bcstack-coordinator:0.1.0 \
#     --host 0.0.0.0 --config /etc/bcstack/coordinator/config.yaml
#
# coordinator.yaml lists the endpoints (`endpoints:` of name, base_url, model, api_key_env) and
# `active_endpoint:`; `bcstack serve coordinator --help` lists every setting and its
# BCSTACK_COORDINATOR_* env var. API keys are never in the file or the image: each endpoint names
# the env var (api_key_env) or mounted file (api_key_file) holding its key, and the admin token
# (BCSTACK_ADMIN_TOKEN) is passed at run time too. Under Kubernetes the chart sets command and args
# itself and probes GET /health; Docker's HEALTHCHECK below is for `docker run`/compose.

# The common image of the same release with the [coordinator] extra (docker/bcstack.Dockerfile
# --build-arg BCSTACK_EXTRA=coordinator --build-arg WITH_TORCH=false), pinned by version (a digest pins it harder:
# --build-arg BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack@sha256:...).
ARG BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack:0.1.0-coordinator

FROM ${BCSTACK_IMAGE}

ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack-coordinator" \
      org.opencontainers.image.description="browsecomp-stack coordinator gateway (coordinator LLM endpoints, branch dispatch to workers, episode records)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# The records directory, owned by the runtime user so an anonymous or fresh volume is writable.
USER 0:0
RUN mkdir -p /data/records \
    && chown 10001:10001 /data/records
USER 10001:10001

ENV BCSTACK_COORDINATOR_RECORDS_PATH=/data/records/coordinator-records.sqlite
VOLUME ["/data/records"]

# 8003: HTTP (/v1/episodes, /admin/coordinator, /health, /metrics); 50053: gRPC
# (core.v1.CoordinatorService, grpc.health.v1).
EXPOSE 8003 50053

# urllib raises on any non-2xx answer, so no curl is needed in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/health', timeout=4)"]

ENTRYPOINT ["bcstack", "serve", "coordinator"]
CMD ["--host", "0.0.0.0", "--port", "8003", "--grpc-port", "50053"]
