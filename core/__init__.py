"""The base layer of browsecomp-stack: what every part shares and nothing that serves.

- `v1`: the generated gRPC stubs (protobuf package `bcstack.v1`, sources in proto/core/v1/)
- `protocol`, `budget`: the worker protocol (FoldAgent-compatible) and per-episode budgets
- `records`, `record_store`: the typed, versioned episode record every part passes around, and
  its durable SQLite store
- `grading`: the BrowseComp grader format (templates, verdict parsing, rule matching)
- `checkpoint`, `model_layout`: the serving-format check (hashes, safetensors headers, the tensor
  layout computed from config.json), torch-free
- `chat_template`: the Qwen3 keep-thinking chat template, rendered append-only
- `atomic`: atomic writes and folder swaps
- `kit`: the service kit (settings, logging, metrics, auth, HTTP/gRPC edges, the serve factory)

Layers point one way (pyproject.toml's import-linter contracts, `make lint`):
core <- devkit <- services | trainer <- bcstack (the CLI and apps).
"""

__version__ = "0.1.0"
