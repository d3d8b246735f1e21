"""The text the tiny tokenizer is trained on: a BrowseComp-Plus corpus JSONL, or the fixed toy text.

The default is one fixed text for every toy world: the corpus and questions of a toy world with a
seed of its own (7919), which no stack evaluates on. So one tiny kit serves every toy world (a
model trained on one world's trajectories reads another world's pages with the same merges), and
no world's entity names are single tokens: names are spelt from syllable pieces in every world
alike, the way a held-out name has to be copied. A tokenizer trained on the world it is evaluated on
would give that world's names whole tokens whose embeddings no training row ever touched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

# The fixed text's world: the default world's size, a seed reserved for the tokenizer.
DEFAULT_TOY_WORLD = {"n_docs": 2000, "seed": 7919}
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
    # The questions too: their wording ("In which city was ...") is in no document.
    for q in [*getattr(world, "test", []), *getattr(world, "train", [])]:
        documents.append({"docid": f"q{q['query_id']}", "text": q["query"], "url": ""})
    canonical = "".join(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in documents)
    arguments = ", ".join(f"{key}={value}" for key, value in DEFAULT_TOY_WORLD.items())
    return Corpus(
        documents,
        source="toyworld",
        name=f"devkit.toyworld.generator.generate_world({arguments})",
        sha256=hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
    )
