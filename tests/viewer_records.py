"""Known episode records for the episode viewer's tests, built with the core's typed records.

    tokenizer_dir = build_tokenizer(tmp_path / "tok")   # a small Qwen3-style tokenizer
    record = known_record(encode)                        # encode: text -> token ids with that tokenizer
    seed_store(path, [record, plain_record("e2"), ...])  # a records SQLite file as the gateway writes it

The known record's worker trajectory is made of real token ids: its text is rendered with the Qwen3
keep-thinking chat template and encoded by the tokenizer, so decoding it gives back exactly the
texts below (what the tests look for on the pages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.chat_template import render_chat
from core.record_store import SqliteRecordStore
from core.records import (
    CoordinatorLog,
    CoordinatorTurn,
    EndpointDetail,
    EpisodeGrades,
    EpisodeLimits,
    EpisodeRecord,
    ToolCall,
    TurnSpan,
    Usage,
    WorkerRecord,
    WorkerReport,
    WorkerTrajectory,
)

QUESTION = "In what year was the Boshin Library of Letters founded?"
GOLD = "1761"
SYSTEM = "You are a research worker. Search the collection, open pages, then finish."
TASK = "Find the founding year of the Boshin Library of Letters."
LONG_PAGE = "\n".join(
    f"Line {i}: the Boshin Library of Letters kept ledgers of every visitor since its founding."
    for i in range(40)
)


@dataclass(frozen=True)
class WorkerTurnText:
    thinking: str
    call: str  # the FoldAgent call the model wrote
    observation: str | None  # the tool result that came back (None: the episode ended)
    tool: ToolCall


WORKER_TURNS = (
    WorkerTurnText(
        "I should search for the library first.",
        "<function=search>\n<parameter=query>Boshin Library of Letters</parameter>\n"
        "<parameter=topk>5</parameter>\n</function>",
        '[Search Results for "Boshin Library of Letters"]\n--- #1: 3302---\ndocid: 3302\n'
        "url: https://toy/3302\ncontent: The Boshin Library of Letters was founded in 1761.",
        ToolCall(
            turn=0,
            name="search",
            params={"query": "Boshin Library of Letters", "topk": "5"},
            docids=["3302", "1428"],
        ),
    ),
    WorkerTurnText(
        "The first hit looks right; open it.",
        "<function=open_page>\n<parameter=docid>3302</parameter>\n</function>",
        "[Opened Page Content]\ndocid: 3302\nurl: https://toy/3302\ncontent: " + LONG_PAGE,
        ToolCall(turn=1, name="open_page", params={"docid": "3302"}, docids=["3302"]),
    ),
    WorkerTurnText(
        "Try a page that is not there.",
        "<function=open_page>\n<parameter=docid>99999</parameter>\n</function>",
        "No document with docid 99999.",
        ToolCall(
            turn=2, name="open_page", params={"docid": "99999"}, outcome="not_found", error="no such docid"
        ),
    ),
    WorkerTurnText(
        "The page says 1761.",
        "<function=finish>\n<parameter=answer>1761</parameter>\n"
        "<parameter=explanation>Founded in 1761 [3302].</parameter>\n"
        "<parameter=confidence>90%</parameter>\n</function>",
        None,
        ToolCall(
            turn=3,
            name="finish",
            params={"answer": "1761", "explanation": "Founded in 1761 [3302].", "confidence": "90%"},
        ),
    ),
)
COORDINATOR_SYSTEM = "You are the coordinator. Delegate research with branch, then finish."
COORDINATOR_TURN_TEXTS = (
    "<think>\nOne worker should find the year.\n</think>\n\n<function=branch>\n"
    "<parameter=description>Find the year</parameter>\n<parameter=prompt>"
    + TASK
    + "</parameter>\n</function>",
    "<think>\nThe worker found 1761.\n</think>\n\n<function=finish>\n<parameter=answer>1761</parameter>\n"
    "<parameter=explanation>The worker's evidence [3302].</parameter>\n"
    "<parameter=confidence>90%</parameter>\n</function>",
)


def training_texts() -> list[str]:
    """What the test tokenizer is trained on (so the known texts take few tokens)."""
    texts = [QUESTION, SYSTEM, TASK, LONG_PAGE, *COORDINATOR_TURN_TEXTS]
    for t in WORKER_TURNS:
        texts += [t.thinking, t.call, t.observation or ""]
    return texts


def build_tokenizer(out: Path) -> Path:
    """`out/tokenizer.json`: a small byte-level BPE with Qwen3's added tokens (the dev kit's list).

    Built with `tokenizers` alone: the viewer reads nothing else, and the dev kit's full build
    (`train_tokenizer`, through transformers) costs seconds more of the browser test's start."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    from devkit.modelkit.tokenizer import CONTROL_TOKENS, SPECIAL_TOKENS

    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(training_texts() * 2, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in CONTROL_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def worker_trajectory(
    encode: Callable[[str], list[int]], weight_versions: tuple[str, ...]
) -> WorkerTrajectory:
    """The known worker episode as token ids: prompt, then per turn its generation (loss mask 1)
    and the observation that follows it (mask 0), as the worker's append-only rendering lays them."""
    prompt = render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}], add_generation_prompt=True
    )
    ids, mask = list(encode(prompt)), [0] * len(encode(prompt))
    turns = []
    for k, t in enumerate(WORKER_TURNS):
        prompt_start = turns[-1].gen_end if turns else 0
        gen_start = len(ids)
        generated = encode(f"<think>\n{t.thinking}\n</think>\n\n{t.call}<|im_end|>")
        ids += generated
        mask += [1] * len(generated)
        turns.append(
            TurnSpan(
                prompt_start=prompt_start,
                gen_start=gen_start,
                gen_end=len(ids),
                generated_tokens=len(generated),
                weight_version=weight_versions[min(k, len(weight_versions) - 1)],
                finish_reason="stop",
            )
        )
        if t.observation is not None:
            observed = encode(f"\n<|im_start|>user\n{t.observation}<|im_end|>\n<|im_start|>assistant\n")
            ids += observed
            mask += [0] * len(observed)
    return WorkerTrajectory(
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=[-0.25] * sum(mask),
        turns=turns,
        tool_calls=[t.tool for t in WORKER_TURNS],
        stop_reason="finish",
        tokens_used=len(ids),
        turns_used=len(turns),
    )


def known_record(
    encode: Callable[[str], list[int]],
    episode_id: str = "known-episode",
    *,
    weight_versions: tuple[str, ...] = ("v3", "v4"),
    correct: bool | None = True,
    created_at: float = 1_790_000_000.0,
) -> EpisodeRecord:
    """One finished episode: two coordinator turns, one branch whose worker ran the four WORKER_TURNS
    (reloaded from v3 to v4 after its first turn), judged and with a contribution score."""
    trajectory = worker_trajectory(encode, weight_versions)
    report = "[Worker Report]\ntask: Find the year\nstatus: finish\nanswer: 1761\nconfidence: 90%"
    return EpisodeRecord(
        episode_id=episode_id,
        question_id="q-1761",
        group_id="g-known",
        question=QUESTION,
        gold_answer=GOLD,
        status="finish",
        answer="1761",
        explanation="The worker's evidence [3302].",
        confidence="90%",
        endpoint="default",
        endpoint_detail=EndpointDetail(model="scripted-coordinator", base_url="http://127.0.0.1:1/v1"),
        created_at=created_at,
        finished_at=created_at + 2.5,
        seconds=2.5,
        limits=EpisodeLimits(max_turns=16, max_branches=32, max_branches_per_turn=8, wall_time_seconds=3600),
        coordinator=CoordinatorLog(
            messages=[
                {"role": "system", "content": COORDINATOR_SYSTEM},
                {"role": "user", "content": f"Question: {QUESTION}"},
                {"role": "assistant", "content": COORDINATOR_TURN_TEXTS[0]},
                {"role": "user", "content": report},
                {"role": "assistant", "content": COORDINATOR_TURN_TEXTS[1]},
            ],
            turns=[
                CoordinatorTurn(
                    turn=0, seconds=0.4, calls=["branch"], workers_seconds=1.8, total_seconds=2.2
                ),
                CoordinatorTurn(turn=1, seconds=0.3, calls=["finish"], total_seconds=0.3),
            ],
        ),
        workers=[
            WorkerRecord(
                branch=0,
                turn=0,
                description="Find the year",
                prompt=TASK,
                episode_id=f"{episode_id}.w0",
                status="finish",
                replica="127.0.0.1:50052",
                attempts=1,
                started_at=created_at + 0.4,
                seconds=1.8,
                report=WorkerReport(
                    answer="1761", explanation="Founded in 1761 [3302].", confidence="90%", raw_text=report
                ),  # fmt: skip
                usage=Usage(total_tokens=trajectory.tokens_used, turns=len(WORKER_TURNS), tool_calls=4),
                trajectory=trajectory,
                contribution=0.75,
            )
        ],
        weight_versions=sorted(set(weight_versions)),
        worker_usage=Usage(total_tokens=trajectory.tokens_used, turns=len(WORKER_TURNS), tool_calls=4),
        grades=None
        if correct is None
        else EpisodeGrades(
            correct=correct, grader_version="rule/1", extracted_final_answer="1761"
        ),  # fmt: skip
    )


def plain_record(
    episode_id: str,
    *,
    status: str = "finish",
    question_id: str = "q-1",
    group_id: str = "g-1",
    endpoint: str = "default",
    weight_versions: tuple[str, ...] = (),
    correct: bool | None = None,
    created_at: float = 1_790_000_000.0,
) -> EpisodeRecord:
    """An episode with no worker trajectory, for the list's rows and filters."""
    return EpisodeRecord(
        episode_id=episode_id,
        question_id=question_id,
        group_id=group_id,
        question="Which year?",
        status=status,
        endpoint=endpoint,
        created_at=created_at,
        finished_at=created_at + 1,
        seconds=1.0,
        weight_versions=list(weight_versions),
        grades=None if correct is None else EpisodeGrades(correct=correct),
    )


def seed_store(path: Path, records: list[EpisodeRecord]) -> Path:
    with SqliteRecordStore(path) as store:
        for record in records:
            store.put(record.dump())
    return path
