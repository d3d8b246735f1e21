"""SGLang's native HTTP wire format, server side: request parsing, finish reasons, responses.

Matched against the SGLang source (sgl-project/sglang; see `services/engine/__init__.py` for the
pinned file versions):

- `GenerateReqInput` (srt/managers/io_struct.py): one of `text` | `input_ids`, `sampling_params`,
  `return_logprob` (default false), `logprob_start_len` (default -1: output tokens only),
  `top_logprobs_num`, `return_text_in_logprobs`, `stream`, `rid` (default a uuid4 hex).
- `SamplingParams` (srt/sampling/sampling_params.py): names, defaults (`max_new_tokens` 128,
  `temperature` 1.0, `top_p` 1.0, `top_k` -1 = whole vocabulary, `min_p` 0) and the wording of
  `verify()`'s errors. `temperature` below 1e-6 means greedy (SGLang turns it into top_k=1), and
  the per-request seed is `sampling_params.sampling_seed`.
- Length checks and their wording (0.5.19 `TokenizerManager._validate_one_request`): a prompt of
  `context_len` tokens or more is refused, and prompt + `max_new_tokens` only *above*
  `context_len` (equal is allowed); the scheduler then trims `max_new_tokens` to
  `max_req_len - prompt - 1` with `max_req_len = context_len - 1` (`Scheduler.init_req_max_new_tokens`,
  `TpModelWorker`), so a request that asks for exactly what is left gets two tokens less.
- Errors: HTTP 400 with `{"error": {"message": ...}}` (`http_server._create_error_response`).
- `meta_info` (`TokenizerManager._handle_batch_output`): `id`, `finish_reason`, `prompt_tokens`,
  `weight_version`, `completion_tokens`, `cached_tokens`, `e2e_latency` once finished and, with
  `return_logprob`, `input_token_logprobs` / `output_token_logprobs` as `[logprob, token_id,
  text | None]` triples (text only with `return_text_in_logprobs`).
- `finish_reason` (srt/managers/schedule_batch.py `FINISH_*.to_json`): `{"type": "stop",
  "matched": <token id | stop string>}`, `{"type": "length", "length": N}`,
  `{"type": "abort", "message": ...}`; null while a streamed request is running.

What the CPU engine does not do is refused with a 400 naming the field rather than ignored:
batches (lists of prompts), `input_embeds` and multimodal data, LoRA, penalties, grammars,
`n` > 1 and top-k log-probs.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens
SAMPLING_EPS = 1e-6  # SamplingParams: 0 <= temperature < 1e-6 means greedy
# SGLang keeps the seeds of a batch in an int64 tensor (sampling_batch_info.py, `sampling_seed`);
# a larger one crashed our engine's generator with a 500 (fuzz_http). The bound is I-JSON's (RFC
# 7493: integers a double holds exactly), so a schema tool reading the document sees the same limit.
MAX_SAMPLING_SEED = 2**53 - 1
BATCH_UNSUPPORTED = (
    "Batch requests (a list of prompts) are not supported by the CPU engine; send one prompt per request."
)

# Sampling parameters SGLang accepts and the CPU engine implements.
_SUPPORTED_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    # Accepted and ignored: they only shape how text is streamed or spaced.
    "spaces_between_special_tokens",
    "stream_interval",
}
# SGLang sampling parameters the CPU engine accepts only at their neutral value.
_NEUTRAL_SAMPLING: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# Top-level GenerateReqInput fields the CPU engine cannot honour unless absent/neutral.
_NEUTRAL_TOP_LEVEL: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "lora_path": None,
    "session_params": None,
    "custom_logit_processor": None,
    "token_ids_logprob": None,
    "top_logprobs_num": 0,
    "return_hidden_states": False,
}


class RequestError(ValueError):
    """A request SGLang would refuse with HTTP 400; `str(e)` is the message."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters of one request, validated; field names are SGLang's."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed `/generate` request (a single prompt)."""

    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True


def _is_int(value: Any) -> bool:
    """An integer as JSON (and the OpenAPI document) means it: 3 or 3.0, never true."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}.")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"{key} must be an integer, got {value!r}.")
    return int(value)


def _float(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"{key} must be a number, got {value!r}.")
    return float(value)


def parse_sampling_params(raw: Any) -> SamplingParams:
    """Validate `sampling_params` as SGLang's `SamplingParams.__post_init__` + `verify()` do.

    null values mean "the default", as in SGLang. Unknown names are refused (SGLang's
    constructor raises on them too).
    """
    if raw is None:
        return SamplingParams()
    if isinstance(raw, list):
        raise RequestError(BATCH_UNSUPPORTED)
    if not isinstance(raw, Mapping):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}.")
    for key, value in raw.items():
        if key in _SUPPORTED_SAMPLING:
            continue
        if key in _NEUTRAL_SAMPLING:
            # false == 0 in Python, not in JSON: a boolean is no penalty of 0
            if value is not None and (isinstance(value, bool) or value != _NEUTRAL_SAMPLING[key]):
                raise RequestError(f"sampling_params.{key} is not supported by the CPU engine.")
            continue
        raise RequestError(f"Unknown sampling parameter {key!r}.")

    max_new_tokens = _int(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    temperature = _float(raw, "temperature", 1.0)
    top_p = _float(raw, "top_p", 1.0)
    top_k = _int(raw, "top_k", -1)
    min_p = _float(raw, "min_p", 0.0)
    min_new_tokens = _int(raw, "min_new_tokens", 0)
    # The wording below is SamplingParams.verify()'s.
    if not math.isfinite(temperature) or temperature < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 and top_k != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if min_new_tokens < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if min_new_tokens > max_new_tokens:
        raise RequestError(
            f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}."
        )

    stop_raw = raw.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    else:
        raise RequestError("stop must be a string or a list of strings.")
    if any(s == "" for s in stop):
        raise RequestError("stop strings must not be empty.")

    ids_raw = raw.get("stop_token_ids")
    if ids_raw is None:
        stop_token_ids: frozenset[int] = frozenset()
    elif isinstance(ids_raw, list) and all(_is_int(t) for t in ids_raw):
        stop_token_ids = frozenset(int(t) for t in ids_raw)
    else:
        raise RequestError("stop_token_ids must be a list of integers.")

    seed = raw.get("sampling_seed")
    if seed is not None and not (_is_int(seed) and abs(int(seed)) <= MAX_SAMPLING_SEED):
        raise RequestError(f"sampling_seed must be an integer of magnitude at most 2**53 - 1, got {seed!r}.")
    seed = None if seed is None else int(seed)

    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_new_tokens=min_new_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool(raw, "ignore_eos", False),
        skip_special_tokens=_bool(raw, "skip_special_tokens", True),
        no_stop_trim=_bool(raw, "no_stop_trim", False),
        sampling_seed=seed,
    )


def parse_generate_request(body: Any) -> GenerateRequest:
    """A `/generate` JSON body to a GenerateRequest; RequestError with SGLang's wording if invalid."""
    if not isinstance(body, Mapping):
        raise RequestError("The request body must be a JSON object.")
    for key, neutral in _NEUTRAL_TOP_LEVEL.items():
        value = body.get(key)
        if value is not None and value != neutral and value != [] and value != {}:
            raise RequestError(f"{key} is not supported by the CPU engine.")

    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None and input_ids is not None:
        raise RequestError("Provide either text or input_ids, not both.")
    batch_ids = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    if isinstance(text, list) or batch_ids:
        raise RequestError(BATCH_UNSUPPORTED)
    if text is not None and not isinstance(text, str):
        raise RequestError("text must be a string.")
    ids: tuple[int, ...] | None = None
    if input_ids is not None:
        if not isinstance(input_ids, list) or not all(_is_int(t) for t in input_ids):
            raise RequestError("input_ids must be a list of integers.")
        if not input_ids:
            raise RequestError("input_ids cannot be empty.")
        if any(t < 0 for t in input_ids):
            raise RequestError("input_ids must not be negative.")
        ids = tuple(int(t) for t in input_ids)

    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif isinstance(rid, list):
        raise RequestError(BATCH_UNSUPPORTED)
    elif not isinstance(rid, str):
        raise RequestError("The rid should be a string or a list of strings.")

    for key in ("return_logprob", "stream", "return_text_in_logprobs", "log_metrics"):
        value = body.get(key)
        if isinstance(value, list):
            raise RequestError(
                f"{key} as a list means a batch request, which the CPU engine does not support."
            )
    logprob_start_len = _int(body, "logprob_start_len", -1)
    if logprob_start_len < -1:
        raise RequestError(f"logprob_start_len must be -1 or a prompt position, got {logprob_start_len}.")
    return GenerateRequest(
        rid=rid,
        sampling=parse_sampling_params(body.get("sampling_params")),
        text=text,
        input_ids=ids,
        return_logprob=_bool(body, "return_logprob", False),
        logprob_start_len=logprob_start_len,
        return_text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
        stream=_bool(body, "stream", False),
        log_metrics=_bool(body, "log_metrics", True),
    )


def check_length(prompt_tokens: int, max_new_tokens: int, context_len: int) -> int:
    """SGLang's length checks, word for word; the `max_new_tokens` the scheduler will honour."""
    if prompt_tokens >= context_len:
        raise RequestError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if max_new_tokens + prompt_tokens > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {max_new_tokens + prompt_tokens} tokens: {prompt_tokens} tokens "
            f"from the input messages and {max_new_tokens} tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within the limit."
        )
    max_req_len = context_len - 1
    return max(0, min(max_new_tokens, max_req_len - prompt_tokens - 1))


def check_vocab(input_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in input_ids if t >= vocab_size]
    if bad:
        raise RequestError(
            f"The input_ids contain {bad[:8]} which are not below the vocab size ({vocab_size})."
        )


def check_logprob_start(logprob_start_len: int, prompt_tokens: int) -> None:
    if logprob_start_len >= prompt_tokens:
        raise RequestError(
            f"logprob_start_len ({logprob_start_len}) must be below the prompt length ({prompt_tokens})."
        )


# --- responses -----------------------------------------------------------------------------------


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


def error_body(message: str) -> dict[str, Any]:
    """The body of SGLang's 400 answers."""
    return {"error": {"message": message}}


def logprob_triples(
    values: Sequence[float | None], token_ids: Sequence[int], texts: Sequence[str] | None = None
) -> list[list[Any]]:
    """`[logprob, token_id, text | None]` per token, as SGLang's `detokenize_logprob_tokens`."""
    if texts is None:
        return [[v, t, None] for v, t in zip(values, token_ids, strict=True)]
    return [[v, t, s] for v, t, s in zip(values, token_ids, texts, strict=True)]
