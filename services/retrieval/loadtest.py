"""Load tests against the retrieval service: `bcstack loadtest retrieval` and `run_loadtest()`.

The load comes from Locust used as a library, in a child process
(:mod:`services.retrieval.loadtest_locust`: HTTP ``FastHttpUser`` and gRPC users as gevent
greenlets). This module holds the rest: the run's configuration, starting and bounding the
child, and turning its per-request records into statistics, report.json and latency.png.

Why a subprocess. Importing ``locust`` runs ``gevent.monkey.patch_all()`` on the importing
process, which would break any asyncio / ``grpc.aio`` code of a caller. So this module imports
only the standard library at the top, and ``run_loadtest()`` starts a fresh interpreter that
patches first, then ``grpc.experimental.gevent.init_gevent()`` (gRPC's docs: after the standard
library is patched, before any gRPC object exists), then drives Locust. The child gets its
config as JSON and writes per-request records back as JSON; everything else (percentiles,
timeline, histogram, report.json, latency.png) is computed here, in the caller's process.

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
from collections import Counter, deque
from collections.abc import Sequence
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

# The child patches the standard library before anything else is imported, packages included.
_CHILD_BOOTSTRAP = """\
from gevent import monkey
monkey.patch_all()
import importlib, sys
importlib.import_module(sys.argv[1]).main(sys.argv[2], sys.argv[3])
"""
# Named, not imported: importing the child module here would patch the caller.
CHILD_MODULE = "services.retrieval.loadtest_locust"


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
        cmd = [sys.executable, "-c", _CHILD_BOOTSTRAP, CHILD_MODULE, str(spec_path), str(result_path)]
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
