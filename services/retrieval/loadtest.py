"""Load tests against the retrieval service: `bcstack loadtest retrieval` and `run_loadtest()`.

The load comes from Locust used as a library: a headless ``Environment`` with a ``LocalRunner``
whose users are gevent greenlets. HTTP users are ``FastHttpUser`` (geventhttpclient) posting
``{"query", "k"}`` to ``/search``; gRPC users call ``bcstack.v1.RetrievalService/Search`` through
the checked-in stub on one shared channel and fire Locust's ``request`` event themselves, so both
transports land in the same statistics.

Why a subprocess. Importing ``locust`` runs ``gevent.monkey.patch_all()`` on the importing
process, which would break any asyncio / ``grpc.aio`` code of a caller. So this module imports
only the standard library at the top, and ``run_loadtest()`` starts a fresh interpreter that
patches first, then ``grpc.experimental.gevent.init_gevent()`` (gRPC's docs: after the standard
library is patched, before any gRPC object exists), then drives Locust. The child gets its
config as JSON and writes per-request records back as JSON; everything else (percentiles,
timeline, histogram, report.json, latency.png) is computed here, in the caller's process. The
child loads this very file by path, so no package ``__init__`` runs before the patch.

Two modes:

- closed loop (``concurrency=N``): N users, each sending its next request as soon as the last
  one is answered; the achieved QPS is what the server sustains at that concurrency.
- open loop (``qps=Q``): arrivals on a fixed schedule, request i at ``t0 + i/Q``, independent of
  how fast answers come. A pool of users (``users``, default ``ceil(Q)`` within [8, 1000], which
  covers 1 s of latency at the target rate) takes the schedule's slots in order, so the rate is
  honoured whenever a user is free (the schedule lag, slot to send, is ~0.3 ms at p50 here).
  When none is (server slower than pool/Q), the slot is sent late, as soon as a user frees up:
  counted as ``late_starts``, with the lag reported; slots still unsent when the window ends are
  dropped and counted as ``unsent_slots``. The report puts achieved QPS (responses completed per
  second of the window) and sent QPS next to the target; ``rate_honoured`` is achieved within
  5 %. Locust's own ``constant_throughput`` paces each user after its previous answer, so a slow
  reply delays that user's next arrival — closed loop in disguise; the shared schedule avoids it.

Counting. A request belongs to the phase (warmup or measured) of its slot (closed loop: its send
time). Every run is bounded: ``duration_s`` is mandatory and capped, and so are users, rate and
``max_requests``. At the end of the window no new request starts; the ones claimed or in flight
get ``timeout_s`` + 1 s to finish (each request has its own ``timeout_s``), then Locust is
stopped. Requests still in flight then are reported as ``aborted_requests``, and the caller kills
the child if it outlives warmup + duration + timeout + a startup allowance. Latency percentiles
are over successful requests; failed ones are counted by kind (``connection_refused``,
``timeout``, ``http_503``, ``grpc_unavailable``, ``bad_response``, ...) and by message.

One load-generating process uses one core (gevent); ``client_cpu_percent`` in the report says
how close it was to that limit (above ~90 % the tool, not the server, bounds the result).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAX_USERS = 5000
MAX_QPS = 100_000.0
MAX_DURATION_S = 3600.0
# Open-loop pool bounds: the default pool covers one second of latency at the target rate.
MIN_OPEN_LOOP_USERS = 8
MAX_DEFAULT_OPEN_LOOP_USERS = 1000
# A request sent this long after its open-loop slot counts as a late start.
LATE_START_MS = 10.0
# Time the child may take to import Locust/gRPC and spawn its users, on top of the run itself.
STARTUP_ALLOWANCE_S = 60.0
SEARCH_MODES = ("hybrid", "lexical", "dense")

DEFAULT_QUERIES: tuple[str, ...] = (
    "who founded the observatory on the northern ridge",
    "river delta flooding 1887",
    "name of the ship that sank near the lighthouse",
    "award-winning novelist born in a coastal town who later became a cartographer",
    "population of the capital city",
    "first woman to chair the academy of sciences",
    "treaty signed after the three-year war between the two kingdoms",
    "album released in 1994 with a song about trains",
    "Which architect designed the glass library that opened the same year as the tramway?",
    "chemical element discovered by a pharmacist",
    "bridge collapse engineer inquiry",
    "festival held every leap year in the mountain village",
    "painter who lost his sight and kept painting",
    "university that moved its campus twice in the 20th century",
    "Zürich Üetliberg Sternwarte",
    "mayor 1952",
    "football club relegated the season its stadium burned down",
    "recipe with saffron and dried apricots from the old spice route",
    "inventor of the folding bicycle patent",
    "composer whose only opera premiered posthumously in a converted warehouse",
)


class LoadTestError(RuntimeError):
    """The load test could not run or could not finish (the message is one line, for users)."""


class LoadTestConfigError(LoadTestError, ValueError):
    """The configuration is invalid (a usage error on the command line)."""


@dataclass(frozen=True)
class LoadTestConfig:
    """What to load and how hard. Exactly one of ``concurrency`` / ``qps`` must be set.

    url: ``http://host:port`` (``/search`` is appended when the URL has no path) or, with
    ``grpc=True``, ``host:port``. Times are in seconds; ``qps`` in requests per second.
    """

    url: str
    duration_s: float
    concurrency: int | None = None
    qps: float | None = None
    grpc: bool = False
    queries: tuple[str, ...] = DEFAULT_QUERIES
    k: int = 10
    mode: str = "hybrid"
    warmup_s: float = 0.0
    timeout_s: float = 10.0
    users: int | None = None
    max_requests: int | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.qps is None):
            raise LoadTestConfigError("give exactly one of concurrency (closed loop) or qps (open loop)")
        if not (isinstance(self.duration_s, int | float) and 0 < self.duration_s <= MAX_DURATION_S):
            raise LoadTestConfigError(
                f"duration must be > 0 and <= {MAX_DURATION_S:.0f} s, got {self.duration_s}"
            )
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_USERS:
            raise LoadTestConfigError(f"concurrency must be in 1..{MAX_USERS}, got {self.concurrency}")
        if self.qps is not None and not 0 < self.qps <= MAX_QPS:
            raise LoadTestConfigError(f"qps must be > 0 and <= {MAX_QPS:.0f}, got {self.qps}")
        if self.users is not None:
            if self.qps is None:
                raise LoadTestConfigError("users sets the open-loop pool; with concurrency it is redundant")
            if not 1 <= self.users <= MAX_USERS:
                raise LoadTestConfigError(f"users must be in 1..{MAX_USERS}, got {self.users}")
        if self.k < 1:
            raise LoadTestConfigError(f"k must be >= 1, got {self.k}")
        if self.mode not in SEARCH_MODES:
            raise LoadTestConfigError(f"mode must be one of {', '.join(SEARCH_MODES)}, got {self.mode!r}")
        if self.warmup_s < 0 or self.warmup_s > MAX_DURATION_S:
            raise LoadTestConfigError(f"warmup must be in 0..{MAX_DURATION_S:.0f} s, got {self.warmup_s}")
        if not 0 < self.timeout_s <= 600:
            raise LoadTestConfigError(f"timeout must be > 0 and <= 600 s, got {self.timeout_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise LoadTestConfigError(f"max_requests must be >= 1, got {self.max_requests}")
        if not self.queries or not all(isinstance(q, str) and q.strip() for q in self.queries):
            raise LoadTestConfigError("queries must be a non-empty list of non-empty strings")
        self.target()  # validates the URL

    @property
    def mode_name(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def user_count(self) -> int:
        """Locust users: the concurrency (closed loop) or the open-loop pool."""
        if self.concurrency is not None:
            return self.concurrency
        if self.users is not None:
            return self.users
        assert self.qps is not None
        return max(MIN_OPEN_LOOP_USERS, min(MAX_DEFAULT_OPEN_LOOP_USERS, math.ceil(self.qps)))

    def target(self) -> tuple[str, str]:
        """(host for Locust, path) for HTTP; (host:port, "") for gRPC."""
        from urllib.parse import urlsplit

        url = self.url.strip()
        if self.grpc:
            if url.startswith("grpc://"):
                url = url[len("grpc://") :]
            if "://" in url or "/" in url or ":" not in url:
                raise LoadTestConfigError(f"with grpc the url is host:port, got {self.url!r}")
            host, _, port = url.rpartition(":")
            if not host or not port.isdigit():
                raise LoadTestConfigError(f"with grpc the url is host:port, got {self.url!r}")
            return url, ""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LoadTestConfigError(f"url must look like http://host:port, got {self.url!r}")
        try:
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as exc:
            raise LoadTestConfigError(f"bad port in url {self.url!r}: {exc}") from None
        path = parts.path if parts.path not in ("", "/") else "/search"
        if parts.query:
            path = f"{path}?{parts.query}"
        return f"{parts.scheme}://{parts.netloc}", path

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["queries"] = list(self.queries)
        d["mode_name"] = self.mode_name
        d["user_count"] = self.user_count
        return d


def load_queries(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Queries from a text file (one per line) or JSONL with a ``query`` field (e.g. questions.jsonl).

    A file is read as JSONL when its name ends in .jsonl/.json or its first non-blank line starts
    with ``{``. Blank lines are skipped.
    """
    p = Path(path)
    if not p.is_file():
        raise LoadTestConfigError(f"queries file not found: {p}")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadTestConfigError(f"cannot read queries file {p}: {exc}") from None
    numbered = [(i, line.strip()) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise LoadTestConfigError(f"queries file {p} has no queries")
    as_jsonl = p.suffix in (".jsonl", ".json") or numbered[0][1].startswith("{")
    if not as_jsonl:
        return tuple(line for _, line in numbered)
    queries = []
    for lineno, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LoadTestConfigError(f"{p}:{lineno}: not JSON ({exc.msg})") from None
        query = row.get("query") if isinstance(row, dict) else None
        if not isinstance(query, str) or not query.strip():
            raise LoadTestConfigError(f'{p}:{lineno}: no non-empty "query" string field')
        queries.append(query.strip())
    return tuple(queries)


# --- statistics: pure functions -------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float | None]:
    """min/mean/p50/p90/p99/max in ms; all None for no samples."""
    s = sorted(latencies_ms)
    return {
        "min": float(s[0]) if s else None,
        "mean": (sum(s) / len(s)) if s else None,
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "max": float(s[-1]) if s else None,
    }


def log_histogram(latencies_ms: Sequence[float], bins: int = 40) -> dict[str, list[float]]:
    """Counts in ``bins`` log-spaced buckets spanning the samples: ``edges_ms`` (n+1), ``counts`` (n).

    Bucket i holds edges[i] <= x < edges[i+1]; the last bucket also holds its upper edge.
    """
    values = [max(v, 1e-3) for v in latencies_ms]
    if not values:
        return {"edges_ms": [], "counts": []}
    lo, hi = math.log10(min(values)), math.log10(max(values))
    if hi - lo < 1e-9:
        lo, hi, bins = lo - 0.01, hi + 0.01, 1
    edges = [10 ** (lo + (hi - lo) * i / bins) for i in range(bins + 1)]
    counts = [0] * bins
    for v in values:
        counts[min(max(bisect.bisect_right(edges, v) - 1, 0), bins - 1)] += 1
    return {"edges_ms": edges, "counts": counts}


def per_second_timeline(
    start_s: Sequence[float], latency_ms: Sequence[float], ok: Sequence[bool], window_s: float
) -> list[dict[str, Any]]:
    """One row per second by send time: requests, errors, p50/p99/max ms of successes.

    Covers the window, and beyond it when requests were sent late (an overloaded open loop).
    """
    n_seconds = max(1, math.ceil(max([window_s, *start_s]) - 1e-9))
    buckets: list[list[float]] = [[] for _ in range(n_seconds)]
    errors = [0] * n_seconds
    requests = [0] * n_seconds
    for t, ms, good in zip(start_s, latency_ms, ok, strict=True):
        i = min(max(int(t), 0), n_seconds - 1)
        requests[i] += 1
        if good:
            buckets[i].append(ms)
        else:
            errors[i] += 1
    rows = []
    for i, lat in enumerate(buckets):
        lat.sort()
        rows.append(
            {
                "second": i,
                "requests": requests[i],
                "errors": errors[i],
                "p50_ms": percentile(lat, 50),
                "p99_ms": percentile(lat, 99),
                "max_ms": lat[-1] if lat else None,
            }
        )
    return rows


# --- the report ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Where the load came from: cores, CPU model, OS, Python."""
    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "hostname": platform.node(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


@dataclass
class LoadTestReport:
    """The outcome of one run; the measured window only (warmup excluded).

    ``requests``: requests whose slot fell in the window (closed loop: sent in it), all answered
    or failed. ``achieved_qps``: responses completed per second of the window. ``sent_qps``:
    requests put on the wire per second of the window. Latencies are of successful requests, from
    send to full response.
    """

    config: LoadTestConfig
    started_at: str
    machine: dict[str, Any]
    versions: dict[str, str]
    users: int
    window_s: float
    requests: int
    errors: int
    errors_by_kind: dict[str, int]
    errors_by_message: dict[str, int]
    achieved_qps: float
    sent_qps: float
    latency_ms: dict[str, float | None]
    warmup_requests: int = 0
    warmup_errors: int = 0
    aborted_requests: int = 0
    late_starts: int = 0
    unsent_slots: int = 0
    schedule_lag_ms: dict[str, float | None] | None = None
    client_cpu_percent: float = 0.0
    client_exceptions: dict[str, int] = field(default_factory=dict)
    locust_stats: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list, repr=False)
    histogram: dict[str, list[float]] = field(default_factory=dict, repr=False)
    samples: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    @property
    def target_qps(self) -> float | None:
        return self.config.qps

    @property
    def successes(self) -> int:
        return self.requests - self.errors

    @property
    def rate_honoured(self) -> bool | None:
        """Open loop: achieved QPS within 5 % of the target; None in closed loop."""
        if self.target_qps is None:
            return None
        return abs(self.achieved_qps - self.target_qps) <= 0.05 * self.target_qps

    def problem(self) -> str | None:
        """A one-line reason this run should count as failed, or None."""
        target = self.config.url
        if self.requests == 0:
            return f"no request completed against {target} in {self.window_s:.1f} s"
        if self.errors == self.requests:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.errors_by_kind.items()))
            return f"all {self.requests} requests to {target} failed ({kinds}); is the service running there?"
        if self.errors:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.errors_by_kind.items()))
            return f"{self.errors} of {self.requests} requests to {target} failed ({kinds})"
        if self.aborted_requests:
            return f"{self.aborted_requests} requests were still in flight at the hard stop"
        if self.client_exceptions:
            first = next(iter(self.client_exceptions))
            return f"the load generator raised {sum(self.client_exceptions.values())} exceptions: {first}"
        return None

    def warnings(self) -> list[str]:
        out = []
        if self.rate_honoured is False:
            out.append(
                f"target rate not reached: {self.achieved_qps:.1f} of {self.target_qps:g} QPS "
                f"({self.late_starts} late starts, {self.unsent_slots} slots unsent); the server is "
                "saturated or --users is too small"
            )
        elif self.requests and self.late_starts > 0.05 * self.requests:
            out.append(
                f"{self.late_starts} of {self.requests} requests started more than {LATE_START_MS:g} ms "
                "after their slot (no free user, or a busy load generator): latencies understate what "
                "arrivals on time would have seen"
            )
        if self.client_cpu_percent >= 90 and self.successes:
            out.append(
                f"the load generator used {self.client_cpu_percent:.0f}% of a core: the tool, not the "
                "server, may be the bottleneck"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        d["target_qps"] = self.target_qps
        d["rate_honoured"] = self.rate_honoured
        d["problem"] = self.problem()
        d["warnings"] = self.warnings()
        return d

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return p


def write_latency_png(report: LoadTestReport, path: str | os.PathLike[str]) -> Path:
    """Latency over time (p50/p99 per second, with requests/s) and the latency histogram.

    Uses matplotlib's object API with the Agg canvas, so the caller's pyplot backend is untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_h = fig.subplots(2, 1)
    seconds = [row["second"] + 0.5 for row in report.timeline]
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max")):
        xs = [s for s, row in zip(seconds, report.timeline, strict=True) if row[key] is not None]
        ys = [row[key] for row in report.timeline if row[key] is not None]
        ax_t.plot(xs, ys, marker="o", markersize=3, label=label, alpha=0.5 if key == "max_ms" else 1.0)
    ax_t.set_xlabel("time since start of measurement (s)")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_ylim(bottom=0)
    ax_t.grid(alpha=0.3)
    ax_r = ax_t.twinx()
    sent = [row["requests"] for row in report.timeline]
    ax_r.bar(seconds, sent, width=0.9, color="grey", alpha=0.2, label="requests sent")
    ax_r.set_ylabel("requests sent per second")
    ax_r.set_ylim(0, max([*sent, 1]) * 1.3)
    # Lines over the bars: the twin axes would otherwise be drawn on top.
    ax_t.set_zorder(ax_r.get_zorder() + 1)
    ax_t.patch.set_visible(False)
    lines, labels = ax_t.get_legend_handles_labels()
    lines2, labels2 = ax_r.get_legend_handles_labels()
    ax_t.legend(lines + lines2, labels + labels2, loc="best", fontsize="small")

    edges, counts = report.histogram.get("edges_ms", []), report.histogram.get("counts", [])
    if counts:
        widths = [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]
        ax_h.bar(edges[:-1], counts, width=widths, align="edge", edgecolor="black", linewidth=0.3)
        ax_h.set_xscale("log")
        ax_h.xaxis.set_major_formatter(ScalarFormatter())
        ax_h.xaxis.set_minor_formatter(ScalarFormatter())
        ax_h.tick_params(axis="x", which="minor", labelsize="x-small")
        for key, style in (("p50", "--"), ("p99", ":")):
            value = report.latency_ms.get(key)
            if value is not None:
                ax_h.axvline(value, color="red", linestyle=style, label=f"{key} {value:.1f} ms")
        ax_h.legend(fontsize="small")
    else:
        ax_h.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax_h.transAxes)
    ax_h.set_xlabel("latency (ms, log scale), successful requests")
    ax_h.set_ylabel("requests")
    ax_h.grid(alpha=0.3)

    cfg = report.config
    load = f"{cfg.concurrency} concurrent" if cfg.concurrency is not None else f"{cfg.qps:g} QPS target"
    fig.suptitle(
        f"{'gRPC' if cfg.grpc else 'HTTP'} {cfg.url} — {load}, {report.achieved_qps:.1f} QPS achieved, "
        f"{report.requests} requests, {report.errors} errors",
        fontsize="medium",
    )
    p = Path(path)
    fig.savefig(p, dpi=100)
    return p


def build_report(config: LoadTestConfig, raw: dict[str, Any], started_at: str) -> LoadTestReport:
    """Turn the child's per-request records into a :class:`LoadTestReport`."""
    rec = raw["records"]
    warmup_s = config.warmup_s
    measured = [i for i, w in enumerate(rec["warmup"]) if not w]
    warm = len(rec["warmup"]) - len(measured)
    start_s = [round(rec["sent"][i] - warmup_s, 6) for i in measured]
    latency = [round(rec["ms"][i], 3) for i in measured]
    kinds = [rec["kind"][i] for i in measured]
    ok = [k is None for k in kinds]
    success_latency = [ms for ms, good in zip(latency, ok, strict=True) if good]
    window_s = float(raw["window_s"])
    # Throughput counts responses completed inside the window, as Locust's RPS does; in an open
    # loop that the server cannot keep up with, it falls below the target while `sent` does not.
    completed = sum(warmup_s <= d < warmup_s + window_s for d in rec["done"])
    sent = sum(warmup_s <= t < warmup_s + window_s for t in rec["sent"])
    lags = sorted(raw.get("schedule_lag_ms") or [])
    return LoadTestReport(
        config=config,
        started_at=started_at,
        machine=machine_info(),
        versions=raw.get("versions", {}),
        users=int(raw["users"]),
        window_s=window_s,
        requests=len(measured),
        errors=sum(not g for g in ok),
        errors_by_kind=dict(Counter(k for k in kinds if k is not None).most_common()),
        errors_by_message=dict(sorted(raw.get("errors_by_message", {}).items(), key=lambda kv: -kv[1])),
        achieved_qps=completed / window_s,
        sent_qps=sent / window_s,
        latency_ms=latency_summary(success_latency),
        warmup_requests=warm,
        warmup_errors=sum(1 for i, w in enumerate(rec["warmup"]) if w and rec["kind"][i] is not None),
        aborted_requests=int(raw.get("aborted", 0)),
        late_starts=int(raw.get("late_starts", 0)),
        unsent_slots=int(raw.get("unsent_slots", 0)),
        schedule_lag_ms=(
            {"p50": percentile(lags, 50), "p99": percentile(lags, 99), "max": lags[-1] if lags else None}
            if config.qps is not None
            else None
        ),
        client_cpu_percent=round(float(raw.get("cpu_percent", 0.0)), 1),
        client_exceptions=raw.get("client_exceptions", {}),
        locust_stats=raw.get("locust", {}),
        timeline=per_second_timeline(start_s, latency, ok, window_s),
        histogram=log_histogram(success_latency),
        samples={"start_s": start_s, "latency_ms": latency, "error_kind": kinds},
    )


# --- running ---------------------------------------------------------------------------------

# The child patches the standard library before anything else is imported, then loads this file
# by path (not as `services.retrieval.loadtest`) so that no package __init__ runs unpatched.
_CHILD_BOOTSTRAP = """\
from gevent import monkey
monkey.patch_all()
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_bcstack_loadtest_child", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module._child_main(sys.argv[2], sys.argv[3])
"""


def hard_limit_s(config: LoadTestConfig) -> float:
    """Wall time after which the caller kills the load generator."""
    return config.warmup_s + config.duration_s + config.timeout_s + 1.0 + STARTUP_ALLOWANCE_S


def run_loadtest(config: LoadTestConfig) -> LoadTestReport:
    """Run one load test in a Locust subprocess and return its report.

    Safe to call from any program (no gevent patching here). Progress lines go to stderr when
    ``config.progress``. Failed requests are in the report, not raised; :class:`LoadTestError` is
    raised only when the load generator itself fails or overruns its hard limit.
    """
    repo_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    env.pop("LOCUST_SKIP_MONKEY_PATCH", None)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="bcstack-loadtest-") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps({"config": config.to_dict()}), encoding="utf-8")
        this_file = str(Path(__file__).resolve())
        cmd = [sys.executable, "-c", _CHILD_BOOTSTRAP, this_file, str(spec_path), str(result_path)]
        tail: deque[str] = deque(maxlen=20)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                tail.append(line.rstrip())
                if config.progress:
                    sys.stderr.write(line)
                    sys.stderr.flush()

        reader = threading.Thread(target=pump, name="loadtest-stderr", daemon=True)
        reader.start()
        limit = hard_limit_s(config)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise LoadTestError(
                f"the load generator did not stop within {limit:.0f} s and was killed"
            ) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join(timeout=5)
        if rc != 0 or not result_path.exists():
            last = next((line for line in reversed(tail) if line.strip()), "no output")
            raise LoadTestError(f"the load generator exited with status {rc}: {last}")
        raw = json.loads(result_path.read_text(encoding="utf-8"))
    return build_report(config, raw, started_at)


# --- the child: runs under gevent, drives Locust -----------------------------------------------


def _error_kind(exc: BaseException) -> str:
    """A short, stable name for a failure, used to group errors."""
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.RpcError: code() is a grpc.StatusCode
        try:
            return f"grpc_{code().name.lower()}"
        except Exception:
            return "grpc_error"
    text = str(exc)
    if text.startswith("HTTP ") and text[5:8].isdigit():
        return f"http_{text[5:8]}"
    if text.startswith("bad response"):
        return "bad_response"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "connection_reset"
    if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
        return "timeout"
    if isinstance(exc, OSError):
        return "connection"
    return type(exc).__name__


def _error_message(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):  # grpc.RpcError
        try:
            return f"{_error_kind(exc)}: {details()}"[:300]
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"[:300]


class _RunState:
    """Shared by all users of the child (greenlets in one thread: no locks needed)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import gevent.event

        self.cfg = cfg
        self.go = gevent.event.Event()
        self.t0 = 0.0
        self.measure_from = cfg["warmup_s"]
        self.end = cfg["warmup_s"] + cfg["duration_s"]
        self.queries = cfg["queries"]
        self.next_query = 0
        self.next_slot = 0
        self.started = 0
        self.pending = 0  # claimed requests not yet answered (some may wait for their slot)
        self.sending = 0  # requests on the wire
        self.exhausted = False  # max_requests reached
        self.late_starts = 0
        self.lag_ms: list[float] = []
        self.t: list[float] = []  # slot: decides the phase (warmup or measured)
        self.sent: list[float] = []  # actual send time (later than the slot for a late start)
        self.done: list[float] = []  # completion time
        self.ms: list[float] = []
        self.warmup: list[bool] = []
        self.kind: list[str | None] = []
        self.messages: Counter[str] = Counter()
        self.client_exceptions: Counter[str] = Counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def query(self) -> str:
        q = self.queries[self.next_query % len(self.queries)]
        self.next_query += 1
        return q

    def begin(self) -> float | None:
        """Claim the next request; return its send offset (s), or None once the run is over.

        Closed loop: now. Open loop: the next slot of the schedule, which may be in the future
        (the caller sleeps until then) or in the past (sent late). Nothing starts once the window
        has ended, so slots still unsent then are dropped (counted by :meth:`unsent_slots`).
        """
        limit = self.cfg["max_requests"]
        now = self.now()
        if now >= self.end or self.exhausted or (limit is not None and self.started >= limit):
            return None
        qps = self.cfg["qps"]
        if qps is None:
            at = now
        else:
            at = self.next_slot / qps
            if at >= self.end:
                return None
            self.next_slot += 1
        self.started += 1
        self.pending += 1
        if limit is not None and self.started >= limit:
            self.exhausted = True
        return at

    def unsent_slots(self, window_end: float) -> int:
        """Open loop: slots of the measured window that no user took before it ended."""
        qps = self.cfg["qps"]
        if qps is None:
            return 0
        scheduled = math.ceil(window_end * qps - 1e-9) - math.ceil(self.measure_from * qps - 1e-9)
        taken = max(0, self.next_slot - math.ceil(self.measure_from * qps - 1e-9))
        return max(0, scheduled - taken)

    def record(self, slot: float, ms: float, exc: BaseException | None) -> None:
        """One answered (or failed) request: its claimed slot, latency, outcome; now = completion."""
        done = self.now()
        self.t.append(slot)
        self.sent.append(round(done - ms / 1000.0, 6))
        self.done.append(round(done, 6))
        self.ms.append(ms)
        warm = slot < self.measure_from
        self.warmup.append(warm)
        if exc is None:
            self.kind.append(None)
        else:
            self.kind.append(_error_kind(exc))
            if not warm:
                self.messages[_error_message(exc)] += 1


@contextmanager
def _claimed_request(state: _RunState) -> Iterator[float | None]:
    """Claim the next request, wait for its slot; yields its send offset (s), or None when over.

    ``state.pending`` covers the whole claim, so the end-of-run drain also waits for users that
    claimed a slot just before the deadline and are still sleeping towards it.
    """
    import gevent

    at = state.begin()
    if at is None:
        yield None
        return
    try:
        delay = at - state.now()
        if delay > 0:
            gevent.sleep(delay)
        if state.cfg["qps"] is not None and at >= state.measure_from:
            lag_ms = max(0.0, (state.now() - at) * 1000.0)
            state.lag_ms.append(round(lag_ms, 3))
            if lag_ms > LATE_START_MS:
                state.late_starts += 1
        state.sending += 1
        try:
            yield at
        finally:
            state.sending -= 1
    finally:
        state.pending -= 1


def _idle_until_stopped(state: _RunState) -> None:
    import gevent

    gevent.sleep(state.cfg["timeout_s"] + 5.0)


def _http_user(state: _RunState) -> type:
    import json as _json

    from locust import FastHttpUser, constant, task

    cfg = state.cfg
    host, path = cfg["host"], cfg["path"]

    class SearchHttpUser(FastHttpUser):
        wait_time = constant(0)
        network_timeout = cfg["timeout_s"]
        connection_timeout = cfg["timeout_s"]
        max_retries = 0

        @task
        def search(self) -> None:
            state.go.wait()
            with _claimed_request(state) as at:
                if at is None:
                    _idle_until_stopped(state)
                    return
                body = {"query": state.query(), "k": cfg["k"]}
                with self.client.post(
                    path, json=body, name="/search", catch_response=True, context={"sent_at": at}
                ) as resp:
                    # Nothing in here may raise: an exception leaving this block would skip
                    # Locust's request event and leave a request the server saw uncounted.
                    error = getattr(resp, "error", None)
                    try:
                        if resp.status_code and resp.status_code != 200:
                            # Before `error`: geventhttpclient sets one for non-2xx answers too.
                            text = (resp.text or "").strip().replace("\n", " ")
                            resp.failure(f"HTTP {resp.status_code}: {text[:200]}")
                        elif error is not None or not resp.status_code:
                            resp.failure(error or ConnectionError("no response"))
                        elif isinstance(_json.loads(resp.content).get("results"), list):
                            resp.success()
                        else:
                            resp.failure('bad response: no "results" list in the JSON body')
                    except Exception as exc:
                        resp.failure(f"bad response: {type(exc).__name__}: {exc}")

    SearchHttpUser.host = host
    return SearchHttpUser


def _grpc_user(state: _RunState) -> type:
    import grpc
    from locust import User, constant, task

    from core.v1 import retrieval_pb2, retrieval_pb2_grpc

    cfg = state.cfg
    mode = {
        "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
        "lexical": retrieval_pb2.SEARCH_MODE_LEXICAL,
        "dense": retrieval_pb2.SEARCH_MODE_DENSE,
    }[cfg["mode"]]
    # One channel for all users: gRPC multiplexes calls over one HTTP/2 connection, and channels
    # to the same target would share it through the global subchannel pool anyway.
    channel = grpc.insecure_channel(cfg["host"])
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)

    class SearchGrpcUser(User):
        wait_time = constant(0)

        @task
        def search(self) -> None:
            state.go.wait()
            with _claimed_request(state) as at:
                if at is None:
                    _idle_until_stopped(state)
                    return
                request = retrieval_pb2.SearchRequest(query=state.query(), k=cfg["k"], mode=mode)
                start_wall, start = time.time(), time.perf_counter()
                exc: BaseException | None = None
                length = 0
                try:
                    length = stub.Search(request, timeout=cfg["timeout_s"]).ByteSize()
                except Exception as e:  # grpc.RpcError mostly; anything else must be counted too
                    exc = e
                self.environment.events.request.fire(
                    request_type="grpc",
                    name="Search",
                    response_time=(time.perf_counter() - start) * 1000.0,
                    response_length=length,
                    exception=exc,
                    context={"sent_at": at},
                    start_time=start_wall,
                    url=cfg["host"],
                )

    return SearchGrpcUser


class _FirstFewPerMessage:
    """Logging filter: each distinct message at most 3 times (Locust logs every task exception)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def filter(self, record: Any) -> bool:
        key = str(record.msg)[:200]
        self.seen[key] += 1
        return self.seen[key] <= 3


def _child_main(spec_path: str, result_path: str) -> None:  # pragma: no cover - runs in the child
    import logging

    import gevent

    # gevent's patch ran first (see _CHILD_BOOTSTRAP); importing locust repeats it harmlessly.
    import locust
    from locust.env import Environment

    logging.basicConfig(level=logging.WARNING, format="[loadtest] locust %(levelname)s: %(message)s")
    logging.getLogger().handlers[0].addFilter(_FirstFewPerMessage())
    cfg = json.loads(Path(spec_path).read_text(encoding="utf-8"))["config"]
    config = LoadTestConfig(**{k: v for k, v in cfg.items() if k not in ("mode_name", "user_count")})
    cfg["host"], cfg["path"] = config.target()
    versions = {"locust": locust.__version__, "gevent": gevent.__version__}
    if cfg["grpc"]:
        import grpc
        from grpc.experimental import gevent as grpc_gevent

        grpc_gevent.init_gevent()  # after the stdlib patch, before any channel exists
        versions["grpcio"] = grpc.__version__

    state = _RunState(cfg)
    user_class = _grpc_user(state) if cfg["grpc"] else _http_user(state)
    env = Environment(user_classes=[user_class], catch_exceptions=True)

    def on_request(response_time: float, exception: BaseException | None, context: dict, **_: Any) -> None:
        state.record(context.get("sent_at", state.now()), float(response_time), exception)

    def on_user_error(exception: BaseException, **_: Any) -> None:
        state.client_exceptions[_error_message(exception)] += 1

    env.events.request.add_listener(on_request)
    env.events.user_error.add_listener(on_user_error)
    spawned = gevent.event.Event()
    env.events.spawning_complete.add_listener(lambda **_: spawned.set())

    users = config.user_count
    runner = env.create_local_runner()
    # Users wait on `go` until all exist, so spawning them all at once creates no burst; Locust's
    # warning about spawn rates above 100/s is about bursts and is muted for this call.
    runners_log = logging.getLogger("locust.runners")
    level = runners_log.level
    runners_log.setLevel(logging.ERROR)
    runner.start(users, spawn_rate=users)
    runners_log.setLevel(level)
    if not spawned.wait(timeout=STARTUP_ALLOWANCE_S / 2):
        runner.quit()
        sys.stderr.write(f"[loadtest] could not spawn {users} users\n")
        os._exit(3)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    state.t0 = time.perf_counter()
    state.go.set()
    progress = gevent.spawn(_progress_loop, state) if cfg["progress"] else None
    while state.now() < state.end and not (state.exhausted and state.pending == 0):
        gevent.sleep(min(0.05, max(0.0, state.end - state.now())))
    stopped_at = min(state.now(), state.end)
    # Let what was sent finish (each request has its own timeout), then stop hard.
    grace_until = state.now() + cfg["timeout_s"] + 1.0
    while state.pending > 0 and state.now() < grace_until:
        gevent.sleep(0.01)
    aborted = state.pending
    if progress is not None:
        progress.kill()
    runner.quit()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0

    total = env.stats.total
    result = {
        "versions": versions,
        "users": users,
        "window_s": max(1e-6, stopped_at - state.measure_from),
        "records": {
            "t": state.t,
            "sent": state.sent,
            "done": state.done,
            "ms": state.ms,
            "warmup": state.warmup,
            "kind": state.kind,
        },
        "errors_by_message": dict(state.messages),
        "client_exceptions": dict(state.client_exceptions),
        "late_starts": state.late_starts,
        "schedule_lag_ms": state.lag_ms,
        "aborted": aborted,
        "unsent_slots": state.unsent_slots(stopped_at),
        "cpu_percent": 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0,
        "locust": {
            "requests": total.num_requests,
            "failures": total.num_failures,
            "median_ms": total.median_response_time if total.num_requests else None,
            "p99_ms": total.get_response_time_percentile(0.99) if total.num_requests else None,
        },
    }
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
    sys.stderr.flush()
    # Skip interpreter teardown: gRPC's gevent integration can block on shutdown with live channels.
    os._exit(0)


def _progress_loop(state: _RunState) -> None:  # pragma: no cover - runs in the child
    import gevent

    seen = 0
    total = state.cfg["warmup_s"] + state.cfg["duration_s"]
    while True:
        gevent.sleep(1.0)
        now = state.now()
        new_ms = sorted(ms for ms, k in zip(state.ms[seen:], state.kind[seen:], strict=True) if k is None)
        done = len(state.ms)
        errors = sum(k is not None for k in state.kind)
        p50 = percentile(new_ms, 50)
        phase = "warmup " if now < state.measure_from else ""
        sys.stderr.write(
            f"[loadtest] {phase}{min(now, total):5.1f}/{total:g} s  {done - seen:6d} req/s  "
            f"p50 {'-' if p50 is None else f'{p50:.1f}'} ms  errors {errors}  in flight {state.sending}\n"
        )
        sys.stderr.flush()
        seen = done
