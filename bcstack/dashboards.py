"""The Grafana dashboards the chart ships (issue 17), built with the Grafana Foundation SDK.

    python -m bcstack.dashboards [--out charts/bcstack/dashboards]      (or `make dashboards`)

writes one JSON file per dashboard; the chart turns each into a ConfigMap for Grafana's dashboard
sidecar (`metrics.dashboards.enabled`). The files are generated, committed, and checked to be
current by the tests, like the gRPC stubs; tests/test_dashboards.py also parses every query with
promql-parser and checks, on the live stack, that every metric a panel names is exported.

Every query reads a `datasource` variable (any Prometheus) and filters by a `namespace` variable,
so one Grafana can hold several releases. The recording rules of the chart's PrometheusRule
(`job_stop_reason:bcstack_worker_episodes:ratio`, ...) are used where an alert reads the same
ratio, so a dashboard and its alert never disagree. `$__rate_interval` is Grafana's own window
(at least four scrape intervals).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as md

OUT = Path(__file__).resolve().parents[1] / "charts" / "bcstack" / "dashboards"
DATASOURCE = md.DataSourceRef(type_val="prometheus", uid="${datasource}")
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"


@dataclass
class Query:
    expr: str
    legend: str = ""


@dataclass
class Panel:
    title: str
    queries: list[Query]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 12


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Query]:
    """p50/p90/p99 of a histogram over Grafana's rate window, per `by` (and job)."""
    group = f"job, le{', ' + by if by else ''}"
    legend = "{{job}} " + (f"{{{{{by}}}}} " if by else "")
    return [
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{NS}}}[{RATE}])))",
            f"{legend}p{int(q * 100)}",
        )
        for q in qs
    ]


def per_second(metric: str, by: str) -> Query:
    """A counter's rate summed by the labels `by` ("tool, outcome"), one legend entry per value."""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Query(f"sum by ({by}) (rate({metric}{{{NS}}}[{RATE}]))", legend)


def series(metric: str, legend: str = "{{job}}", matchers: str = "") -> Query:
    """A gauge or a recording rule as it is, in the selected namespaces."""
    return Query(f"{metric}{{{NS}{', ' + matchers if matchers else ''}}}", legend)


def limit(name: str) -> Query:
    """The configured worker limit, drawn as a line beside what the episodes used."""
    return Query(f'max(bcstack_worker_limit{{{NS}, limit="{name}"}})', f"limit ({name})")


Rows = list[tuple[str, list[Panel]]]

OVERVIEW: Rows = [
    (
        "Episodes",
        [
            Panel(
                "Coordinator episodes per second by status",
                [
                    Query(
                        f"sum by (status) (job_status:bcstack_coordinator_episodes:rate{{{NS}}})",
                        "{{status}}",
                    )
                ],
                "reqps",
            ),
            Panel(
                "Accuracy of graded episodes",
                [series("job:bcstack_judge_answer_accuracy:ratio")],
                "percentunit",
                "Judged correct / judged (parse errors and ungraded answers left out).",
            ),
            Panel(
                "Worker stop reasons (share of episodes)",
                [series("job_stop_reason:bcstack_worker_episodes:ratio", "{{stop_reason}}")],
                "percentunit",
            ),
            Panel(
                "Episodes running now",
                [
                    Query(f"sum(bcstack_coordinator_active_episodes{{{NS}}})", "coordinator"),
                    Query(f"sum(bcstack_worker_active_episodes{{{NS}}})", "worker"),
                ],
            ),
            Panel(
                "Targets up",
                [Query(f'sum by (job) (up{{{NS}, job=~".*bcstack.*"}})', "{{job}}")],
                kind="stat",
                width=24,
            ),
        ],
    )
]

WORKER_BUDGETS: Rows = [
    (
        "Budgets (seed 001: 24,576 tokens, 40 turns, 4,096 generated tokens per turn)",
        [
            Panel(
                "Tokens per worker episode",
                [*quantiles("bcstack_worker_episode_tokens"), limit("max_tokens")],
                description="Every token of the trajectory: prompt, generations, observations.",
            ),
            Panel(
                "Assistant turns per worker episode",
                [*quantiles("bcstack_worker_episode_turns"), limit("max_turns")],
            ),
            Panel(
                "Generated tokens per turn",
                [*quantiles("bcstack_worker_turn_generated_tokens"), limit("max_new_tokens_per_turn")],
            ),
            Panel(
                "Episodes ending at a limit (share)",
                [
                    series(
                        "job_stop_reason:bcstack_worker_episodes:ratio",
                        "{{stop_reason}}",
                        'stop_reason=~"budget|turns|context"',
                    )
                ],
                "percentunit",
            ),
        ],
    ),
    (
        "Tools and time",
        [
            Panel(
                "Tool calls per second by outcome",
                [per_second("bcstack_worker_tool_calls_total", "tool, outcome")],
                "reqps",
            ),
            Panel(
                "Turn time",
                [
                    *quantiles("bcstack_worker_turn_duration_seconds", qs=(0.5, 0.99)),
                    series("job:bcstack_worker_turn_duration_seconds:p90_baseline", "{{job}} p90 baseline"),
                ],
                "s",
            ),
            Panel(
                "Episodes ended by failures per second",
                [per_second("bcstack_worker_engine_errors_total", "kind")],
                "reqps",
            ),
            Panel("Engine request time", quantiles("bcstack_worker_engine_request_duration_seconds"), "s"),
        ],
    ),
]

RETRIEVAL: Rows = [
    (
        "Retrieval",
        [
            Panel(
                "Searches per second",
                [per_second("bcstack_retrieval_searches_total", "mode, outcome")],
                "reqps",
            ),
            Panel(
                "Latency by stage (p90)",
                quantiles("bcstack_retrieval_stage_seconds", "stage", (0.9,)),
                "s",
            ),
            Panel(
                "Degraded share of searches",
                [series("job:bcstack_retrieval_searches_degraded:ratio")],
                "percentunit",
                "A backend failed and the other answered alone.",
            ),
            Panel(
                "Backend failures per second",
                [per_second("bcstack_retrieval_backend_failures_total", "backend, kind")],
                "reqps",
            ),
            Panel("open_page per second", [per_second("bcstack_retrieval_opens_total", "outcome")], "reqps"),
            Panel(
                "Documents served",
                [Query(f"max by (job) (bcstack_retrieval_documents{{{NS}}})", "{{job}}")],
                kind="stat",
            ),
        ],
    )
]

COORDINATOR: Rows = [
    (
        "Coordinator LLM endpoints",
        [
            Panel(
                "Endpoint in use",
                [Query(f"max by (name) (bcstack_coordinator_active_endpoint_info{{{NS}}})", "{{name}}")],
                kind="stat",
                width=6,
            ),
            Panel(
                "Endpoint swaps",
                [
                    Query(
                        f"sum(increase(bcstack_coordinator_endpoint_swaps_total{{{NS}}}[$__range]))", "swaps"
                    )
                ],
                kind="stat",
                width=6,
            ),
            Panel(
                "Circuit breaker state",
                [
                    Query(
                        f"max by (endpoint, state) (bcstack_coordinator_breaker_state{{{NS}}}) == 1",
                        "{{endpoint}} {{state}}",
                    )
                ],
                description="One series per endpoint, on its current state.",
            ),
            Panel(
                "Upstream latency",
                quantiles("bcstack_coordinator_upstream_request_duration_seconds", "endpoint", (0.5, 0.99)),
                "s",
            ),
            Panel(
                "Upstream 429/5xx share",
                [series("job_endpoint:bcstack_coordinator_upstream_errors:ratio", "{{endpoint}}")],
                "percentunit",
            ),
            Panel(
                "Upstream retries per second",
                [per_second("bcstack_coordinator_upstream_retries_total", "endpoint, kind")],
                "reqps",
            ),
            Panel(
                "Worker branches per second by outcome",
                [per_second("bcstack_coordinator_branches_total", "status")],
                "reqps",
            ),
            Panel(
                "Record write time (p99)",
                [series("job:bcstack_coordinator_record_write_duration_seconds:p99")],
                "s",
            ),
        ],
    )
]

JUDGE: Rows = [
    (
        "Judge",
        [
            Panel(
                "Verdicts per second",
                [per_second("bcstack_judge_verdicts_total", "grader, outcome")],
                "reqps",
            ),
            Panel(
                "Cache hit rate",
                [series("job_grader:bcstack_judge_cache_hits:ratio", "{{grader}}")],
                "percentunit",
                "Hits and coalesced requests / LLM-graded requests.",
            ),
            Panel(
                "Parse errors (share of verdicts)",
                [series("job_grader:bcstack_judge_parse_errors:ratio", "{{grader}}")],
                "percentunit",
            ),
            Panel(
                "Unavailable (503) per second",
                [per_second("bcstack_judge_unavailable_total", "grader")],
                "reqps",
            ),
            Panel("Grader latency", quantiles("bcstack_judge_upstream_request_duration_seconds"), "s"),
        ],
    )
]


def _increase(metric: str, legend: str) -> Query:
    return Query(f"increase({metric}{{{NS}}}[{RATE}])", legend)


TRAINING: Rows = [
    (
        "RL (bcstack train rl)",
        [
            Panel("Reward (mean over graded episodes)", [series("bcstack_trainer_reward_mean")]),
            Panel("Accuracy of the update's episodes", [series("bcstack_trainer_accuracy")], "percentunit"),
            Panel("KL to the reference (k3)", [series("bcstack_trainer_kl")]),
            Panel("Largest policy lag trained on", [series("bcstack_trainer_policy_lag_max")]),
            Panel(
                "Tokens per second",
                [
                    series("bcstack_trainer_rollout_tokens_per_second", "rollout"),
                    series("bcstack_trainer_train_tokens_per_second", "train"),
                ],
            ),
            Panel(
                "Reload and export time",
                [
                    series("bcstack_trainer_reload_seconds", "rolling reload (trainer)"),
                    series("bcstack_trainer_export_seconds", "export"),
                    *quantiles("bcstack_worker_reload_duration_seconds", qs=(0.9,)),
                ],
                "s",
            ),
            Panel(
                "Updates and time since the last one",
                [
                    series("bcstack_trainer_update", "update"),
                    Query(f"time() - bcstack_trainer_last_update_timestamp_seconds{{{NS}}}", "seconds since"),
                ],
                kind="stat",
            ),
            Panel(
                "Canary reloads by step and outcome (bcstack worker reload --canary)",
                [
                    Query(
                        "sum by (step, outcome) "
                        f"(increase(bcstack_worker_canary_reloads_total{{{NS}}}[{RATE}]))",
                        "{{step}} {{outcome}}",
                    )
                ],
            ),
            Panel(
                "Groups dropped or excluded per update",
                [
                    _increase("bcstack_trainer_dropped_stale_total", "stale"),
                    _increase("bcstack_trainer_excluded_episodes_total", "ungraded episodes"),
                    _increase("bcstack_trainer_zero_variance_groups_total", "zero-variance"),
                ],
            ),
        ],
    )
]

# uid -> (title, rows)
DASHBOARDS: dict[str, tuple[str, Rows]] = {
    "bcstack-overview": ("bcstack / Overview", OVERVIEW),
    "bcstack-worker-budgets": ("bcstack / Worker budgets", WORKER_BUDGETS),
    "bcstack-retrieval": ("bcstack / Retrieval", RETRIEVAL),
    "bcstack-coordinator": ("bcstack / Coordinator", COORDINATOR),
    "bcstack-judge": ("bcstack / Judge", JUDGE),
    "bcstack-training": ("bcstack / Training", TRAINING),
}


def _panel(p: Panel, panel_id: int) -> gt.Panel | gs.Panel:
    built = gt.Panel() if p.kind == "timeseries" else gs.Panel()
    built = built.id(panel_id).title(p.title).unit(p.unit).datasource(DATASOURCE).span(p.width)
    if p.description:
        built = built.description(p.description)
    for i, q in enumerate(p.queries):
        built = built.with_target(
            gp.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        )
    return built


def build(uid: str) -> dict:
    """One dashboard as Grafana's JSON model."""
    title, rows = DASHBOARDS[uid]
    board = (
        gd.Dashboard(title)
        .uid(uid)
        .tags(["bcstack"])
        .refresh("30s")
        .time("now-3h", "now")
        .editable()
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            gd.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            .query("label_values(up, namespace)")
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    )
    panel_id = 1
    for row_title, panels in rows:
        board = board.with_row(gd.Row(row_title).id(panel_id))
        panel_id += 1
        for p in panels:
            board = board.with_panel(_panel(p, panel_id))
            panel_id += 1
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def render_all() -> dict[str, str]:
    """{file name: JSON text} of every dashboard."""
    return {f"{uid}.json": json.dumps(build(uid), indent=2, sort_keys=True) + "\n" for uid in DASHBOARDS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bcstack.dashboards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the JSON files (default {OUT})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = render_all()
    for name, text in files.items():
        (args.out / name).write_text(text)
    for stale in set(p.name for p in args.out.glob("*.json")) - set(files):
        (args.out / stale).unlink()
    print(f"wrote {len(files)} dashboards to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
