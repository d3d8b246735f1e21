"""The same sentence-transformers model run by ONNX Runtime: the fast CPU query encoder.

A query embedding dominates a hybrid search on the CPU (bench/retrieval.py). PyTorch spends most
of a one-query MiniLM pass on per-operator dispatch; ONNX Runtime runs the same graph about 2.6×
faster at batch 1 and 1.3× at batch 8–32 on the 2-core CI machine (measured 2026-11-30:
7.3 → 2.8 ms, 20.7 → 16.2 ms, 72.0 → 55.3 ms), with outputs equal to 1e-7.

The graph is exported from the model's whole sentence-transformers pipeline (transformer,
pooling as the model declares it: mean for MiniLM, last token for Qwen3-Embedding), so pooling
and prompts behave exactly as :class:`SentenceTransformerEmbedder`. The export is cached on disk
under a key of the model files, the export code version and the torch version; a second start
loads the cached graph (export of MiniLM takes about a second).

Documents still go through sentence-transformers: for 256-token passages in batches of 64 the
exported graph ran at half torch's speed here (23 vs 44 docs/s, 2026-11-30), so the query path is
ONNX and the indexing path is torch; both give the same vectors (to 1e-7).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.retrieval.embedder import _l2_normalise, _load_quietly, resolve_model_path, retrieval_recipe

EXPORT_VERSION = 1  # bump when the exported graph changes, so stale caches are not reused
OPSET = 17


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bcstack" / "onnx"


def _model_fingerprint(path: str) -> str:
    """Names, sizes and modification times of the model's files (cheap for multi-GB models)."""
    import torch

    digest = hashlib.sha256(f"v{EXPORT_VERSION}|opset{OPSET}|torch{torch.__version__}|".encode())
    root = Path(path)
    if root.is_dir():
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            stat = file.stat()
            digest.update(f"{file.relative_to(root)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    else:  # a hub name: the name is all we know before loading
        digest.update(path.encode())
    return digest.hexdigest()[:16]


class OnnxEmbedder:
    """Drop-in for :class:`SentenceTransformerEmbedder` (same options, same vectors), on ONNX Runtime.

    ``num_threads`` sets ONNX Runtime's intra-op threads for this session only (torch's
    process-wide count is untouched). ``cache_dir`` holds exported graphs; unset, it is
    ``$XDG_CACHE_HOME/bcstack/onnx`` (``~/.cache/bcstack/onnx``).
    """

    def __init__(
        self,
        model: str = "all-MiniLM-L6-v2",
        *,
        batch_size: int = 64,
        max_length: int = 256,
        query_instruction: str | None = None,
        doc_max_length: int | None = None,
        num_threads: int | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        import onnxruntime as ort
        from sentence_transformers import SentenceTransformer

        path = resolve_model_path(model)
        recipe_instruction, recipe_doc_length = retrieval_recipe(model)
        self.name = model
        self.batch_size = batch_size
        self.query_instruction = query_instruction if query_instruction is not None else recipe_instruction
        self.query_max_length = max_length
        self.doc_max_length = doc_max_length or recipe_doc_length or max_length

        st = _load_quietly(SentenceTransformer, path, "cpu")
        dim = st.get_embedding_dimension()
        if dim is None:
            raise ValueError(f"{model}: the model does not declare its embedding dimension")
        self.dim = int(dim)
        self.tokenizer = st.tokenizer
        self.input_names = list(self.tokenizer.model_input_names)
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        graph = cache / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}-{_model_fingerprint(path)}.onnx"
        if not graph.is_file():
            _export(st, self.input_names, graph)
        self._documents = st  # indexing: long passages in big batches, where torch is faster

        options = ort.SessionOptions()
        # ONNX Runtime's pool threads spin between operators by default. On a small CPU shared
        # with the lookups, the event loop and the client that starves them: in bench/retrieval.py
        # (2 cores) the open-loop p99 at half the peak was 95 ms spinning and 38 ms without.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        self.graph_path = graph
        self._session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        # the tokenizer's truncation/padding state is shared; one encode at a time.
        self._lock = threading.Lock()

    def _encode(self, texts: Sequence[str], max_length: int, prompt: str | None) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        texts = [prompt + t for t in texts] if prompt else list(texts)
        out = []
        with self._lock:
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                encoded = self.tokenizer(
                    chunk, padding=True, truncation=True, max_length=max_length, return_tensors="np"
                )
                feed = {name: np.asarray(encoded[name], dtype=np.int64) for name in self.input_names}
                out.append(self._session.run(None, feed)[0])
        return _l2_normalise(np.concatenate(out))

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            self._documents.max_seq_length = self.doc_max_length
            vectors = self._documents.encode(
                list(texts), batch_size=self.batch_size, show_progress_bar=False, convert_to_numpy=True
            )
        return _l2_normalise(vectors)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, self.query_max_length, self.query_instruction)


def _export(st, input_names: list[str], target: Path) -> None:
    """Trace ``st``'s whole pipeline to ONNX with dynamic batch and sequence axes; atomic write."""
    import warnings

    import torch

    class Pipeline(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return self.model(dict(zip(input_names, tensors, strict=True)))["sentence_embedding"]

    sample = st.tokenizer(
        ["an example query", "a second, longer example query"], padding=True, return_tensors="pt"
    )
    axes = {name: {0: "batch", 1: "tokens"} for name in input_names}
    axes["embedding"] = {0: "batch"}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".onnx.tmp")
    os.close(fd)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python branches
            torch.onnx.export(
                Pipeline(st).eval(),
                tuple(sample[name] for name in input_names),
                tmp,
                input_names=input_names,
                output_names=["embedding"],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
        _check_export(st, input_names, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class ExportMismatch(RuntimeError):
    """The exported graph does not reproduce the torch model (e.g. a shape baked in by tracing)."""


def _check_export(st, input_names: list[str], graph: str, tolerance: float = 1e-4) -> None:
    """Compare the graph with the torch pipeline on batch sizes and lengths unlike the trace's."""
    import onnxruntime as ort

    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    probes = [
        ["one"],
        ["a much longer probe sentence, with punctuation and numbers like 1931, to change the length"] * 3,
        ["short", "a medium length probe", "x y z " * 20, "the last probe of four"],
    ]
    for texts in probes:
        encoded = st.tokenizer(texts, padding=True, return_tensors="np")
        got = session.run(None, {n: np.asarray(encoded[n], dtype=np.int64) for n in input_names})[0]
        want = st.encode(texts, convert_to_numpy=True, show_progress_bar=False)
        error = float(np.abs(got - want).max())
        if error > tolerance:
            raise ExportMismatch(
                f"the ONNX export of this model differs from torch by {error:.2e} on {len(texts)} "
                "probe texts; use embed_runtime=torch for it"
            )
