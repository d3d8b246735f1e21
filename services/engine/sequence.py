"""One request while it runs: its tokens, log-probs, finish rule and the response it turns into.

The finish rule is SGLang's `Req.check_finished` in its order: the `max_new_tokens` limit
first (so a stop token drawn as the last allowed token still reports `length`), then, unless
`ignore_eos`, a stop token (the model's EOS ids or `stop_token_ids`, matched = the id), then
the stop strings (matched = the string), looked for in the decoded tail of the output.

Text is decoded the way SGLang's detokenizer does it: special tokens skipped by default, the
matched stop token or stop string trimmed off unless `no_stop_trim`. `output_ids` keep every
generated token, the stop token included, and `completion_tokens` counts it, so the log-prob
list has one entry per output id.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.engine import protocol as proto

if TYPE_CHECKING:
    import torch


class Detokenizer:
    """Incremental decoding for streamed text (a token may end mid-character: hold it back)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # tokens before the window re-decoded each time
        self._read = 0  # tokens whose text is already in self.text

    def push(self, ids: list[int]) -> str:
        """The text of `ids` (the whole output so far) that is safe to show."""
        prefix_text = self.tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=self.skip)
        new_text = self.tokenizer.decode(ids[self._prefix :], skip_special_tokens=self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(ids)
        return self.text


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. Mutated only by the scheduler (its step thread or its loop)."""

    request: proto.GenerateRequest
    prompt_ids: list[int]
    eos_token_ids: frozenset[int]
    tokenizer: Any
    generator: torch.Generator | None = None
    stop_token_lengths: int = 0  # longest stop string, in tokens (how much of the tail to decode)
    created: float = field(default_factory=time.time)
    created_perf: float = field(default_factory=time.perf_counter)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, Any] | None = None
    first_token_perf: float | None = None
    finished_perf: float | None = None
    weight_version: str = ""
    # (the version that made them, output tokens so far) at each weight swap while this ran
    # (SGLang's WeightVersionEvent); the answer reports them as spans.
    version_events: list[tuple[str, int]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    model_state: Any = None  # the token model's per-sequence state (a KV cache, a script)
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    _stream_text: Detokenizer | None = None

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def sampling(self) -> proto.SamplingParams:
        return self.request.sampling

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def banned_tokens(self) -> frozenset[int]:
        """Tokens that may not be drawn yet: the stop tokens, until min_new_tokens are out."""
        if len(self.output_ids) >= self.sampling.min_new_tokens:
            return frozenset()
        return self.eos_token_ids | self.sampling.stop_token_ids

    def append(self, token: int, logprob: float) -> None:
        """Add one generated token and apply the finish rule."""
        if self.first_token_perf is None:
            self.first_token_perf = time.perf_counter()
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        params = self.sampling
        if len(self.output_ids) >= params.max_new_tokens:
            self.finish(proto.finish_length(params.max_new_tokens))
        elif not params.ignore_eos and (token in self.eos_token_ids or token in params.stop_token_ids):
            self.finish(proto.finish_stop(token))
        elif params.stop:
            tail_ids = self.output_ids[-(self.stop_token_lengths + 1) :]
            tail = self.tokenizer.decode(tail_ids, skip_special_tokens=params.skip_special_tokens)
            for stop in params.stop:
                if stop in tail:
                    self.finish(proto.finish_stop(stop))
                    break

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_perf = time.perf_counter()

    async def wait_finished(self) -> None:
        while not self.finished:
            await self.updated.wait()
            self.updated.clear()

    # --- responses -------------------------------------------------------------------------------

    def text(self) -> str:
        """The output text; trimmed of the matched stop token/string once finished."""
        params = self.sampling
        if not self.finished:
            if self._stream_text is None:
                self._stream_text = Detokenizer(self.tokenizer, params.skip_special_tokens)
            return self._stream_text.push(self.output_ids)
        ids = self.output_ids
        matched = self.finish_reason.get("matched") if self.finish_reason else None
        trim = not params.no_stop_trim and self.finish_reason and self.finish_reason["type"] == "stop"
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if trim and isinstance(matched, str):
            cut = text.find(matched)
            if cut != -1:
                text = text[:cut]
        return text

    def response(self) -> dict[str, Any]:
        """The `/generate` answer (or one streamed chunk) as SGLang shapes it."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
        }
        if self.request.return_logprob:
            texts = self.request.return_text_in_logprobs
            start = self.request.logprob_start_len
            input_ids = self.prompt_ids[start:] if start >= 0 else []
            meta["input_token_logprobs"] = proto.logprob_triples(
                self.input_logprobs or [],
                input_ids if self.input_logprobs else [],
                self._token_texts(input_ids) if texts and self.input_logprobs else None,
            )
            meta["output_token_logprobs"] = proto.logprob_triples(
                self.output_logprobs, self.output_ids, self._token_texts(self.output_ids) if texts else None
            )
        if self.finished:
            # SGLang 0.5.19 `compute_weight_version_spans` / `add_weight_versions_to_meta_info`.
            spans = self.version_spans()
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if self.finished and self.finished_perf is not None:
            meta["e2e_latency"] = self.finished_perf - self.created_perf
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": meta}

    def version_spans(self) -> list[dict[str, Any]]:
        """Which weight version made which output tokens: `{version, start, end}`, in order."""
        n = len(self.output_ids)
        spans: list[dict[str, Any]] = []
        for version, end in [*self.version_events, (self.weight_version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return [s for s in spans if s["start"] < n or s["start"] == 0]

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]
