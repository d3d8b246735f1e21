"""Load evaluation questions from the files they ship in.

Three row shapes, in JSON lines (``.jsonl``, ``.json``; a ``.json`` holding one JSON array also works)
or Parquet, told apart row by row:

* FoldAgent split rows: ``prompt``, ``data_source`` (``bc_test_easy|bc_test_meduim|bc_test_hard``, upstream's
  spelling), ``extra_info`` {``query_id``, ``query``, ``answer``, ``evidence_docs``, ``gold_docs``,
  ``negative_docs``}, maybe ``reward_model``. The tier comes from ``data_source``.
* BrowseComp-Plus query rows: ``query_id``, ``query``, ``answer``, ``evidence_docs``, ``gold_docs``,
  ``negative_docs``, every field but ``query_id`` possibly obfuscated with the benchmark's canary string
  (see :func:`decrypt_field`). No tier.
* The toy world's ``questions.jsonl`` / ``train.jsonl``: BrowseComp-Plus rows in clear text plus
  ``data_source``.

Documents in ``evidence_docs`` / ``gold_docs`` may be ``{docid, text, url}`` objects or bare docids; only the
docids are kept. A TREC qrels file (``qid Q0 docid rel``) given with the questions replaces the evidence
documents of the questions it names. Every problem is a :class:`LoaderError` whose message names the file,
the row (1-based line for JSON lines, 0-based row index for Parquet) and the field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIERS = ("easy", "medium", "hard")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# Fields obfuscated in BrowseComp-Plus that the harness reads. `negative_docs` is obfuscated too, but never
# used and holds most of the file's text, so it is left alone.
ENCRYPTED_FIELDS = ("query", "answer", "evidence_docs", "gold_docs")
# Parquet columns worth reading; `prompt`, `reward_model` and `negative_docs` are skipped.
_PARQUET_COLUMNS = ("query_id", "query", "answer", "data_source", "evidence_docs", "gold_docs", "extra_info")
# FoldAgent's data_source names; "meduim" is upstream's spelling in both splits.
_TIER_RE = re.compile(r"^(?:bc_(?:test|dev|train)_)?(easy|medium|meduim|hard)$")
_PASSWORD_HINT = "pass --password (the benchmark's canary string) or set it in the config file"


@dataclass(frozen=True)
class EvalQuestion:
    query_id: str
    query: str
    answer: str
    tier: str | None  # "easy" | "medium" | "hard", or None where the file does not say
    evidence_docs: tuple[str, ...] = ()  # docids
    gold_docs: tuple[str, ...] = ()  # docids
    source: str = ""  # the row's data_source, if any


class LoaderError(ValueError):
    """A question or qrels file that cannot be used; the message names the file, the row and the field."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | str | None = None,
        row: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.row = row
        self.field = field


class DecryptionError(LoaderError):
    """An obfuscated value that does not decrypt: ``reason`` is "not base64" or "not UTF-8" (a wrong key)."""

    def __init__(self, reason: str, field: str) -> None:
        super().__init__(f"decryption failed ({reason}) for field {field or 'value'!r}", field=field)
        self.reason = reason


def _error(path: Path | str, row: str | None, field: str | None, problem: str) -> LoaderError:
    where = ", ".join(part for part in (row, f"field {field!r}" if field else None) if part)
    message = f"{path}: {where}: {problem}" if where else f"{path}: {problem}"
    return LoaderError(message, path=path, row=row, field=field)


def tier_of(data_source: str) -> str | None:
    """The tier a FoldAgent ``data_source`` names (``bc_test_meduim`` → ``medium``); None if it names none.

    Bare tier names (``"hard"``) are accepted too, for hand-written question files.
    """
    if not isinstance(data_source, str):
        return None
    match = _TIER_RE.match(data_source.strip().lower())
    if match is None:
        return None
    tier = match.group(1)
    return "medium" if tier == "meduim" else tier


# --- BrowseComp-Plus obfuscation -------------------------------------------------------------------
# base64(plaintext XOR sha256(password) repeated to the message length), as BrowseComp's simple-evals and
# BrowseComp-Plus' decrypt script do; nested lists and objects are processed value by value.


def _xor(data: bytes, digest: bytes) -> bytes:
    key = (digest * (len(data) // len(digest) + 1))[: len(data)]
    # One big-integer XOR rather than a byte loop: evidence documents run to tens of kilobytes.
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(len(data), "big")


def _digest(password: str) -> bytes:
    return hashlib.sha256(password.encode("utf-8")).digest()


def _decrypt(value: Any, digest: bytes, field: str) -> Any:
    if isinstance(value, str):
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise DecryptionError("not base64", field) from None
        try:
            return _xor(data, digest).decode("utf-8")
        except UnicodeDecodeError:
            raise DecryptionError("not UTF-8", field) from None
    if isinstance(value, list | tuple):
        return type(value)(_decrypt(item, digest, f"{field}[{i}]") for i, item in enumerate(value))
    if isinstance(value, dict):
        return {k: _decrypt(v, digest, f"{field}.{k}" if field else str(k)) for k, v in value.items()}
    return value


def _encrypt(value: Any, digest: bytes) -> Any:
    if isinstance(value, str):
        return base64.b64encode(_xor(value.encode("utf-8"), digest)).decode("ascii")
    if isinstance(value, list | tuple):
        return type(value)(_encrypt(item, digest) for item in value)
    if isinstance(value, dict):
        return {k: _encrypt(v, digest) for k, v in value.items()}
    return value


def decrypt_field(value: Any, password: str) -> Any:
    """Undo BrowseComp-Plus obfuscation: strings are decrypted, lists and objects recursively (keys stay),
    other scalars are returned as they are. A value that is not base64, or does not decrypt to UTF-8 (a
    wrong password), raises :class:`DecryptionError` (a :class:`LoaderError`) whose ``field`` is the path
    inside ``value``."""
    return _decrypt(value, _digest(password), "")


def encrypt_field(value: Any, password: str) -> Any:
    """The inverse of :func:`decrypt_field` (for making test fixtures)."""
    return _encrypt(value, _digest(password))


def _is_text(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch.isspace() for ch in text)


def _looks_encrypted(value: Any) -> bool:
    """Not readable text but base64 whose bytes are not text either: an obfuscated field."""
    if not isinstance(value, str) or not value:
        return False
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False  # clear text has spaces and punctuation base64 does not
    return not _is_text(data)


# --- reading rows ----------------------------------------------------------------------------------


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        seen_row = False
        for number, raw in enumerate(f, start=1):
            where = f"line {number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise _error(path, where, None, "not UTF-8 text") from None
            if not line:
                continue
            if not seen_row and line.startswith("[") and path.suffix.lower() == ".json":
                # One JSON array of rows rather than JSON lines.
                try:
                    text = line + "\n" + f.read().decode("utf-8")
                except UnicodeDecodeError:
                    raise _error(path, None, None, "not UTF-8 text") from None
                yield from _json_array_rows(path, text, number - 1)
                return
            seen_row = True
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:  # also an integer too long to convert, deep nesting
                problem = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
                raise _error(path, where, None, f"not valid JSON ({problem})") from None
            yield where, row


def _json_array_rows(path: Path, text: str, line_offset: int) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise _error(
                path, f"line {exc.lineno + line_offset}", None, f"not valid JSON ({exc.msg})"
            ) from None
        raise _error(path, None, None, f"not valid JSON ({exc})") from None
    if not isinstance(rows, list):
        raise _error(path, None, None, "expected JSON lines or one JSON array of objects")
    for index, row in enumerate(rows, start=1):
        yield f"item {index}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as parquet:
            names = parquet.schema_arrow.names
            columns = [name for name in names if name in _PARQUET_COLUMNS]
            if not columns:
                raise _error(
                    path,
                    None,
                    "query_id",
                    f"unknown format: no question columns (has {', '.join(names) or 'none'}; expected "
                    "extra_info + data_source (FoldAgent) or query_id, query, answer (BrowseComp-Plus))",
                )
            index = 0
            for batch in parquet.iter_batches(columns=columns, batch_size=256):
                for row in batch.to_pylist():
                    yield f"row index {index}", row
                    index += 1
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, LoaderError):
            raise
        raise _error(path, None, None, f"not a readable Parquet file ({exc})") from None


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _json_rows(path)
    if suffix in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    raise _error(
        path, None, None, f"unknown format {suffix or '(no suffix)'!r}: expected .jsonl, .json or .parquet"
    )


# --- fields ----------------------------------------------------------------------------------------


def _row_fields(path: Path, where: str, row: Any) -> tuple[dict, str, str]:
    """(the question's fields, their name prefix in messages, the data_source) of one row of either shape."""
    if not isinstance(row, dict):
        raise _error(path, where, None, f"expected a JSON object, got {type(row).__name__}")
    source = row.get("data_source")
    if "extra_info" in row:  # FoldAgent split
        info = row["extra_info"]
        if isinstance(info, str):
            try:
                info = json.loads(info)
            except (ValueError, RecursionError):
                info = None
        if not isinstance(info, dict):
            raise _error(path, where, "extra_info", "expected an object with query_id, query and answer")
        fields, prefix = info, "extra_info."
    elif "query_id" in row or "query" in row:
        fields, prefix = row, ""
    else:
        has = ", ".join(map(str, row)) or "no fields"
        raise _error(
            path,
            where,
            "query_id",
            "unknown row format: expected a FoldAgent split row (data_source, extra_info) or a "
            f"BrowseComp-Plus query row (query_id, query, answer); has {has}",
        )
    if source is None:
        source = ""
    if not isinstance(source, str):
        raise _error(path, where, "data_source", f"expected text, got {type(source).__name__}")
    return fields, prefix, source


def _query_id(value: Any, path: Path, where: str, field: str) -> str:
    if value is None:
        raise _error(path, where, field, "missing")
    if isinstance(value, bool):
        raise _error(path, where, field, f"expected text or an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, str | int):
        raise _error(path, where, field, f"expected text or an integer, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise _error(path, where, field, "empty")
    return text


def _text(value: Any, path: Path, where: str, field: str) -> str:
    if value is None:
        raise _error(path, where, field, "missing")
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)  # numeric answers written as numbers
    if not isinstance(value, str):
        raise _error(path, where, field, f"expected text, got {type(value).__name__}")
    if not value.strip():
        raise _error(path, where, field, "empty")
    return value


def _docids(value: Any, path: Path, where: str, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) and value.lstrip().startswith("["):  # a list stored as a JSON string
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise _error(path, where, field, "not a valid JSON list") from None
    if not isinstance(value, list | tuple):
        raise _error(
            path, where, field, f"expected a list of documents or docids, got {type(value).__name__}"
        )
    docids: list[str] = []
    for i, doc in enumerate(value):
        docid = doc.get("docid") if isinstance(doc, dict) else doc
        item = f"{field}[{i}].docid" if isinstance(doc, dict) else f"{field}[{i}]"
        if docid is None:
            raise _error(path, where, item, "missing")
        if isinstance(docid, bool) or not isinstance(docid, str | int):
            raise _error(path, where, item, f"expected a docid, got {type(docid).__name__}")
        docids.append(str(docid))
    return tuple(docids)


def _question(path: Path, where: str, row: Any, digest: bytes | None) -> EvalQuestion:
    fields, prefix, source = _row_fields(path, where, row)
    qid = _query_id(fields.get("query_id"), path, where, prefix + "query_id")
    values = {name: fields.get(name) for name in ENCRYPTED_FIELDS}
    if digest is not None:
        for name in ENCRYPTED_FIELDS:
            if values[name] is None:
                continue
            try:
                values[name] = _decrypt(values[name], digest, name)
            except DecryptionError as exc:
                hint = (
                    "wrong password?"
                    if exc.reason == "not UTF-8"
                    else "is the file encrypted? drop --password"
                )
                raise _error(
                    path, where, prefix + (exc.field or name), f"decryption failed ({exc.reason}); {hint}"
                ) from None
    elif _looks_encrypted(values["query"]):
        raise _error(path, where, prefix + "query", f"the queries are encrypted; {_PASSWORD_HINT}")
    return EvalQuestion(
        query_id=qid,
        query=_text(values["query"], path, where, prefix + "query"),
        answer=_text(values["answer"], path, where, prefix + "answer"),
        tier=tier_of(source),
        evidence_docs=_docids(values["evidence_docs"], path, where, prefix + "evidence_docs"),
        gold_docs=_docids(values["gold_docs"], path, where, prefix + "gold_docs"),
        source=source,
    )


# --- public entry points ---------------------------------------------------------------------------


def load_questions(
    path: Path | str, *, password: str | None = None, qrels: Path | str | None = None
) -> list[EvalQuestion]:
    """The questions of a FoldAgent split, a BrowseComp-Plus queries file or a toy-world question file.

    In file order. ``password`` decrypts BrowseComp-Plus obfuscated fields (given, every field but
    ``query_id`` is taken to be encrypted); without it an encrypted file is refused with a hint. ``qrels``
    (TREC) replaces the evidence docids of the questions it names.
    """
    path = Path(path)
    if not path.is_file():
        raise _error(path, None, None, "no such file")
    digest = _digest(password) if password is not None else None
    relevant = load_qrels(qrels) if qrels is not None else {}
    questions: list[EvalQuestion] = []
    first_row: dict[str, str] = {}
    try:
        for where, row in _rows(path):
            question = _question(path, where, row, digest)
            if question.query_id in first_row:
                raise _error(
                    path,
                    where,
                    "query_id",
                    f"duplicate query_id {question.query_id!r}: also at {first_row[question.query_id]}",
                )
            first_row[question.query_id] = where
            if question.query_id in relevant:
                question = dataclasses.replace(question, evidence_docs=tuple(relevant[question.query_id]))
            questions.append(question)
    except OSError as exc:
        raise _error(path, None, None, f"cannot read ({exc.strerror or exc})") from None
    return questions


def decrypt_file(path: Path | str, out: Path | str, *, password: str) -> int:
    """Write BrowseComp-Plus query rows of ``path`` (JSON lines or Parquet) to ``out`` in clear text, as
    JSON lines with ``query_id``, ``query``, ``answer``, ``evidence_docs`` and ``gold_docs`` (documents
    whole, their text decrypted too); how many rows. ``negative_docs`` is left out (never used, most of
    the file). ``out`` appears only complete (a temporary file renamed) and readable by its owner only:
    it holds the benchmark's answers, which must not reach a crawler or a training set."""
    path, out = Path(path), Path(out)
    if not path.is_file():
        raise _error(path, None, None, "no such file")
    digest = _digest(password)
    temporary = out.with_name(f".{out.name}.partial")
    count = 0
    seen: set[str] = set()
    try:
        with temporary.open("w", encoding="utf-8") as handle:
            temporary.chmod(0o600)
            for where, row in _rows(path):
                fields, prefix, _ = _row_fields(path, where, row)
                if prefix:
                    raise _error(
                        path, where, "extra_info", "a FoldAgent split row: its fields are not encrypted"
                    )
                qid = _query_id(fields.get("query_id"), path, where, "query_id")
                if qid in seen:
                    raise _error(path, where, "query_id", f"duplicate query_id {qid!r}")
                seen.add(qid)
                clear: dict[str, Any] = {"query_id": qid}
                for name in ENCRYPTED_FIELDS:
                    if fields.get(name) is None:
                        continue
                    try:
                        clear[name] = _decrypt(fields[name], digest, name)
                    except DecryptionError as exc:
                        hint = "wrong password?" if exc.reason == "not UTF-8" else "is the file encrypted?"
                        raise _error(
                            path, where, exc.field or name, f"decryption failed ({exc.reason}); {hint}"
                        ) from None
                handle.write(json.dumps(clear, ensure_ascii=False) + "\n")
                count += 1
        temporary.replace(out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return count


def load_qrels(path: Path | str) -> dict[str, list[str]]:
    """TREC qrels (``qid Q0 docid rel``): each qid's docids with ``rel > 0``, in file order, once each."""
    path = Path(path)
    relevant: dict[str, list[str]] = {}
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"line {number}"
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    raise _error(path, where, None, "not UTF-8 text") from None
                if not line:
                    continue
                parts = line.split()
                if len(parts) != 4:
                    raise _error(
                        path,
                        where,
                        None,
                        f"expected 'qid Q0 docid rel', got {len(parts)} fields: {line[:80]!r}",
                    )
                qid, _, docid, rel = parts
                try:
                    grade = float(rel)
                except ValueError:
                    raise _error(path, where, "rel", f"expected a number, got {rel!r}") from None
                if grade > 0:
                    docids = relevant.setdefault(qid, [])
                    if docid not in docids:
                        docids.append(docid)
    except OSError as exc:
        raise _error(path, None, None, f"cannot read ({exc.strerror or exc})") from None
    return relevant
