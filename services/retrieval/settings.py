"""Settings of the retrieval service and of `bcstack index` (one class: the same env vars serve both)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr

from core.kit.settings import ServiceSettings

LexicalBackend = Literal["embedded", "elasticsearch"]
EmbedRuntime = Literal["onnx", "torch"]
DenseBackend = Literal["edge", "qdrant", "none"]
SearchMode = Literal["hybrid", "lexical", "dense"]


class RetrievalSettings(ServiceSettings):
    service_name: ClassVar[str] = "retrieval"

    port: int = Field(8001, ge=0, le=65535, description="HTTP port (0 = any free port)")
    grpc_port: int | None = Field(50051, ge=0, le=65535, description="gRPC port; unset = no gRPC server")
    index_dir: Path | None = Field(None, description="index directory written by `bcstack index`")

    # Backends. Unset = what the index manifest says it was built with.
    lexical: LexicalBackend | None = Field(
        None, description="lexical backend: embedded (bm25s) or elasticsearch"
    )
    dense: DenseBackend | None = Field(
        None,
        description="dense backend: edge (Qdrant Edge in-process), qdrant, or none (lexical only: "
        "no embedder is loaded, hybrid search is lexical search, mode dense is refused)",
    )
    bm25_k1: float = Field(0.9, gt=0, description="BM25 k1 (pyserini/BrowseComp-Plus default 0.9)")
    bm25_b: float = Field(0.4, ge=0, le=1, description="BM25 b (pyserini/BrowseComp-Plus default 0.4)")

    elasticsearch_url: str | None = Field(None, description="Elasticsearch URL, e.g. https://es:9200")
    elasticsearch_index: str = Field("bcstack-corpus", description="Elasticsearch index name")
    elasticsearch_username: str | None = Field(None, description="basic-auth user (with the password)")
    elasticsearch_password: SecretStr | None = Field(None, description="basic-auth password (secret)")
    elasticsearch_api_key: SecretStr | None = Field(None, description="API key (secret)")
    elasticsearch_verify_certs: bool = Field(True, description="verify the server's TLS certificate")
    elasticsearch_ca_certs: Path | None = Field(None, description="CA bundle for TLS verification")

    qdrant_url: str | None = Field(None, description="Qdrant URL, e.g. http://qdrant:6333")
    qdrant_collection: str = Field("bcstack-corpus", description="Qdrant collection name")
    qdrant_api_key: SecretStr | None = Field(None, description="Qdrant API key (secret)")

    embedder_model: str | None = Field(
        None,
        description="sentence-transformers model name or path; unset = the index's (all-MiniLM-L6-v2); "
        "unused with dense none",
    )
    embed_batch_size: int = Field(32, gt=0, description="most queries embedded in one micro-batch")
    embed_max_length: int | None = Field(
        None,
        gt=0,
        description="token limit for queries and documents; unset = 256 (Qwen3-Embedding: 4096 for docs)",
    )
    embed_doc_batch_size: int = Field(64, gt=0, description="documents per forward pass while indexing")
    embed_threads: int | None = Field(
        None, ge=1, description="intra-op threads for the embedder (torch: process-wide); unset = default"
    )
    embed_runtime: EmbedRuntime = Field(
        "onnx",
        description="run the embedder on onnx (ONNX Runtime, the fast CPU path) or torch "
        "(sentence-transformers; use it on a GPU or for a model that does not export)",
    )
    embed_cache_dir: Path | None = Field(
        None, description="where exported ONNX graphs are cached; unset = ~/.cache/bcstack/onnx"
    )
    # 0 = no timer: a query arriving while the model is idle goes at once, and whatever arrives
    # while a batch runs forms the next batch (measured in bench/retrieval.py: the 3 ms timer
    # only added latency at moderate load, batching under load comes from the busy model).
    embed_max_wait_ms: float = Field(0.0, ge=0, description="extra wait before an idle model runs (ms)")
    ingest_batch_size: int = Field(256, gt=0, description="documents per ingest batch")

    rrf_k: int = Field(60, ge=0, description="RRF constant k (60 as the RRF paper, pyserini, Elasticsearch)")
    rrf_window: int = Field(50, ge=1, le=1000, description="results taken from each retriever before fusing")
    backend_timeout_seconds: float = Field(5.0, gt=0, description="per-backend time limit for one search")
    snippet_words: int = Field(512, ge=0, description="words of text returned per hit (0 = full text)")
    max_k: int = Field(100, ge=1, le=1000, description="largest k a request may ask for")
    max_query_chars: int = Field(2048, ge=1, description="longest query accepted")
    max_batch_queries: int = Field(64, ge=1, description="most queries in one BatchSearch")
    search_threads: int = Field(4, ge=1, description="threads running index lookups off the event loop")


def secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
