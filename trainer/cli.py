"""Trainer commands: a GRPO step from episode records, export to the serving format, verify.

Mounted by bcstack/cli.py (`bcstack train grpo|export`, `bcstack checkpoint verify`). torch and
transformers are imported inside the commands so that `bcstack --help` stays instant.
"""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core import budget
from core.kit.cli import fail, need_file, need_model

app = typer.Typer(
    help="Trainer checkpoints: export to the serving format (BF16 safetensors) and verify.",
    no_args_is_help=True,
)


@app.callback()
def _group() -> None:
    # A callback keeps this a command group whichever commands are mounted.
    pass


def _print_summary(title: str, summary: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    exported = "source" in summary
    rows = [
        ("checkpoint", summary["path"]),
        *(
            [("source", summary["source"]), ("tokenizer from", summary["tokenizer_source"])]
            if exported
            else []
        ),
        ("architecture", f"{summary['architecture']} ({summary['model_type']})"),
        ("tensors", f"{summary['tensors']:,} ({summary['parameters']:,} parameters, {summary['dtype']})"),
        (
            "weights",
            f"{', '.join(summary['weight_files'])} ({summary['weight_bytes'] / 2**20:,.1f} MiB payload)",
        ),
        (
            "vocabulary",
            f"{summary['vocab_rows']:,} embedding rows, tokenizer {summary['tokenizer_tokens']:,} tokens"
            + (f" (trimmed from {summary['source_vocab_rows']:,})" if exported else "")
            + (", tied lm_head" if summary["tie_word_embeddings"] else ", untied lm_head"),
        ),
        ("chat template", summary["chat_template"]),
        ("SHA256SUMS", f"{summary['hashed_files']} files, all hashes match"),
    ]
    if summary.get("expect_config"):
        rows.append(("compatible with", summary["expect_config"]))
    if summary.get("unlisted_files"):
        rows.append(("not hashed", ", ".join(summary["unlisted_files"])))
    for name, value in rows:
        table.add_row(name, escape(str(value)))
    Console().print(table)


@app.command("export")
def export(
    model: Path = typer.Option(
        ...,
        "--model",
        help="Trained model folder: an HF export (config.json + safetensors or pytorch_model*.bin), "
        "possibly with padded embedding rows.",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Folder to write the serving checkpoint into (missing or empty)."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="Pinned tokenizer folder whose files and chat template are restored and whose size sets "
        "the embedding rows. Default: the --model folder.",
        show_default=False,
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Embedding rows to keep instead of the tokenizer's size (e.g. 151936 to match Qwen3-4B).",
        show_default=False,
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard."),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace a non-empty --out folder."),
) -> None:
    """Export a trained checkpoint to the serving format and verify it.

    BF16 safetensors, embedding rows trimmed to the tokenizer's vocabulary (every kept row byte for
    byte), every tensor's key, shape and dtype checked, tokenizer files and chat template restored,
    SHA256SUMS written last. The export is built beside --out and renamed into place when verified.
    """
    need_model("--model", model)  # before torch's import: seconds
    if tokenizer is not None and not tokenizer.is_dir():
        fail(f"--tokenizer {tokenizer}: not a folder")
    from core.checkpoint import VerifyError
    from trainer.export import ExportError, export_checkpoint

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Starting …") as status:
        try:
            summary = export_checkpoint(
                model,
                out,
                tokenizer_dir=tokenizer,
                vocab_size=vocab_size,
                max_shard_size=max_shard_size,
                force=force,
                step=lambda description: status.update(f"{description} …"),
            )
        except (ExportError, VerifyError, OSError) as error:
            status.stop()
            fail(str(error))
    _print_summary(f"Exported and verified in {time.perf_counter() - started:.1f} s", summary)


@app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="Serving checkpoint folder."),
    expect_config: Path | None = typer.Option(
        None,
        "--expect-config",
        help="config.json (or its folder) of the model the engine serves; the checkpoint must match its "
        "architecture, sizes and vocabulary.",
        show_default=False,
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Expected embedding rows when they differ from the tokenizer's size.",
        show_default=False,
    ),
) -> None:
    """Verify a serving checkpoint: hashes, tensors (key, shape, BF16), vocabulary, tokenizer files.

    Prints a summary, or the first problem as one `error:` line (exit 2).
    """
    from core.checkpoint import VerifyError, verify_checkpoint

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Verifying …") as status:
        try:
            summary = verify_checkpoint(path, expect_config=expect_config, vocab_size=vocab_size)
        except (VerifyError, OSError) as error:
            status.stop()
            fail(str(error))
    _print_summary(f"Verified in {time.perf_counter() - started:.1f} s", summary)


class GraderChoice(StrEnum):
    rule = "rule"


class MixedVersions(StrEnum):
    keep = "keep"
    drop = "drop"
    error = "error"


@app.command("grpo")
def grpo(
    records: str | None = typer.Option(
        None,
        "--records",
        metavar="FILE|URL",
        help="Episode records: the coordinator gateway's SQLite record file, a JSONL file of records, or "
        "the gateways' PostgreSQL store (postgresql://USER@HOST/DB; snapshotted to OUT/records.sqlite "
        "first). Required unless --env.",
        show_default=False,
    ),
    model: Path = typer.Option(
        ..., "--model", help="Policy to train: an HF model folder (its tokenizer goes to the export)."
    ),
    ref: Path | None = typer.Option(
        None,
        "--ref",
        help="Frozen KL reference (the SFT model), an HF model folder. Required unless --env.",
        show_default=False,
    ),
    out: Path = typer.Option(
        ..., "--out", help="Run folder: metrics.jsonl, checkpoints/ and the serving export serving/."
    ),
    lr: float | None = typer.Option(
        None,
        "--lr",
        min=0.0,
        help="Learning rate. Default: AdamW 1e-6 for episode records (seed 000), Adam 1e-5 with --env "
        "(seed 004).",
        show_default=False,
    ),
    micro_batch_tokens: int = typer.Option(
        budget.MAX_TOKENS,
        "--micro-batch-tokens",
        min=1,
        help="Token budget of one packed micro-batch; the longest trajectory must fit.",
    ),
    grader: GraderChoice = typer.Option(
        GraderChoice.rule,
        "--grader",
        help="How rewards and contributions are graded (rule: the embedded judge).",
    ),
    steps: int = typer.Option(
        1, "--steps", min=1, help="Train until the policy has taken this many updates."
    ),
    groups_per_step: int = typer.Option(
        8, "--groups-per-step", min=1, help="Question groups per update (seed 000: 8 prompts x 8 episodes)."
    ),
    mixed_versions: MixedVersions = typer.Option(
        "keep",
        "--mixed-versions",
        help="Worker trajectories generated across a hot reload (turns of several weight versions): "
        "keep them, drop them, or stop with an error.",
    ),
    resume: bool = typer.Option(
        False, "--resume/--no-resume", help="Continue from the newest checkpoint under --out."
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Tensor-parallel size. Under torchrun the job's processes form a [dp, tp] mesh, "
        "dp = world size / tp (FSDP2 on dp); one process takes --tp 1.",
    ),
    env: str | None = typer.Option(
        None,
        "--env",
        help="Single-turn domain RL instead of episode records (seed 004): math, code or if, the "
        "verifier that grades each response. Needs --engine and --prompts; trains a LoRA adapter.",
        show_default=False,
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="Engine serving --model (SGLang or `bcstack serve engine --model` the same folder); it is "
        "hot-reloaded with the merged policy after each update (admin token: $BCSTACK_ADMIN_TOKEN).",
        show_default=False,
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    prompts: Path | None = typer.Option(
        None,
        "--prompts",
        help="Training rows, JSONL: prompt (text or messages) + label (DAPO-Math-17k's form).",
        show_default=False,
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    dev_prompts: Path | None = typer.Option(
        None,
        "--dev-prompts",
        help="Development rows scored greedily every --eval-every updates.",
        show_default=False,
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    eval_every: int = typer.Option(
        5,
        "--eval-every",
        min=1,
        rich_help_panel="Single-turn domain RL (--env)",
        help="Updates between development scores.",
    ),
    lora_rank: int = typer.Option(
        16,
        "--lora-rank",
        min=1,
        help="LoRA rank (seed 004: 16).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    lora_alpha: int = typer.Option(
        32,
        "--lora-alpha",
        min=1,
        help="LoRA alpha (seed 004: 32).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    lora_targets: str = typer.Option(
        "attn,mlp,lm_head",
        "--lora-targets",
        help="Adapted module groups: attn, mlp, lm_head.",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    prompts_per_step: int = typer.Option(
        32,
        "--prompts-per-step",
        min=1,
        help="Prompts per update (seed 004: up to 32).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    responses: int = typer.Option(
        8,
        "--responses",
        min=2,
        help="Responses per prompt (seed 004: 8).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    max_response_tokens: int = typer.Option(
        16_384,
        "--max-response-tokens",
        min=1,
        help="Response cap; responses stopped by it get no gradient.",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    warmup: int = typer.Option(
        10,
        "--warmup-updates",
        min=0,
        help="Linear LR warm-up (seed 004: 10).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    mini_batches: int = typer.Option(
        1,
        "--mini-batches",
        min=1,
        help="Optimizer steps per rollout batch (>1: the PPO clip binds).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    tis_cap: float | None = typer.Option(
        None,
        "--tis-cap",
        min=1.0,
        show_default=False,
        help="Truncated importance sampling against the engine's "
        "log-probs (off by default: the seed names none).",
        rich_help_panel="Single-turn domain RL (--env)",
    ),
    seed: int = typer.Option(
        0, "--seed", help="Prompt order and sampling seeds.", rich_help_panel="Single-turn domain RL (--env)"
    ),
) -> None:
    """One GRPO update per rollout batch of episode records (hierarchical credit, TIS, k3 KL).

    With --env: seed 004's single-turn domain RL instead: LoRA (rank 16, alpha 32, attention, MLP and
    lm_head), responses sampled from --engine and graded by the verifier, group-centred advantages
    without std, PPO clip [0.8, 1.2], no KL, Adam 1e-5 with 10 warm-up updates; the merged policy is
    hot-reloaded into the engine after every update; OUT/adapter and OUT/serving at the end.

    Grades the records, computes balanced worker-judge credit per question group, updates the policy
    with AdamW, logs each step to stdout and OUT/metrics.jsonl, checkpoints to OUT/checkpoints and
    exports the final policy to OUT/serving. Bad input is one `error:` line (exit 2).

    Several GPUs (or CPU processes, gloo): `torchrun --nproc_per_node N -m bcstack train grpo --tp T ...`
    runs the same step on every rank, each dp rank on its share of the micro-batches; rank 0 alone
    prints, writes metrics.jsonl and exports; checkpoints are sharded (DCP) and resume at any layout.
    """
    if env is not None:
        _grpo_env(
            env=env,
            model=model,
            out=out,
            engine=engine,
            prompts=prompts,
            dev_prompts=dev_prompts,
            eval_every=eval_every,
            lr=lr,
            steps=steps,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            prompts_per_step=prompts_per_step,
            responses=responses,
            max_response_tokens=max_response_tokens,
            warmup=warmup,
            mini_batches=mini_batches,
            tis_cap=tis_cap,
            seed=seed,
            resume=resume,
            micro_batch_tokens=micro_batch_tokens,
        )
        return
    if records is None or ref is None:
        fail("--records and --ref are required (or --env for single-turn domain RL)")
    from core.record_store import is_database_url  # no torch: the cheap checks come first

    if not is_database_url(records) and not Path(records).is_file():
        fail(f"no episode records at {records}")
    need_model("--model", model)
    need_model("--ref", ref)
    from trainer.layout import LayoutError, early_layout_error

    layout_error = early_layout_error(tp)  # before torch's imports: a bad --tp is one line at once
    if layout_error is not None:
        fail(layout_error)
    from trainer.distributed import init_layout

    try:
        layout = init_layout(tp)  # before loading anything: joins the torchrun job, if any
    except LayoutError as error:
        fail(str(error))
    records = _records_file(records, out, ranks=layout.env.world_size)
    from core.checkpoint import VerifyError
    from trainer.checkpoint import CheckpointError
    from trainer.data import SampleError
    from trainer.export import ExportError
    from trainer.grpo import LR, GRPOError, rule_grades, train

    graders = {GraderChoice.rule: rule_grades}
    try:
        train(
            records,
            model,
            ref,
            out,
            lr=LR if lr is None else lr,
            micro_batch_tokens=micro_batch_tokens,
            grader=graders[grader],
            steps=steps,
            resume=resume,
            groups_per_step=groups_per_step,
            mixed_versions=mixed_versions.value,
            layout=layout,
            say=typer.echo,  # train() silences every rank but 0
        )
    except (GRPOError, SampleError, CheckpointError, ExportError, VerifyError, OSError) as error:
        fail(" ".join(str(error).split()))
    except ValueError as error:  # a record that is not JSON, a trajectory over the micro-batch budget
        fail(" ".join(str(error).split()))
    layout.close()


def _grpo_env(
    *,
    env: str,
    model: Path,
    out: Path,
    engine: str | None,
    prompts: Path | None,
    lr: float | None,
    lora_rank: int,
    lora_alpha: int,
    lora_targets: str,
    **settings: Any,
) -> None:
    """`bcstack train grpo --env ...`: seed 004's LoRA domain RL (trainer.specialist)."""
    import os

    if engine is None or prompts is None:
        fail("--env needs --engine (the engine serving --model) and --prompts (training rows)")
    need_model("--model", model)  # before torch's import: seconds
    need_file("--prompts", prompts)
    from core.single_turn import PromptError
    from core.verifiers import VerifierError
    from trainer.checkpoint import CheckpointError
    from trainer.lora import LoraError, LoraSettings, parse_targets
    from trainer.specialist import LR, SpecialistConfig, SpecialistError, train_specialist

    micro = settings.pop("micro_batch_tokens")
    try:
        lora = LoraSettings(rank=lora_rank, alpha=lora_alpha, targets=parse_targets(lora_targets))
        lora.target_modules()
        cfg = SpecialistConfig(
            base=model,
            prompts=prompts,
            out=out,
            engine_url=engine,
            env=env,
            lora=lora,
            lr=LR if lr is None else lr,
            warmup_updates=settings.pop("warmup"),
            micro_batch_tokens=min(micro, 65_536),
            admin_token=os.environ.get("BCSTACK_ADMIN_TOKEN"),
            **settings,
        )
        summary = train_specialist(cfg, say=typer.echo)
    except (SpecialistError, LoraError, PromptError, VerifierError, CheckpointError, OSError) as error:
        fail(" ".join(str(error).split()))
    typer.echo(
        f"trained {summary['updates']} updates in {summary['seconds']} s; adapter in {summary['adapter']}, "
        f"merged BF16 export in {summary['serving']} ({summary['adapter_tensors']} adapter tensors, "
        f"logits check {'passed' if summary['logits_check'] else 'FAILED'})"
    )


@app.command("merge-lora")
def merge_lora_command(
    base: Path = typer.Option(..., "--base", help="The base model folder the adapter was trained on."),
    adapter: Path = typer.Option(..., "--adapter", help="A peft LoRA adapter folder (adapter_config.json)."),
    out: Path = typer.Option(..., "--out", help="Folder for the merged serving export (missing or empty)."),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace a non-empty --out."),
) -> None:
    """Merge a LoRA adapter into its base in FP32, save BF16, and validate the result (seed 004).

    Checks that every adapter tensor was applied (counted), that the FP32 merge equals base + adapter,
    that the input embedding is unchanged and an adapted head untied, and that the logits of the BF16
    export read back equal the FP32-merged model's cast to BF16 bit for bit. Writes the serving export
    (`bcstack checkpoint verify` passes) with model_provenance.json; any failed check exits 2.
    """
    need_model("--base", base)  # before torch's import: seconds
    if not (adapter / "adapter_config.json").is_file():
        fail(f"--adapter {adapter}: not a LoRA adapter folder (no adapter_config.json)")
    from core.checkpoint import VerifyError
    from trainer.export import ExportError
    from trainer.lora import LoraError, merge_lora

    console = Console(stderr=True)
    started = time.perf_counter()
    with console.status("Starting …") as status:
        try:
            provenance = merge_lora(base, adapter, out, force=force, say=lambda m: status.update(f"{m} …"))
        except (LoraError, ExportError, VerifyError, OSError) as error:
            status.stop()
            fail(" ".join(str(error).split()))
    check = provenance["logits_check"]
    console.print(
        f"merged {provenance['adapter_tensors']} adapter tensors ({provenance['adapted_modules']} modules) "
        f"into {out} in {time.perf_counter() - started:.1f} s; FP32 merge within "
        f"{provenance['merge_max_abs_diff']:.2g} of base + adapter; logits after the BF16 reload: "
        f"{check['logits_differing']} of {check['logits_compared']:,} differ (bitwise check passed)"
    )


@app.command("distill")
def distill(
    teachers: Path = typer.Option(
        ...,
        "--teachers",
        help='JSON: {"enable_thinking": false, "teachers": {DOMAIN: {"model": DIR, "engine": URL?}}}. '
        "A teacher without an engine gets a CPU engine started for it.",
    ),
    model: Path = typer.Option(
        ..., "--model", help="The student: an HF model folder (the base of its LoRA)."
    ),
    engine: str = typer.Option(
        ..., "--engine", help="Engine serving --model; hot-reloaded after each update ($BCSTACK_ADMIN_TOKEN)."
    ),
    prompts: Path = typer.Option(
        ..., "--prompts", help="Training rows with a `domain` each (prompt + label), routed to that teacher."
    ),
    out: Path = typer.Option(..., "--out", help="Run folder: metrics.jsonl, adapter/, serving/."),
    dev_prompts: Path | None = typer.Option(
        None, "--dev-prompts", help="Rows scored greedily every --eval-every updates.", show_default=False
    ),
    eval_every: int = typer.Option(5, "--eval-every", min=1, help="Updates between development scores."),
    steps: int = typer.Option(10, "--steps", min=1, help="Updates."),
    lr: float = typer.Option(1e-5, "--lr", min=0.0, help="Adam learning rate of the LoRA matrices."),
    warmup: int = typer.Option(10, "--warmup-updates", min=0, help="Linear LR warm-up."),
    prompts_per_step: int = typer.Option(32, "--prompts-per-step", min=1, help="Prompts per update."),
    responses: int = typer.Option(4, "--responses", min=1, help="Student responses per prompt."),
    max_response_tokens: int = typer.Option(16_384, "--max-response-tokens", min=1, help="Response cap."),
    kl_weight: float = typer.Option(1.0, "--kl-weight", min=0.0, help="λ of the reverse-KL signal."),
    reward_weight: float = typer.Option(
        0.0, "--reward-weight", min=0.0, help="Weight of the verifier's group-centred reward added per token."
    ),
    verifier: str = typer.Option(
        "math", "--verifier", help="Verifier for rewards and dev scores: math, code, if."
    ),
    lora_rank: int = typer.Option(16, "--lora-rank", min=1, help="LoRA rank."),
    lora_alpha: int = typer.Option(32, "--lora-alpha", min=1, help="LoRA alpha."),
    lora_targets: str = typer.Option("attn,mlp,lm_head", "--lora-targets", help="attn, mlp, lm_head."),
    seed: int = typer.Option(0, "--seed", help="Prompt order and sampling seeds."),
) -> None:
    """Multi-teacher on-policy distillation (seed 004): the student samples, the domain's teacher scores.

    Each prompt goes to the teacher of its `domain`; the teacher scores the student's tokens through
    /generate (max_new_tokens 0, return_logprob, logprob_start_len at the response); the per-token
    reverse KL (student − teacher log-prob) is the training signal, optionally plus the verifier's
    reward. Teachers whose tokenizer, chat template or thinking mode differ from the student's are
    refused with the first difference named.
    """
    import os

    need_file("--teachers", teachers)  # before torch's import: seconds
    need_model("--model", model)
    need_file("--prompts", prompts)
    if dev_prompts is not None:
        need_file("--dev-prompts", dev_prompts)

    from core.single_turn import PromptError
    from core.verifiers import VerifierError
    from trainer.distill import DistillConfig, DistillError, train_distill
    from trainer.lora import LoraError, LoraSettings, parse_targets

    try:
        lora = LoraSettings(rank=lora_rank, alpha=lora_alpha, targets=parse_targets(lora_targets))
        lora.target_modules()
        cfg = DistillConfig(
            student=model,
            teachers=teachers,
            prompts=prompts,
            out=out,
            engine_url=engine,
            dev_prompts=dev_prompts,
            lora=lora,
            lr=lr,
            warmup_updates=warmup,
            prompts_per_step=prompts_per_step,
            responses=responses,
            max_response_tokens=max_response_tokens,
            kl_weight=kl_weight,
            reward_weight=reward_weight,
            verifier=verifier,
            steps=steps,
            eval_every=eval_every,
            seed=seed,
            admin_token=os.environ.get("BCSTACK_ADMIN_TOKEN"),
        )
        summary = train_distill(cfg, say=typer.echo)
    except (DistillError, LoraError, PromptError, VerifierError, OSError) as error:
        fail(" ".join(str(error).split()))
    typer.echo(
        f"distilled {summary['updates']} updates in {summary['seconds']} s; merged BF16 export in "
        f"{summary['serving']} (logits check {'passed' if summary['logits_check'] else 'FAILED'})"
    )


def _records_file(records: str, out: Path, *, ranks: int) -> Path:
    """The records as a file: a PostgreSQL store is snapshotted to OUT/records.sqlite (one consistent
    set for grading and training, kept beside the checkpoints that came from it)."""
    from core.record_store import RecordStoreError, is_database_url, open_record_store

    if not is_database_url(records):
        return Path(records)
    if ranks > 1:
        fail(
            "--records URL with several processes: export the records once first "
            "(bcstack records export --records URL --out FILE --format sqlite) and pass FILE"
        )
    snapshot = out / "records.sqlite"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open_record_store(records) as store:
            n = store.export(snapshot, fmt="sqlite")
    except (RecordStoreError, OSError) as exc:
        fail(f"--records: {exc}")
    typer.echo(f"{n} record(s) from {store.location} snapshotted to {snapshot}")
    return snapshot
