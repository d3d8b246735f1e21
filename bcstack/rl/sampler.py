"""Which questions the RL loop asks next: groups drawn from the training set in a seeded order.

Each group is one question asked `group_size` times (seed 000: 8 prompts x 8 episodes per update).
The order is a seeded permutation of the question set, drawn anew each pass (epoch), so a run is
reproducible and a resumed run continues where it stopped: `state()` is what a checkpoint keeps,
`GroupSampler.restore` takes it back.

Ids are deterministic: group `g000017` of the run, episode `{run}.{generation}-g000017-e3`. The
generation counts the run's starts (1, then +1 per `--resume`): the gateway answers a repeated
episode id with the recorded result, so a resumed run must not reuse the ids of rollouts it
discarded, which a dead trainer's policy generated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bcstack.evaluation.loaders import EvalQuestion


@dataclass(frozen=True)
class Group:
    index: int  # 0-based over the whole run, in the order groups were drawn
    question: EvalQuestion

    @property
    def group_id(self) -> str:
        return f"g{self.index:06d}"

    def episode_ids(self, run_id: str, generation: int, size: int) -> list[str]:
        return [f"{run_id}.{generation}-{self.group_id}-e{i}" for i in range(size)]


class GroupSampler:
    def __init__(self, questions: Sequence[EvalQuestion], seed: int = 0) -> None:
        if not questions:
            raise ValueError("the training question set is empty")
        self.questions = list(questions)
        self.seed = seed
        self.drawn = 0  # groups handed out so far

    def _question(self, index: int) -> EvalQuestion:
        epoch, offset = divmod(index, len(self.questions))
        order = list(range(len(self.questions)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return self.questions[order[offset]]

    def next(self) -> Group:
        group = Group(self.drawn, self._question(self.drawn))
        self.drawn += 1
        return group

    def group(self, index: int) -> Group:
        """The group with this index (drawn before, or to come): the same question every time."""
        return Group(index, self._question(index))

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "drawn": self.drawn, "questions": len(self.questions)}

    @classmethod
    def restore(cls, questions: Sequence[EvalQuestion], state: dict[str, Any]) -> GroupSampler:
        sampler = cls(questions, seed=int(state["seed"]))
        if int(state.get("questions", len(questions))) != len(questions):
            raise ValueError(
                f"the checkpoint's sampler was over {state['questions']} questions, this question set "
                f"has {len(questions)}: resume with the same --questions"
            )
        sampler.drawn = int(state["drawn"])
        return sampler
