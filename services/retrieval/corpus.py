"""Read a corpus in the BrowseComp-Plus format: JSONL or Parquet rows of ``docid``, ``text``, ``url``.

The title is the ``title:`` of a ``---`` front matter at the top of ``text`` (BrowseComp-Plus
documents carry one), else the first non-empty line. Every problem names the file and the line
(JSONL, 1-based) or row (Parquet, 0-based): a missing or empty ``docid`` or ``text``, bytes that
are not UTF-8, a row that is not a JSON object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.retrieval.backends import Doc

TITLE_MAX_CHARS = 300
_FRONT_MATTER_RE = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)
_TITLE_LINE_RE = re.compile(r"^title:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


class CorpusError(ValueError):
    """The corpus file is unusable; the message names the file and line or row."""


def title_of(text: str) -> str:
    m = _FRONT_MATTER_RE.match(text)
    if m:
        t = _TITLE_LINE_RE.search(m.group(1))
        if t and t.group(1):
            return t.group(1).strip("\"'")[:TITLE_MAX_CHARS]
        body = text[m.end() :]
    else:
        body = text
    for line in body.splitlines():
        if line.strip():
            return line.strip()[:TITLE_MAX_CHARS]
    return ""


@dataclass(frozen=True)
class CorpusRow:
    where: str  # "corpus.jsonl:12" or "corpus.parquet row 11"
    doc: Doc


def _doc_from(obj: object, where: str) -> Doc:
    if not isinstance(obj, dict):
        raise CorpusError(
            f"{where}: expected a JSON object with docid, text and url, got {type(obj).__name__}"
        )
    docid = obj.get("docid")
    if docid is None or (isinstance(docid, str) and not docid.strip()):
        raise CorpusError(f"{where}: missing 'docid'")
    if not isinstance(docid, str | int) or isinstance(docid, bool):
        raise CorpusError(f"{where}: 'docid' must be a string or an integer, got {type(docid).__name__}")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise CorpusError(f"{where}: missing or empty 'text' (docid {docid})")
    url = obj.get("url") or ""
    if not isinstance(url, str):
        raise CorpusError(f"{where}: 'url' must be a string (docid {docid})")
    return Doc(docid=str(docid).strip(), text=text, url=url, title=title_of(text))


def _read_jsonl(path: Path) -> Iterator[CorpusRow]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{where}: not valid UTF-8 (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield CorpusRow(where, _doc_from(obj, where))


def _read_parquet(path: Path, batch_rows: int = 4096) -> Iterator[CorpusRow]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise CorpusError(f"{path}: not a readable Parquet file ({e})") from None
    names = set(pf.schema_arrow.names)
    for needed in ("docid", "text"):
        if needed not in names:
            raise CorpusError(f"{path}: no '{needed}' column (columns: {', '.join(sorted(names))})")
    columns = [c for c in ("docid", "text", "url") if c in names]
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
        for obj in batch.to_pylist():
            yield CorpusRow(f"{path} row {row}", _doc_from(obj, f"{path} row {row}"))
            row += 1


def read_corpus(path: str | Path) -> Iterator[CorpusRow]:
    """Rows of the corpus file in order, validated. ``.parquet`` by suffix, JSONL otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    if path.suffix.lower() in (".parquet", ".pq"):
        return _read_parquet(path)
    return _read_jsonl(path)


def count_rows(path: str | Path) -> int | None:
    """Rows in the file (for a progress bar's total), or None when counting would be costly."""
    path = Path(path)
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except Exception:
        return None
