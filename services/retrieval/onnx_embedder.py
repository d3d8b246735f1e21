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

Beside the graph the export caches the query side: the model's tokenizer as the `tokenizers`
library serialises it, with the truncation and padding that transformers' fast tokenizer sets for
a ``tokenizer(texts, padding=True, truncation=True, max_length=...)`` call (the same backend
object, so the same ids), and the embedding dimension. A start that finds both loads neither
sentence-transformers nor torch: importing them took about 5 s of a retrieval service's 8.6 s start
on the 2-core CI machine (measured 2026-12-06), and the model itself is only needed to index
documents, where it is loaded on the first batch.

Documents still go through sentence-transformers: for 256-token passages in batches of 64 the
exported graph ran at half torch's speed here (23 vs 44 docs/s, 2026-11-30), so the query path is
ONNX and the indexing path is torch; both give the same vectors (to 1e-7).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
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
# input name -> attribute of a `tokenizers.Encoding`
_ENCODING_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bcstack" / "onnx"


def _model_fingerprint(path: str) -> str:
    """Names, sizes and modification times of the model's files (cheap for multi-GB models)."""
    try:  # the installed version, read without importing torch (seconds)
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    digest = hashlib.sha256(f"v{EXPORT_VERSION}|opset{OPSET}|torch{torch_version}|".encode())
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

        self._path = path = resolve_model_path(model)
        recipe_instruction, recipe_doc_length = retrieval_recipe(model)
        self.name = model
        self.batch_size = batch_size
        self.query_instruction = query_instruction if query_instruction is not None else recipe_instruction
        self.query_max_length = max_length
        self.doc_max_length = doc_max_length or recipe_doc_length or max_length

        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        graph = cache / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}-{_model_fingerprint(path)}.onnx"
        query_side = graph.with_suffix(".query.json")
        self._documents = None  # the sentence-transformers model, for indexing; loaded when first needed
        if not (graph.is_file() and query_side.is_file()):
            st = self._load_documents_model()
            if not graph.is_file():
                _export(st, list(st.tokenizer.model_input_names), graph)
            _write_query_side(st, query_side)
        side = json.loads(query_side.read_text())
        self.dim = int(side["dim"])
        self.input_names = list(side["input_names"])
        self.tokenizer = _query_tokenizer(side["tokenizer"], max_length)  # a `tokenizers.Tokenizer`
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
        # one encode at a time (and one load of the documents' model)
        self._lock = threading.Lock()

    def _load_documents_model(self):
        if self._documents is None:
            from sentence_transformers import SentenceTransformer

            st = _load_quietly(SentenceTransformer, self._path, "cpu")
            if st.get_embedding_dimension() is None:
                raise ValueError(f"{self.name}: the model does not declare its embedding dimension")
            self._documents = st
        return self._documents

    def _encode(self, texts: Sequence[str], prompt: str | None) -> np.ndarray:
        """Query embeddings (the tokenizer truncates at the query length)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        texts = [prompt + t for t in texts] if prompt else list(texts)
        out = []
        with self._lock:
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                encoded = self.tokenizer.encode_batch(chunk)
                feed = {
                    name: np.array([getattr(e, _ENCODING_FIELDS[name]) for e in encoded], dtype=np.int64)
                    for name in self.input_names
                }
                out.append(self._session.run(None, feed)[0])
        return _l2_normalise(np.concatenate(out))

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            documents = self._load_documents_model()
            documents.max_seq_length = self.doc_max_length
            vectors = documents.encode(
                list(texts), batch_size=self.batch_size, show_progress_bar=False, convert_to_numpy=True
            )
        return _l2_normalise(vectors)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, self.query_instruction)


def _write_query_side(st, target: Path) -> None:
    """The query encoder's tokenizer and dimension beside the graph (the module docstring); atomic."""
    from tokenizers import Tokenizer

    hf = st.tokenizer
    tokenizer = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    # what transformers' PreTrainedTokenizerFast.set_truncation_and_padding sets for padding=True,
    # truncation=True (longest_first), a max_length (set again on every load: `_query_tokenizer`)
    tokenizer.enable_truncation(
        max_length=512,
        stride=0,
        strategy="longest_first",
        direction=hf.truncation_side,
    )
    tokenizer.enable_padding(
        direction=hf.padding_side,
        pad_id=hf.pad_token_id,
        pad_token=hf.pad_token,
        pad_type_id=hf.pad_token_type_id,
    )
    side = {
        "dim": int(st.get_embedding_dimension()),
        "input_names": list(hf.model_input_names),
        "tokenizer": tokenizer.to_str(),
    }
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(side, out)
    os.replace(tmp, target)


def _query_tokenizer(serialised: str, max_length: int):
    """The cached tokenizer, truncating at ``max_length`` as it was told to truncate."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(serialised)
    truncation = tokenizer.truncation or {}
    tokenizer.enable_truncation(
        max_length=max_length,
        stride=truncation.get("stride", 0),
        strategy=truncation.get("strategy", "longest_first"),
        direction=truncation.get("direction", "right"),
    )
    return tokenizer


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
