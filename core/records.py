"""The episode record: one typed, versioned record that travels the whole system (DESIGN.md §4).

    record = EpisodeRecord.load(json_dict)    # any stored schema version; raises RecordError
    record.workers[0].trajectory.token_ids    # exact token ids, loss mask, rollout log-probs
    record.dump()                             # what the gateway stores and GET /v1/episodes/{id} serves

Who writes and reads it:

- the worker builds a `WorkerTrajectory` per episode; it crosses gRPC as `bcstack.v1.Trajectory`
  (`trajectory_from_proto` / `trajectory_to_proto`, through `google.protobuf.json_format`, so no
  field is copied by hand);
- the coordinator gateway assembles the `EpisodeRecord` (coordinator turns, one `WorkerRecord` per
  branch), stores it durably (`core.record_store`) and serves it at `GET /v1/episodes/{id}`;
- evaluation turns it into BrowseComp-Plus run files; the trainer turns each `WorkerTrajectory`
  into a training sample.

Invariants are checked here, at the edge, with a one-line reason (`RecordError`): mask and
log-prob lengths agree, log-probs are finite and ≤ 0, mask values are 0/1, token ids are
non-negative (and below the vocabulary when the reader passes `vocab_size` in the validation
context), turns are contiguous and their generated spans hold exactly the mask-1 tokens, and a
trajectory starts with its prompt. A record that breaks one never reaches the trainer.

Schema versions. `bcstack.episode/2` is this one. `bcstack.coordinator.episode/1` (the gateway's
records before the typed record existed) has the same fields minus `grades` and the trajectory's
`events`; it loads as version 2 with those empty. An unknown version is an error, never guessed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

SCHEMA = "bcstack.episode/2"
SCHEMA_V1 = "bcstack.coordinator.episode/1"
READABLE_SCHEMAS = (SCHEMA, SCHEMA_V1)

StopReason = Literal["finish", "budget", "turns", "context", "error"]
STOP_REASONS: tuple[str, ...] = ("finish", "budget", "turns", "context", "error")


class RecordError(ValueError):
    """A record that breaks the schema or an invariant; the message is one line naming the fault."""


# WorkerTrajectory.events the worker's no-search guard writes (services/worker/runner.py): an answer
# given before any search voided, or bounced once because it matched the gold answer.
EVENT_FINISH_WITHOUT_SEARCH = "finish_without_search"
EVENT_FINISH_WITHOUT_SEARCH_BOUNCED = "finish_without_search_bounced"


class _Model(BaseModel):
    # Unknown keys are errors: a misspelt field would otherwise vanish without a trace.
    model_config = ConfigDict(extra="forbid")


# --- the worker trajectory --------------------------------------------------------------------------


class VersionSpan(_Model):
    """The generated tokens [start, end) of a turn (offsets from its gen_start) one version made."""

    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class TurnSpan(_Model):
    """One assistant turn; positions index `WorkerTrajectory.token_ids` (0-based, ends exclusive).

    `version_spans` is set only when a hot reload swapped the weights while the turn generated
    (the engine kept the request running: SGLang's in-place pause): the turn then holds tokens of
    several versions, the last being `weight_version`."""

    prompt_start: int = Field(ge=0)
    gen_start: int = Field(ge=0)
    gen_end: int = Field(ge=0)
    generated_tokens: int = Field(ge=0)
    weight_version: str = ""
    finish_reason: str = ""
    version_spans: list[VersionSpan] = Field(default_factory=list)

    @property
    def weight_versions(self) -> tuple[str, ...]:
        """Every version that made a token of this turn, in order."""
        spans = tuple(s.version for s in self.version_spans)
        return tuple(dict.fromkeys((*spans, self.weight_version) if self.weight_version else spans))


class ToolCall(_Model):
    """One tool call parsed from a turn, and what became of it."""

    turn: int = Field(0, ge=0)
    name: str = ""
    params: dict[str, str] = Field(default_factory=dict)
    outcome: str = "ok"
    error: str = ""
    docids: list[str] = Field(default_factory=list)


class WorkerTrajectory(_Model):
    """The exact token-level record of one worker episode, as the trainer consumes it.

    `rollout_logprobs` holds one value per generated token (`loss_mask == 1`), in order.
    `events` names protocol guards that fired (e.g. an answer voided for want of a search).
    """

    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    rollout_logprobs: list[float] = Field(default_factory=list)
    turns: list[TurnSpan] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    stop_reason: StopReason = "error"
    tokens_used: int = Field(0, ge=0)
    turns_used: int = Field(0, ge=0)
    error: str = ""
    events: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _invariants(self, info: ValidationInfo) -> WorkerTrajectory:
        vocab_size = (info.context or {}).get("vocab_size") if info is not None else None
        problem = trajectory_problem(self, vocab_size)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def weight_versions(self) -> tuple[str, ...]:
        """Distinct weight versions of the turns (spans within a turn included), in order of first
        use (> 1: reloaded mid-episode)."""
        return tuple(dict.fromkeys(v for t in self.turns for v in t.weight_versions))

    def aligned_logprobs(self) -> list[float]:
        """Rollout log-probs aligned to `token_ids`: the engine's value where the mask is 1, else 0.0."""
        values = iter(self.rollout_logprobs)
        return [next(values) if m else 0.0 for m in self.loss_mask]


def trajectory_problem(t: WorkerTrajectory, vocab_size: int | None = None) -> str | None:
    """The first broken invariant of a trajectory as one line, or None."""
    n = len(t.token_ids)
    if not n and t.turns:
        return f"empty trajectory (no token ids) with {len(t.turns)} turn(s)"
    if len(t.loss_mask) != n:
        return f"loss_mask has {len(t.loss_mask)} entries for {n} token ids"
    for i, tok in enumerate(t.token_ids):
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            where = f" (vocabulary of {vocab_size})" if vocab_size is not None else ""
            return f"token id at position {i} is {tok}, not a token id{where}"
    for i, m in enumerate(t.loss_mask):
        if m not in (0, 1):
            return f"loss_mask value at position {i} is {m}, not 0 or 1"
    generated = sum(t.loss_mask)
    if len(t.rollout_logprobs) != generated:
        return f"{len(t.rollout_logprobs)} rollout_logprobs for {generated} loss_mask==1 tokens"
    for i, lp in enumerate(t.rollout_logprobs):
        if not math.isfinite(lp) or lp > 0:
            return f"rollout_logprobs[{i}] is {lp!r}, not a finite log-probability <= 0"
    if n and t.loss_mask[0] == 1:
        # A token with nothing before it has no next-token log-prob to train or compare.
        return (
            "the first token is marked as generated (loss_mask[0] == 1); a trajectory starts with its prompt"
        )
    return _turns_problem(t)


def _turns_problem(t: WorkerTrajectory) -> str | None:
    previous_end = 0
    in_spans = 0
    for k, turn in enumerate(t.turns):
        if turn.prompt_start != previous_end:
            return f"turn {k} starts at {turn.prompt_start}, the previous turn ended at {previous_end}"
        if not turn.prompt_start <= turn.gen_start <= turn.gen_end <= len(t.token_ids):
            return (
                f"turn {k} has prompt_start {turn.prompt_start}, gen_start {turn.gen_start}, "
                f"gen_end {turn.gen_end} for {len(t.token_ids)} tokens"
            )
        if turn.gen_end - turn.gen_start != turn.generated_tokens:
            return f"turn {k} spans {turn.gen_end - turn.gen_start} tokens but says {turn.generated_tokens}"
        masked = sum(t.loss_mask[turn.gen_start : turn.gen_end])
        if masked != turn.generated_tokens:
            return f"turn {k} generated {turn.generated_tokens} tokens but {masked} of them have loss_mask 1"
        in_spans += masked
        previous_end = turn.gen_end
    if t.turns and in_spans != sum(t.loss_mask):
        return f"{sum(t.loss_mask) - in_spans} loss_mask==1 tokens lie outside every turn's generation"
    return None


# --- the episode ------------------------------------------------------------------------------------


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    observation_tokens: int = 0
    total_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0


class WorkerReport(_Model):
    answer: str = ""
    explanation: str = ""
    confidence: str = ""
    raw_text: str = ""


class WorkerRecord(_Model):
    """One `branch` call of the coordinator and the worker episode that served it.

    `trajectory` is None when no worker response came back (the branch failed on every replica).
    `contribution` is the judge's contribution score once graded (None: not graded, or ungradable).
    """

    branch: int = 0
    turn: int = 0
    description: str = ""
    prompt: str = ""
    episode_id: str = ""
    status: str = "error"
    replica: str | None = None
    attempts: int = 0
    error: str = ""
    started_at: float = 0.0
    seconds: float = 0.0
    report: WorkerReport = Field(default_factory=WorkerReport)
    usage: Usage = Field(default_factory=Usage)
    trajectory: WorkerTrajectory | None = None
    contribution: float | None = None

    def report_text(self) -> str:
        """The report as the coordinator read it (its raw text), else rendered in the worker's report
        format from its fields, so a grader reads its answer field (core.grading.reported_answer)."""
        from core.protocol import WorkerReportText, render_worker_report

        if self.report.raw_text:
            return self.report.raw_text
        r = self.report
        return render_worker_report(
            WorkerReportText(self.description, self.status, r.answer, r.explanation, r.confidence)
        )


class CoordinatorTurn(_Model):
    turn: int = 0
    seconds: float = 0.0
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: list[str] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)
    workers_seconds: float = 0.0
    total_seconds: float = 0.0


class CoordinatorUsage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class CoordinatorLog(_Model):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    turns: list[CoordinatorTurn] = Field(default_factory=list)
    usage: CoordinatorUsage = Field(default_factory=CoordinatorUsage)


class EpisodeLimits(_Model):
    max_turns: int = 0
    max_branches: int = 0
    max_branches_per_turn: int = 0
    wall_time_seconds: float = 0.0


class EndpointDetail(_Model):
    model: str = ""
    base_url: str = ""


class EpisodeGrades(_Model):
    """The judge's verdict on the final answer. `correct` None: ungraded (parse error, grader down):
    such an episode is excluded from training, never counted as a 0."""

    correct: bool | None = None
    grader_version: str = ""
    parse_error: bool = False
    extracted_final_answer: str = ""

    @property
    def reward(self) -> float | None:
        return None if self.correct is None else float(self.correct)


class EpisodeRecord(_Model):
    """Everything needed to grade, train on, evaluate or debug one coordinator episode."""

    schema_: str = Field(SCHEMA, alias="schema")
    episode_id: str
    question_id: str | None = None
    group_id: str | None = None
    question: str = ""
    gold_answer: str | None = None
    status: str = "error"
    error: str = ""
    answer: str = ""
    explanation: str = ""
    confidence: str = ""
    endpoint: str = ""
    endpoint_detail: EndpointDetail = Field(default_factory=EndpointDetail)
    created_at: float = 0.0
    finished_at: float = 0.0
    seconds: float = 0.0
    limits: EpisodeLimits = Field(default_factory=EpisodeLimits)
    worker_budget: dict[str, int] = Field(default_factory=dict)
    # Sampling overrides every worker of the episode ran with ({}: the workers' own settings), and
    # whether the gold answer reached their no-search guard.
    worker_sampling: dict[str, float] = Field(default_factory=dict)
    worker_gold: bool = True
    coordinator: CoordinatorLog = Field(default_factory=CoordinatorLog)
    workers: list[WorkerRecord] = Field(default_factory=list)
    weight_versions: list[str] = Field(default_factory=list)
    worker_usage: Usage = Field(default_factory=Usage)
    grades: EpisodeGrades | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @classmethod
    def load(cls, data: Mapping[str, Any], *, vocab_size: int | None = None) -> EpisodeRecord:
        """A record from its JSON form, any readable schema version; RecordError names the fault.

        `vocab_size` (the model's embedding rows) also checks every token id against it.
        """
        if not isinstance(data, Mapping):
            raise RecordError(f"an episode record is a JSON object, not {type(data).__name__}")
        schema = data.get("schema", SCHEMA)
        if schema not in READABLE_SCHEMAS:
            raise RecordError(
                f"episode {data.get('episode_id', '?')}: unknown record schema {schema!r} "
                f"(this version reads {', '.join(READABLE_SCHEMAS)})"
            )
        body = {**data, "schema": SCHEMA}  # v1 -> v2: same fields, the new ones empty
        try:
            return cls.model_validate(body, context={"vocab_size": vocab_size})
        except ValidationError as exc:
            raise RecordError(f"episode {data.get('episode_id', '?')}: {first_error(exc)}") from None

    def dump(self) -> dict[str, Any]:
        """The JSON form (what is stored and served)."""
        return self.model_dump(mode="json", by_alias=True)

    @property
    def summary(self) -> dict[str, Any]:
        """The indexed fields of the record store."""
        return {
            "episode_id": self.episode_id,
            "question_id": self.question_id,
            "status": self.status,
            "endpoint": self.endpoint,
            "created_at": self.created_at,
        }


def first_error(exc: ValidationError) -> str:
    """pydantic's first error as one line: `workers.0.trajectory: loss_mask has 9 entries ...`."""
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    return " ".join(f"{where}: {message}".split()) if where else " ".join(message.split())


def validate_trajectory(data: Mapping[str, Any], *, vocab_size: int | None = None) -> WorkerTrajectory:
    """One trajectory from its JSON form; RecordError with the first broken invariant."""
    try:
        return WorkerTrajectory.model_validate(data, context={"vocab_size": vocab_size})
    except ValidationError as exc:
        raise RecordError(first_error(exc)) from None


# --- protobuf edges ---------------------------------------------------------------------------------
# Conversions go through google.protobuf.json_format, except the three bulk token arrays: json_format
# converts repeated scalars one Python call per element (15 ms for a 24K-token trajectory, against
# 2 ms this way, measured on the 2-core CI machine), and the gateway converts every trajectory.
_BULK = ("token_ids", "loss_mask", "rollout_logprobs")
_STOP_PREFIX = "STOP_REASON_"


def trajectory_from_proto(message: Any, *, vocab_size: int | None = None) -> WorkerTrajectory:
    """A `bcstack.v1.Trajectory` message as a validated WorkerTrajectory (RecordError if broken)."""
    from google.protobuf import json_format

    light = type(message)()
    light.CopyFrom(message)
    for name in _BULK:
        light.ClearField(name)
    data = json_format.MessageToDict(
        light, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for name in _BULK:
        data[name] = list(getattr(message, name))
    stop = str(data.get("stop_reason", ""))
    data["stop_reason"] = (
        stop.removeprefix(_STOP_PREFIX).lower() if stop.startswith(_STOP_PREFIX) else "error"
    )
    if data["stop_reason"] not in STOP_REASONS:  # STOP_REASON_UNSPECIFIED from an old or broken worker
        data["stop_reason"] = "error"
    return validate_trajectory(data, vocab_size=vocab_size)


def trajectory_to_proto(trajectory: WorkerTrajectory, message_type: Any) -> Any:
    """A WorkerTrajectory as a `bcstack.v1.Trajectory` message (`message_type` is the class)."""
    from google.protobuf import json_format

    data = trajectory.model_dump(mode="json", exclude=set(_BULK))
    data["stop_reason"] = _STOP_PREFIX + trajectory.stop_reason.upper()
    message = json_format.ParseDict(data, message_type())
    for name in _BULK:
        getattr(message, name).extend(getattr(trajectory, name))
    return message


# --- reading for training: keep what is sound, say what is not -------------------------------------


class TrajectoryRejection(_Model):
    """A worker trajectory of a record that broke an invariant, with the one-line reason."""

    index: int
    worker_episode_id: str
    reason: str


def load_lenient(
    data: Mapping[str, Any], *, vocab_size: int | None = None
) -> tuple[EpisodeRecord, list[TrajectoryRejection]]:
    """A record whose broken worker trajectories are set aside instead of failing the whole record.

    Each worker trajectory is validated on its own; a broken one becomes None in the returned
    record and is listed as a `TrajectoryRejection` (a failed branch, None already, is not). The
    rest of the record must be sound: RecordError otherwise.
    """
    if not isinstance(data, Mapping):
        raise RecordError(f"an episode record is a JSON object, not {type(data).__name__}")
    workers = data.get("workers") or []
    if not isinstance(workers, list):
        raise RecordError(f"episode {data.get('episode_id', '?')}: workers is not a list")
    kept: list[Any] = []
    rejected: list[TrajectoryRejection] = []
    for index, worker in enumerate(workers):
        trajectory = worker.get("trajectory") if isinstance(worker, Mapping) else None
        if trajectory is not None:
            try:
                validate_trajectory(trajectory, vocab_size=vocab_size)
            except RecordError as exc:
                worker_id = str(worker.get("episode_id") or f"#{index}")
                rejected.append(
                    TrajectoryRejection(index=index, worker_episode_id=worker_id, reason=str(exc))
                )
                worker = {**worker, "trajectory": None}
        kept.append(worker)
    return EpisodeRecord.load({**data, "workers": kept}, vocab_size=vocab_size), rejected
