"""The text the tiny tokenizer is trained on: a BrowseComp-Plus corpus JSONL or the toy world."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

# The default corpus, as the brief of the embedded default fixes it (DESIGN.md §6).
DEFAULT_TOY_WORLD = {"n_docs": 2000, "seed": 0}
_REQUIRED_FIELDS = ("docid", "text", "url")


class CorpusError(ValueError):
    """A corpus file that is missing or not BrowseComp-Plus JSONL; the message names the line."""


@dataclass(frozen=True)
class Corpus:
    """Documents (`docid`, `text`, `url`) plus where they came from, for the build manifest."""

    documents: list[dict[str, str]]
    source: str  # "file" or "toyworld"
    name: str  # the file's name, or the generator call
    sha256: str  # of the file's bytes, or of the canonical JSONL of the generated documents


def read_corpus_jsonl(path: str | Path) -> Corpus:
    """Read a BrowseComp-Plus corpus file: one JSON object per line with string `docid`, `text`, `url`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorpusError(f"corpus file not found: {path}") from None
    except IsADirectoryError:
        raise CorpusError(f"corpus path is a directory, not a JSONL file: {path}") from None
    except OSError as error:
        raise CorpusError(f"cannot read corpus file {path}: {error.strerror}") from None

    documents = []
    for number, line in enumerate(raw.splitlines(), start=1):
        where = f"{path}, line {number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError(f"{where}: not valid UTF-8") from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a JSON object with docid, text, url")
        for field in _REQUIRED_FIELDS:
            if not isinstance(record.get(field), str):
                raise CorpusError(f"{where}: field {field!r} is missing or not a string")
        documents.append({field: record[field] for field in _REQUIRED_FIELDS})
    if not documents:
        raise CorpusError(f"{path}: the corpus holds no documents")
    return Corpus(documents, source="file", name=path.name, sha256=hashlib.sha256(raw).hexdigest())


def toy_world_corpus() -> Corpus:
    """The toy world's corpus (imported lazily: the generator is only needed when no file is given)."""
    try:
        from devkit.toyworld.generator import generate_world
    except ModuleNotFoundError as error:
        if error.name not in ("devkit.toyworld", "devkit.toyworld.generator"):
            raise
        raise CorpusError("the toy world generator is not installed; pass --corpus FILE") from None

    world = generate_world(**DEFAULT_TOY_WORLD)
    documents = [{field: str(doc[field]) for field in _REQUIRED_FIELDS} for doc in world.corpus]
    canonical = "".join(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in documents)
    arguments = ", ".join(f"{key}={value}" for key, value in DEFAULT_TOY_WORLD.items())
    return Corpus(
        documents,
        source="toyworld",
        name=f"devkit.toyworld.generator.generate_world({arguments})",
        sha256=hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
    )
