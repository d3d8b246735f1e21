"""One worker episode, from a task to a finished trajectory (the worker sidecar's core).

The loop, per assistant turn:

1. ask the budget whether the turn may start and with how many new tokens
   (``max_new_tokens = min(per-turn cap, budget left)``, seed 001: 4,096 / 24,576);
2. generate token-in-token-out through the engine (SGLang ``/generate`` with ``input_ids`` and
   ``return_logprob``), so the trajectory holds the exact ids the model produced and their
   rollout log-probs;
3. parse the function calls (shared protocol parser) and run them: ``search`` and
   ``open_page`` against the retrieval service, ``finish`` ends the episode (a finish before
   any search is voided, or bounced once when it matches the gold answer: FoldAgent's
   no-search guard);
4. append the observation as the next user message. The chat template (Qwen3 keep-thinking)
   is append-only, so the tokens appended are exactly the template's text between the end of
   the assistant turn and the next generation prompt; a turn cut by ``max_new_tokens`` gets
   its ``<|im_end|>`` appended first (loss mask 0, like every token not generated).

The episode stops on ``finish`` (an answer), ``budget`` (24,576 tokens counting prompt,
generations and observations), ``turns`` (40), ``context`` (the server's window) or
``error`` (the engine or retrieval failing for good). A runtime STOP gate, off by default,
is consulted between turns: it may add a message asking the model to answer now.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from core import protocol as p
from core.budget import TEMPERATURE, TOP_P, BudgetLimits, StopReason, TurnGrant, WorkerBudget
from core.chat_template import render_chat
from core.records import (
    EVENT_FINISH_WITHOUT_SEARCH,
    EVENT_FINISH_WITHOUT_SEARCH_BOUNCED,
    ToolCall,
    TurnSpan,
    VersionSpan,
    WorkerTrajectory,
)
from services.worker.retrieval_client import RetrievalFailed, ToolInputRejected

IM_END = "<|im_end|>"
# Trajectory.events (core.records): the no-search guard voided an answer given before any search
# (no reward), or bounced one that matched the gold answer (FoldAgent's must-search message).


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, token: str) -> int: ...


@dataclass(frozen=True)
class ProtocolSettings:
    """How calls are read and observations rendered; the defaults are what a FoldAgent-trained
    worker expects, with the deliberate departures of docs/guide/worker.md, "Worker protocol:
    fidelity settings" (each one switch away from upstream's behaviour)."""

    search_k: int = 50  # results asked of the retrieval service (FoldAgent asks 50, shows topk)
    default_topk: int = p.DEFAULT_TOPK
    max_topk: int = p.MAX_TOPK
    snippet_words: int = p.SNIPPET_WORDS
    seen_snippet_words: int = p.SEEN_SNIPPET_WORDS
    page_words: int = p.PAGE_WORDS
    reflection_nudge: bool = True
    resubmit_empty_finish: bool = True
    no_search_guard: bool = True  # upstream: a finish before any search is voided or bounced once
    native_tool_calls: bool = True  # upstream: Qwen3 <tool_call> JSON and <answer> blocks accepted
    # Departures (upstream: the opposite value).
    strip_call_whitespace: bool = True
    ignore_calls_in_reasoning: bool = True
    unknown_function_replaces: bool = False
    report_missing_page: bool = True
    zero_topk_is_default: bool = True
    native_string_is_one: bool = True

    def parse(self, reply: str) -> list[p.FunctionCall]:
        return p.parse_calls(
            reply,
            native=self.native_tool_calls,
            strip_whitespace=self.strip_call_whitespace,
            ignore_reasoning=self.ignore_calls_in_reasoning,
            native_string_is_one=self.native_string_is_one,
        )


@dataclass(frozen=True)
class Sampling:
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    top_k: int | None = None
    seed: int | None = None  # the episode's: turn n samples with derive_seed(seed, "turn", n)


@dataclass
class TurnRecord:
    prompt_start: int  # where the tokens appended before this generation begin
    gen_start: int
    gen_end: int
    weight_version: str
    finish_reason: str
    # (version, start, end) over this turn's tokens when a reload swapped weights mid-turn, else ().
    version_spans: tuple[tuple[str, int, int], ...] = ()
    engine_s: float = 0.0  # waiting for /generate
    retrieval_s: float = 0.0  # waiting for the retrieval service
    total_s: float = 0.0  # the whole turn: generation, tools, observation, bookkeeping

    @property
    def overhead_s(self) -> float:
        """The worker's own time in the turn: parsing, rendering, tokenizing, accounting."""
        return max(0.0, self.total_s - self.engine_s - self.retrieval_s)

    @property
    def generated_tokens(self) -> int:
        return self.gen_end - self.gen_start


@dataclass
class ToolCallRecord:
    turn: int
    name: str
    params: dict[str, str]
    outcome: str  # ok | error | unknown_tool | missing_parameter | not_found | no_search | voided
    error: str = ""
    docids: list[str] = field(default_factory=list)  # documents the call showed (search hits, opened pages)


@dataclass
class Trajectory:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    stop_reason: str = ""
    error: str = ""
    events: list[str] = field(default_factory=list)  # protocol guards that fired, in order (EVENT_*)

    def extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] = ()) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.rollout_logprobs.extend(logprobs)


@dataclass
class EpisodeResult:
    episode_id: str
    status: str  # the stop reason
    answer: str
    explanation: str
    confidence: str
    trajectory: Trajectory
    messages: list[dict[str, str]]
    prompt_tokens: int
    completion_tokens: int
    observation_tokens: int
    seconds: float

    @property
    def turns(self) -> int:
        return len(self.trajectory.turns)

    @property
    def tokens_used(self) -> int:
        return len(self.trajectory.token_ids)

    def worker_trajectory(self) -> WorkerTrajectory:
        """The episode as the typed record that leaves the worker (`core.records`), validated:
        the runner's invariants (mask, log-probs, contiguous turns) are checked once more here."""
        t = self.trajectory
        return WorkerTrajectory(
            token_ids=t.token_ids,
            loss_mask=t.loss_mask,
            rollout_logprobs=t.rollout_logprobs,
            turns=[
                TurnSpan(
                    prompt_start=r.prompt_start,
                    gen_start=r.gen_start,
                    gen_end=r.gen_end,
                    generated_tokens=r.generated_tokens,
                    weight_version=r.weight_version,
                    finish_reason=r.finish_reason,
                    version_spans=[VersionSpan(version=v, start=a, end=b) for v, a, b in r.version_spans],
                )
                for r in t.turns
            ],
            tool_calls=[ToolCall(**dataclasses.asdict(c)) for c in t.tool_calls],
            stop_reason=self.status,
            tokens_used=self.tokens_used,
            turns_used=self.turns,
            error=t.error,
            events=t.events,
        )


@dataclass
class _EpisodeState:
    """What the tools remember across the turns of one episode."""

    gold_answer: str | None
    seen: set[str] = field(default_factory=set)  # docids shown in search results
    searches: int = 0  # search calls made, failed ones too (upstream counts every one)
    bounced: bool = False


GateFn = Callable[[list[dict[str, str]], WorkerBudget], Awaitable[str | None] | str | None]


class EpisodeRunner:
    """Runs episodes against one engine and one retrieval service; safe to share across tasks."""

    def __init__(
        self,
        engine: Any,  # core.engine_client.EngineClient (or a test double with .generate)
        retrieval: Any,  # services.worker.retrieval_client.RetrievalClient
        tokenizer: Tokenizer,
        *,
        limits: BudgetLimits | None = None,
        sampling: Sampling | None = None,
        protocol: ProtocolSettings | None = None,
        stop_gate: GateFn | None = None,
        on_turn: Callable[[TurnRecord], None] | None = None,
        on_tool_call: Callable[[ToolCallRecord], None] | None = None,
    ) -> None:
        self.engine = engine
        self.retrieval = retrieval
        self.tokenizer = tokenizer
        self.limits = limits or BudgetLimits()
        self.sampling = sampling or Sampling()
        self.protocol = protocol or ProtocolSettings()
        self.stop_gate = stop_gate
        self.on_turn = on_turn
        self.on_tool_call = on_tool_call
        self.eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def run(
        self,
        messages: Sequence[dict[str, str]],
        *,
        episode_id: str = "",
        limits: BudgetLimits | None = None,
        sampling: Sampling | None = None,
        gold_answer: str | None = None,
    ) -> EpisodeResult:
        """Run one episode; ``gold_answer`` (optional) lets the no-search guard bounce a right answer."""
        start = time.perf_counter()
        limits = limits or self.limits
        sampling = sampling or self.sampling
        convo = [dict(m) for m in messages]
        traj = Trajectory()
        budget = WorkerBudget(limits)
        state = _EpisodeState(gold_answer)
        finish: p.FinishAction | None = None

        prompt_text = render_chat(convo, add_generation_prompt=True)
        prompt_ids = self._encode(prompt_text)
        traj.extend(prompt_ids, 0)
        stop = budget.start(len(prompt_ids))
        prompt_start = 0
        while stop is None:
            grant = budget.before_turn()
            if isinstance(grant, StopReason):
                stop = grant
                break
            turn_start = time.perf_counter()
            record, reply, stop = await self._generate(traj, grant, sampling, prompt_start)
            if record is None:
                break
            budget.add_generation(record.generated_tokens, grant)
            convo.append({"role": "assistant", "content": reply})
            turn_observation, finish, stop = await self._act(reply, record, traj, state)
            if stop is not None:
                self._turn_done(record, turn_start)
                break
            observation = turn_observation.text()
            # The gate decides with the latest observation in view: "is the evidence in hand?"
            gate_message = await self._gate([*convo, {"role": "user", "content": observation}], budget)
            if gate_message:
                observation = f"{observation}\n\n{gate_message}" if observation else gate_message
            # A turn cut by max_new_tokens has no <|im_end|> yet. (SGLang reports "length" even when the
            # last allowed token was the EOS, so look at the token, not the finish reason.)
            ended = traj.token_ids[record.gen_end - 1] == self.eos_id if record.generated_tokens else False
            glue = self._glue(convo, observation, cut=not ended)
            stop = budget.add_observation(len(glue))
            if stop is None:
                convo.append({"role": "user", "content": observation})
                prompt_start = len(traj.token_ids)
                traj.extend(glue, 0)
            self._turn_done(record, turn_start)
        traj.stop_reason = str(stop)
        gen = sum(t.generated_tokens for t in traj.turns)
        return EpisodeResult(
            episode_id=episode_id,
            status=str(stop),
            answer=finish.answer if finish else "",
            explanation=finish.explanation if finish else "",
            confidence=finish.confidence if finish else "",
            trajectory=traj,
            messages=convo,
            prompt_tokens=len(prompt_ids),
            completion_tokens=gen,
            observation_tokens=len(traj.token_ids) - len(prompt_ids) - gen,
            seconds=time.perf_counter() - start,
        )

    def _turn_done(self, record: TurnRecord, turn_start: float) -> None:
        record.total_s = time.perf_counter() - turn_start
        if self.on_turn:
            self.on_turn(record)

    async def _generate(
        self, traj: Trajectory, grant: TurnGrant, sampling: Sampling, prompt_start: int
    ) -> tuple[TurnRecord | None, str, StopReason | None]:
        from core.engine_client import EngineError, EngineUnavailable, derive_seed

        # An episode's seed gives each turn its own (a turn replaying the first turn's uniforms would
        # tie the draws of one episode together).
        seed = None if sampling.seed is None else derive_seed(sampling.seed, "turn", len(traj.turns))
        t0 = time.perf_counter()
        try:
            out = await self.engine.generate(
                traj.token_ids,
                max_new_tokens=grant.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=seed,
                return_logprob=True,
            )
        except EngineUnavailable as e:
            traj.error = f"engine unavailable: {e}"
            return None, "", StopReason.ERROR
        except EngineError as e:
            traj.error = f"engine error: {e}"
            context = getattr(e, "status", None) == 400 and "context" in str(e).lower()
            return None, "", StopReason.CONTEXT if context else StopReason.ERROR
        ids = list(out.output_ids)
        if len(ids) > grant.max_new_tokens or len(out.logprobs) != len(ids):
            traj.error = (
                f"engine returned {len(ids)} tokens with {len(out.logprobs)} log-probs "
                f"for max_new_tokens={grant.max_new_tokens}"
            )
            return None, "", StopReason.ERROR
        gen_start = len(traj.token_ids)
        traj.extend(ids, 1, out.logprobs)
        record = TurnRecord(
            prompt_start=prompt_start,
            gen_start=gen_start,
            gen_end=len(traj.token_ids),
            weight_version=str(out.weight_version or ""),
            finish_reason=out.finish_reason,
            version_spans=out.version_spans,
            engine_s=time.perf_counter() - t0,
        )
        traj.turns.append(record)
        content_ids = ids[:-1] if ids and ids[-1] == self.eos_id else ids
        reply = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        return record, reply, None

    def _glue(self, convo: list[dict[str, str]], observation: str, *, cut: bool) -> list[int]:
        """The tokens between the end of the last generation and the next generation prompt."""
        before = render_chat(convo)  # ... <|im_start|>assistant\n{reply}<|im_end|>\n
        after = render_chat([*convo, {"role": "user", "content": observation}], add_generation_prompt=True)
        if not after.startswith(before):  # the template is append-only; anything else is a bug
            raise AssertionError("chat template is not append-only")
        tail = after[before.rindex(IM_END) + len(IM_END) :]
        return ([self.eos_id] if cut else []) + self._encode(tail)

    async def _gate(self, convo: list[dict[str, str]], budget: WorkerBudget) -> str | None:
        if self.stop_gate is None:
            return None
        verdict = self.stop_gate(convo, budget)
        if hasattr(verdict, "__await__"):
            verdict = await verdict  # type: ignore[misc]
        return verdict or None

    async def _act(
        self, reply: str, record: TurnRecord, traj: Trajectory, state: _EpisodeState
    ) -> tuple[p.TurnObservation, p.FinishAction | None, StopReason | None]:
        """Run the turn's calls; (the observation, the finish action if any, a stop reason)."""
        turn = len(traj.turns) - 1
        ps = self.protocol
        obs = p.TurnObservation(
            reflection_nudge=ps.reflection_nudge, unknown_function_replaces=ps.unknown_function_replaces
        )
        calls = ps.parse(reply)
        if not calls:
            obs.stand_alone(p.NO_CALL_ERROR)
            return obs, None, None
        for call in calls:
            action = p.validate_call(
                call,
                p.WORKER_TOOLS,
                default_topk=ps.default_topk,
                max_topk=ps.max_topk,
                zero_topk_is_default=ps.zero_topk_is_default,
            )
            rec = ToolCallRecord(turn, call.name, dict(call.params), "ok")
            traj.tool_calls.append(rec)
            if call.name == "search":
                state.searches += 1
            try:
                if isinstance(action, p.CallError):
                    if call.name not in p.WORKER_TOOLS:
                        rec.outcome, rec.error = "unknown_tool", obs.add_unsupported(call.name)
                    else:
                        rec.outcome, rec.error = "missing_parameter", action.message
                        obs.add(action.message)
                elif isinstance(action, p.FinishAction):
                    return self._finish(action, rec, traj, state, obs)
                elif isinstance(action, p.SearchAction):
                    t0 = time.perf_counter()
                    pages = await self.retrieval.search(
                        action.query, ps.search_k, snippet_words=ps.snippet_words
                    )
                    record.retrieval_s += time.perf_counter() - t0
                    shown = p.render_search_results(
                        action.query,
                        pages,
                        state.seen,
                        action.topk,
                        snippet_words=ps.snippet_words,
                        seen_snippet_words=ps.seen_snippet_words,
                    )
                    obs.add(shown)
                    # what the model saw, for evaluation run files (BrowseComp-Plus retrieved_docids)
                    rec.docids = [hit.docid for hit in p.parse_observation(shown).hits]
                elif isinstance(action, p.OpenPageAction):
                    t0 = time.perf_counter()
                    pages = await self.retrieval.open(action.docid, action.url)
                    record.retrieval_s += time.perf_counter() - t0
                    block = p.render_open_result(
                        pages,
                        action.docid,
                        action.url,
                        page_words=ps.page_words,
                        report_missing=ps.report_missing_page,
                    )
                    obs.add(block)
                    rec.docids = [page.docid for page in pages]
                    if not pages:
                        rec.outcome, rec.error = "not_found", block if ps.report_missing_page else ""
            except ToolInputRejected as e:
                rec.outcome, rec.error = "error", f"[Error] {e}"
                obs.add(rec.error)
            except RetrievalFailed as e:
                rec.outcome, rec.error = "error", str(e)
                traj.error = str(e)
                return obs, None, StopReason.ERROR
            finally:
                if self.on_tool_call:
                    self.on_tool_call(rec)
        return obs, None, None

    def _finish(
        self,
        action: p.FinishAction,
        rec: ToolCallRecord,
        traj: Trajectory,
        state: _EpisodeState,
        obs: p.TurnObservation,
    ) -> tuple[p.TurnObservation, p.FinishAction | None, StopReason | None]:
        """A finish ends the episode unless it is bounced (an empty answer; a right answer given
        before any search, once); given before any search, its answer is voided (no reward)."""
        ps = self.protocol
        if not action.answer.strip() and ps.resubmit_empty_finish:
            rec.outcome, rec.error = "error", p.EMPTY_FINISH_RESUBMIT
            obs.stand_alone(p.EMPTY_FINISH_RESUBMIT)
            return obs, None, None
        if not ps.no_search_guard:
            return obs, action, StopReason.FINISH
        verdict = p.no_search_verdict(
            action.answer, state.gold_answer, searched=state.searches > 0, may_bounce=not state.bounced
        )
        if verdict == "bounce":
            state.bounced = True
            traj.events.append(EVENT_FINISH_WITHOUT_SEARCH_BOUNCED)
            rec.outcome, rec.error = "no_search", p.NO_SEARCH_BOUNCE
            obs.stand_alone(p.NO_SEARCH_BOUNCE)
            return obs, None, None
        if verdict == "void":
            traj.events.append(EVENT_FINISH_WITHOUT_SEARCH)
            rec.outcome = "voided"
            action = replace(action, answer="")
        return obs, action, StopReason.FINISH
