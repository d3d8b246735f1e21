"""The episode viewer's list page: one page of the gateway's records, filtered, newest first.

    page = list_view(store, {"status": "finish", "graded": "incorrect", "page": "2"})

The filters are the list's query string, as a browser's form sends it (an empty value is no filter);
a value that makes no sense is reported on the page and left out, never an error page. The columns
filtered on are the record store's indexed ones (`core.record_store.RecordQuery`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from urllib.parse import urlencode

from core.record_store import RecordQuery, RecordStore
from services.coordinator.viewer import verdict_label, when

PER_PAGE = 50
MAX_PER_PAGE = 500
GRADED_CHOICES = ("correct", "incorrect", "ungraded")

FILTER_NAMES = ("status", "question_id", "group_id", "endpoint", "weight_version", "graded", "since", "until")


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    created: str
    question_id: str
    group_id: str
    status: str
    endpoint: str
    weight_versions: list[str]
    verdict: str


@dataclass(frozen=True)
class ListView:
    rows: list[EpisodeRow]
    total: int
    page: int
    pages: int
    per_page: int
    filters: dict[str, str]  # as given (the form's values)
    facets: dict[str, list[str]]
    errors: list[str]
    prev_query: str | None  # the query string of the previous page; None on the first
    next_query: str | None

    @property
    def first_shown(self) -> int:
        return (self.page - 1) * self.per_page + 1 if self.rows else 0

    @property
    def last_shown(self) -> int:
        return self.first_shown + len(self.rows) - 1 if self.rows else 0


def _day(value: str, name: str, errors: list[str]) -> float | None:
    try:
        return datetime.combine(date.fromisoformat(value), datetime.min.time(), UTC).timestamp()
    except ValueError:
        errors.append(f"{name}: {value!r} is not a date; give YYYY-MM-DD")
        return None


def _positive(value: str | None, default: int, name: str, errors: list[str], most: int) -> int:
    if not value:
        return default
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= most:  # int('²') raises
        errors.append(f"{name}: {value!r} is not a whole number from 1 to {most:,}")
        return default
    return int(value)


def parse_filters(params: Mapping[str, str]) -> tuple[RecordQuery, dict[str, str], list[str]]:
    """The record query of the list's query string (empty values: no filter), the filters as given,
    and one line per value that makes no sense (that filter is then left out)."""
    given = {n: params[n].strip() for n in FILTER_NAMES if params.get(n, "").strip()}
    errors: list[str] = []
    graded = given.get("graded")
    if graded is not None and graded not in GRADED_CHOICES:
        errors.append(f"graded: {graded!r} is not one of {', '.join(GRADED_CHOICES)}")
        graded = None
    since = _day(given["since"], "since", errors) if "since" in given else None
    until = _day(given["until"], "until", errors) if "until" in given else None
    query = RecordQuery(
        status=given.get("status"),
        question_id=given.get("question_id"),
        group_id=given.get("group_id"),
        endpoint=given.get("endpoint"),
        weight_version=given.get("weight_version"),
        graded=graded,  # type: ignore[arg-type]
        created_from=since,
        created_to=None if until is None else until + timedelta(days=1).total_seconds(),  # until: inclusive
    )
    return query, given, errors


def list_view(store: RecordStore, params: Mapping[str, str]) -> ListView:
    """One page of the records the query string's filters match, newest first (blocking: SQLite)."""
    query, given, errors = parse_filters(params)
    per_page = _positive(params.get("per_page"), PER_PAGE, "per_page", errors, MAX_PER_PAGE)
    page = _positive(params.get("page"), 1, "page", errors, 10**9)
    rows, total = store.search(query, offset=(page - 1) * per_page, limit=per_page)
    pages = max(1, math.ceil(total / per_page))
    if page > pages:  # past the end (records deleted, a stale link): the last page
        page = pages
        rows, total = store.search(query, offset=(page - 1) * per_page, limit=per_page)

    def link(to: int) -> str:
        extra = {"per_page": str(per_page)} if per_page != PER_PAGE else {}
        return urlencode({**given, **extra, "page": str(to)})

    return ListView(
        rows=[
            EpisodeRow(
                episode_id=r["episode_id"],
                created=when(r["created_at"]),
                question_id=r["question_id"] or "",
                group_id=r["group_id"] or "",
                status=r["status"],
                endpoint=r["endpoint"] or "",
                weight_versions=r["weight_versions"],
                verdict=verdict_label(r["correct"], r["correct"] is not None),
            )
            for r in rows
        ],
        total=total,
        page=page,
        pages=pages,
        per_page=per_page,
        filters=given,
        facets=store.facets(),
        errors=errors,
        prev_query=link(page - 1) if page > 1 else None,
        next_query=link(page + 1) if page < pages else None,
    )
