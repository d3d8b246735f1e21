"""Code every service shares, in one place (DESIGN.md §2).

- settings: `ServiceSettings` (pydantic-settings; env `BCSTACK_<SERVICE>_*`, `--config` YAML)
- logging: `setup_logging`, secret redaction
- metrics: per-service Prometheus registry, HTTP middleware, gRPC interceptor
- auth: `require_admin` (Bearer `BCSTACK_ADMIN_TOKEN`)
- http: `create_app` (FastAPI with /health, /metrics, body limit), `serve_http`
- grpc_server: `GrpcServer` (grpc.aio with health, reflection, graceful stop), client channels
- runner: `run_service`, one process serving HTTP and/or gRPC
- protocol, budget: the worker protocol and budget (transport-free)

Submodules are imported directly (`from services.common.http import create_app`) so that a
module needing only the protocol does not pull in FastAPI or gRPC.
"""
