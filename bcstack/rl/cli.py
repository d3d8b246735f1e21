"""`bcstack train rl`: the whole RL loop against a running stack (DESIGN.md §9)."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import os
from pathlib import Path

import typer
import yaml

from core.budget import MAX_TOKENS
from core.kit.cli import fail, need_model


def _load_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config FILE: a YAML mapping of settings, keyed by option name (`groups: 8`,
    `max-policy-lag: 1` or `max_policy_lag: 1`); it becomes the command's defaults, so flags given on
    the command line still win. An unknown key is an error with the closest name."""
    if value is None:
        return None
    try:
        data = yaml.safe_load(Path(value).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"{value}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value}: expected a mapping of option names to values")
    names = {
        opt.lstrip("-").replace("-", "_"): param.name
        for param in ctx.command.params
        for opt in [*param.opts, param.name or ""]
        if param.name not in (None, "config", "help")
    }
    defaults = {}
    for key, item in data.items():
        name = names.get(str(key).lstrip("-").replace("-", "_"))
        if name is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), list(names), 1)
            hint = f" (did you mean {close[0].replace('_', '-')}?)" if close else ""
            raise typer.BadParameter(f"{value}: unknown setting {key!r}{hint}")
        defaults[name] = ",".join(map(str, item)) if isinstance(item, list) else item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def rl(
    config: Path | None = typer.Option(
        None,
        "--config",
        is_eager=True,
        callback=_load_config,
        help="A YAML file of these settings, keyed by option name (e.g. `groups: 8`); flags given "
        "on the command line win.",
    ),
    state: Path | None = typer.Option(
        None,
        "--state",
        help="A `bcstack up` stack's folder: gateway, judge and workers come from its stack.json, the "
        "admin token from its admin-token file (flags given below win).",
    ),
    gateway: str | None = typer.Option(None, "--gateway", help="Coordinator gateway URL (http://host:port)."),
    judge: str | None = typer.Option(None, "--judge", help="Judge proxy URL (http://host:port)."),
    workers: str | None = typer.Option(
        None, "--workers", help="Worker replicas' HTTP URLs, comma-separated (their admin reload endpoint)."
    ),
    k8s_selector: str | None = typer.Option(
        None, "--k8s-selector", help="Find the worker replicas as running pods with this label selector."
    ),
    k8s_namespace: str | None = typer.Option(
        None, "--k8s-namespace", "-n", help="Namespace of the worker pods (with --k8s-selector)."
    ),
    k8s_port: int = typer.Option(8002, "--k8s-port", help="Worker pods' HTTP port (with --k8s-selector)."),
    questions: Path = typer.Option(
        ...,
        "--questions",
        help="Training questions: the toy world's train split, a FoldAgent/BrowseComp-Plus split "
        "(JSONL or Parquet; the evaluation loaders read it).",
    ),
    password: str | None = typer.Option(
        None, "--password", envvar="BCSTACK_EVAL_PASSWORD", help="Decrypts BrowseComp-Plus query files."
    ),
    model: Path = typer.Option(..., "--model", help="The policy to train (an HF folder)."),
    ref: Path = typer.Option(..., "--ref", help="The frozen KL reference (the SFT model), an HF folder."),
    out: Path = typer.Option(
        ...,
        "--out",
        help="Run folder: metrics.jsonl, updates.jsonl, checkpoints/, exports/u*/ (the workers reload "
        "from here, so they must see it: a shared volume, or --worker-checkpoint-root).",
    ),
    updates: int = typer.Option(1, "--updates", min=0, help="Train until the policy has this many updates."),
    max_minutes: float | None = typer.Option(
        None,
        "--max-minutes",
        help="Wall-clock limit of this process: no update starts after it (the last one is finished, "
        "exported and checkpointed, so --resume continues). --updates stays the most.",
    ),
    groups: int = typer.Option(8, "--groups", min=1, help="Question groups per update (seed 000: 8)."),
    group_size: int = typer.Option(8, "--group-size", min=1, help="Episodes per group (seed 000: 8)."),
    max_policy_lag: int = typer.Option(
        1,
        "--max-policy-lag",
        min=0,
        help="Staleness bound: rollouts continue while an update trains, at most this many policy "
        "versions behind; older groups are dropped and counted. 0 = synchronous.",
    ),
    lr: float = typer.Option(1e-6, "--lr", min=0.0, help="AdamW learning rate (seed 000: 1e-6)."),
    steps_per_update: int = typer.Option(
        1,
        "--steps-per-update",
        min=1,
        help="Optimizer steps per update: the update's groups split into this many mini-batches of "
        "whole groups, one step each, PPO-clipped against the policy that generated them (slime's "
        "--num-steps-per-rollout). 1: one step on the whole batch.",
    ),
    vector_lr_scale: float = typer.Option(
        1.0,
        "--vector-lr-scale",
        min=0.0,
        help="LR multiplier of the 1-D parameters (norm gains): Adam moves each weight by about the LR, "
        "so a gain near 1 moves far less, relative to itself, than a matrix entry; the ratio of their "
        "sizes evens that out (trainer/grpo.py make_optimizer). 1: one LR for all.",
    ),
    micro_batch_tokens: int = typer.Option(
        MAX_TOKENS,
        "--micro-batch-tokens",
        min=16,
        help="Token budget of one packed micro-batch (attention stays inside each sample with no T x T "
        "mask, and the output head runs in chunks, so memory grows with T, not T^2).",
    ),
    mixed_versions: str = typer.Option(
        "keep",
        "--mixed-versions",
        help="Trajectories whose turns span a reload (several weight versions): keep, drop or error.",
    ),
    dynamic_sampling: bool = typer.Option(
        False,
        "--dynamic-sampling/--no-dynamic-sampling",
        help="DAPO-style: leave out groups whose rewards are all equal and sample more to fill the batch.",
    ),
    negative_advantage_scale: float = typer.Option(
        1.0,
        "--negative-advantage-scale",
        min=0.0,
        help="Multiply negative advantages by this (1: seed 000's GRPO; < 1 sharpens a near-deterministic "
        "policy instead of spreading it: trainer/advantages.py).",
    ),
    rollout_top_p: float = typer.Option(
        1.0,
        "--rollout-top-p",
        min=0.0,
        max=1.0,
        help="Nucleus mass the rollouts sample with (slime and verl: 1.0, so the engine's log-probs are "
        "those of the distribution sampled from); 0: the workers' own setting (evaluation's 0.95).",
    ),
    loss_aggregation: str = typer.Option(
        "sample-mean",
        "--loss-aggregation",
        help="How a sample's token losses combine: sample-mean (each sample counts once) or token-sum "
        "(over the worker token budget, Dr. GRPO: each token counts once).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the question order."),
    worker_checkpoint_root: Path | None = typer.Option(
        None,
        "--worker-checkpoint-root",
        help="Where the workers see --out (e.g. the checkpoint volume's mount path in their pods).",
    ),
    max_tokens: int | None = typer.Option(
        None, "--worker-max-tokens", min=1, help="Worker episode token budget (default: the worker's)."
    ),
    max_turns: int | None = typer.Option(
        None, "--worker-max-turns", min=1, help="Worker episode turn limit (default: the worker's)."
    ),
    max_branches: int | None = typer.Option(
        None, "--max-branches", min=1, help="Coordinator branches per episode (default: the gateway's)."
    ),
    eval_every: int = typer.Option(
        0, "--eval-every", min=0, help="Every K updates, an evaluation round on --eval-questions (0: never)."
    ),
    eval_questions: Path | None = typer.Option(None, "--eval-questions", help="Held-out questions."),
    report_to: str = typer.Option(
        "", "--report-to", help="Also log to: tensorboard, wandb (comma-separated; W&B offline works)."
    ),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve bcstack_trainer_* Prometheus metrics on this port."
    ),
    judge_attempts: int = typer.Option(
        5,
        "--judge-attempts",
        min=1,
        help="Tries per judge call before the run stops.",
    ),
    resume: bool = typer.Option(
        False, "--resume/--no-resume", help="Continue from the newest checkpoint under --out."
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Tensor-parallel size. Under torchrun the job's processes form a [dp, tp] mesh, "
        "dp = world size / tp (FSDP2 on dp); rank 0 runs the loop, every rank trains.",
    ),
) -> None:
    """Train a worker on live rollouts: submit question groups to the gateway, grade them with the
    judge, GRPO-update the policy, export it and hot-reload every worker replica, and go round.

    Seed 000's settings are the defaults: 8 groups x 8 episodes per update, LR 1e-6, TIS cap 2, KL
    0.001 (k3) to --ref, 0.5/0.5 balanced credit. One JSON line per update goes to OUT/metrics.jsonl,
    the episode ids of each update to OUT/updates.jsonl. Kill it at any moment: --resume continues
    from the newest complete checkpoint. Bad input is one `error:` line.
    """
    # The cheap checks first: torch's import (trainer, the loop) takes seconds.
    for option, path in (("--questions", questions), ("--eval-questions", eval_questions)):
        if path is not None and not path.exists():
            fail(f"{option} {path}: no such file")
    need_model("--model", model)
    need_model("--ref", ref)
    if mixed_versions not in ("keep", "drop", "error"):
        fail(f"--mixed-versions must be keep, drop or error, not {mixed_versions!r}")
    if loss_aggregation not in ("sample-mean", "token-sum"):
        fail(f"--loss-aggregation must be sample-mean or token-sum, not {loss_aggregation!r}")
    from trainer.layout import LayoutError, early_layout_error

    layout_error = early_layout_error(tp)  # before torch's imports: a bad --tp is one line at once
    if layout_error is not None:
        fail(layout_error)
    from bcstack.evaluation.loaders import LoaderError, load_questions
    from bcstack.rl.loop import RLConfig, RLError, RLRun, follow
    from bcstack.rl.rollouts import RolloutError
    from services.worker.rolling import ReplicaDiscoveryError, k8s_worker_urls, parse_worker_urls
    from trainer.distributed import init_layout
    from trainer.grpo import GRPOError
    from trainer.sinks import SinkError

    try:
        layout = init_layout(tp)  # before loading anything: joins the torchrun job, if any
    except LayoutError as exc:
        fail(str(exc))
    token = os.environ.get("BCSTACK_ADMIN_TOKEN", "").strip()
    if state is not None:
        stack_file = state / "stack.json"
        if not stack_file.is_file():
            fail(f"--state {state}: no stack.json (start one with `bcstack up --state {state}`)")
        from bcstack.stack import gateway_url, worker_urls

        info = json.loads(stack_file.read_text())
        services = info["services"]
        gateway = gateway or gateway_url(info)
        judge = judge or services["judge"]["http"]
        workers = workers or ",".join(worker_urls(info))
        if not token and (state / "admin-token").is_file():
            token = (state / "admin-token").read_text().strip()
    if not gateway or not judge:
        fail("give the stack: --state DIR, or --gateway URL and --judge URL")
    if not token:
        fail("the workers' admin token is needed to reload them: set BCSTACK_ADMIN_TOKEN (or --state)")
    try:
        if k8s_selector:
            urls = k8s_worker_urls(k8s_selector, port=k8s_port, namespace=k8s_namespace)
        elif workers:
            urls = parse_worker_urls(workers)
        else:
            fail("give the worker replicas: --workers URL,URL or --k8s-selector SELECTOR (or --state)")
        train_questions = load_questions(questions, password=password)
        held_out = load_questions(eval_questions, password=password) if eval_questions else []
    except (ReplicaDiscoveryError, LoaderError, OSError, ValueError) as exc:
        fail(str(exc))
    if eval_every and not held_out:
        fail("--eval-every needs --eval-questions")
    budget = {k: v for k, v in {"max_tokens": max_tokens, "max_turns": max_turns}.items() if v}
    config = RLConfig(
        questions=train_questions,
        model=model,
        ref=ref,
        out=out,
        gateway=gateway,
        judge=judge,
        workers=urls,
        admin_token=token,
        updates=updates,
        max_seconds=None if max_minutes is None else 60 * max_minutes,
        groups=groups,
        group_size=group_size,
        max_policy_lag=max_policy_lag,
        lr=lr,
        steps_per_update=steps_per_update,
        vector_lr_scale=vector_lr_scale,
        micro_batch_tokens=micro_batch_tokens,
        mixed_versions=mixed_versions,
        dynamic_sampling=dynamic_sampling,
        negative_advantage_scale=negative_advantage_scale,
        rollout_top_p=rollout_top_p or None,
        loss_aggregation=loss_aggregation,
        seed=seed,
        worker_checkpoint_root=worker_checkpoint_root,
        worker_budget=budget,
        overrides={"max_branches": max_branches} if max_branches else {},
        eval_every=eval_every,
        eval_questions=held_out,
        judge_attempts=judge_attempts,
        report_to={n.strip() for n in report_to.split(",") if n.strip()},
        metrics_port=metrics_port,
    )
    try:
        if not layout.is_main:  # rank 0 runs the loop; the others train with it
            follow(config, layout)
        else:
            with _live_view(updates) as (say, on_metrics, on_progress):
                run = RLRun(config, say=say, on_metrics=on_metrics, on_progress=on_progress, layout=layout)
                asyncio.run(run.run(resume=resume))
    except (RLError, RolloutError, GRPOError, SinkError, LayoutError) as exc:
        fail(str(exc))
    layout.close()


@contextlib.contextmanager
def _live_view(updates: int):
    """A Rich live view on a terminal: updates done, groups graded and in flight, the reload going
    on; plain lines (one per update) everywhere else, so logs and CI output stay readable."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield typer.echo, (lambda _m: None), (lambda _k, _d: None)
        return
    with Progress(
        TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        update_bar = progress.add_task("updates", total=updates, status="")
        groups_bar = progress.add_task("groups graded", total=None, status="")

        def on_metrics(m: dict) -> None:
            progress.update(
                update_bar, completed=m["update"],
                status=f"reward {m['reward_mean'] or 0:.3f}, lag max {m['policy_lag_max']}",
            )  # fmt: skip

        def on_progress(kind: str, data: dict) -> None:
            if kind == "group":
                progress.update(groups_bar, advance=1, status=f"{data['inflight']} in flight")
            elif kind == "reload":
                progress.update(update_bar, status=f"reloading the workers to rl-u{data['update']}")

        yield progress.console.print, on_metrics, on_progress
