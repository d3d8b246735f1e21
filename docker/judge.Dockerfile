# syntax=docker/dockerfile:1
#
# The judge proxy image: the common runtime image (docker/bcstack.Dockerfile: the `bcstack`
# package) set up to run `bcstack serve judge`, which grades final answers and worker
# contributions (HTTP 8005, gRPC 50055) with the rule-based grader or an LLM grader behind an
# OpenAI-compatible endpoint. It runs no model itself. Verdicts are cached in a SQLite file under
# /data/cache: mount a volume there to keep them across restarts.
#
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=judge \
#     --build-arg WITH_TORCH=false -t ghcr.io/browsecomp-stack/bcstack:0.1.0-judge .
#   docker build -f docker/judge.Dockerfile -t ghcr.io/browsecomp-stack/bcstack-judge:0.1.0 .
#   docker run --rm -p 8005:8005 -p 50055:50055 -v "$PWD/judge-cache:/data/cache" \
#     -e BCSTACK_JUDGE_BACKEND=openai -e BCSTACK_JUDGE_GRADER_URL=http://grader:8000/v1 \
#     -e BCSTACK_JUDGE_GRADER_MODEL=gemini-2.5-flash \
#     -e GRADER_API_KEY -e BCSTACK_JUDGE_GRADER_API_KEY_ENV=GRADER_API_KEY \
#     ghcr.io/browsecomp-stack/bcstack-judge:0.1.0
#
# With no settings it runs the rule-based grader, which needs no endpoint and no key. Every
# setting is a BCSTACK_JUDGE_* env var (`bcstack serve judge --help` lists them). The grader's API
# key is never in the image: BCSTACK_JUDGE_GRADER_API_KEY_ENV names the env var holding it, or
# BCSTACK_JUDGE_GRADER_API_KEY_FILE a mounted file; the admin token (BCSTACK_ADMIN_TOKEN) is
# passed at run time too. Under Kubernetes the chart sets command and args itself and probes
# GET /health; Docker's HEALTHCHECK below is for `docker run`/compose.

# The common image of the same release with the [judge] extra (docker/bcstack.Dockerfile
# --build-arg BCSTACK_EXTRA=judge --build-arg WITH_TORCH=false), pinned by version (a digest pins it harder:
# --build-arg BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack@sha256:...).
ARG BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack:0.1.0-judge

FROM ${BCSTACK_IMAGE}

ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack-judge" \
      org.opencontainers.image.description="browsecomp-stack judge proxy (rule-based or LLM grader, verdict cache, rate limits)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# The cache directory, owned by the runtime user so an anonymous or fresh volume is writable.
USER 0:0
RUN mkdir -p /data/cache \
    && chown 10001:10001 /data/cache
USER 10001:10001

# Ports as settings rather than flags, as the chart passes them; --port/--grpc-port still win.
ENV BCSTACK_JUDGE_CACHE_PATH=/data/cache/judge-cache.sqlite \
    BCSTACK_JUDGE_PORT=8005 \
    BCSTACK_JUDGE_GRPC_PORT=50055
VOLUME ["/data/cache"]

# 8005: HTTP (/v1/grade, /v1/grade/contribution, batch forms, /health, /metrics); 50055: gRPC
# (core.v1.JudgeService, grpc.health.v1).
EXPOSE 8005 50055

# urllib raises on any non-2xx answer, so no curl is needed in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8005/health', timeout=4)"]

ENTRYPOINT ["bcstack", "serve", "judge"]
CMD ["--host", "0.0.0.0"]
