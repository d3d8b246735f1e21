"""The CPU engine: the subset of SGLang's native HTTP API the stack uses, served over
`transformers` on the CPU (the embedded default, DESIGN.md §6) or over a scripted toy-world policy.

Where to read: `service` (routes) -> `core` (admission, weight updates, health) -> `scheduler`
(continuous batching) -> `models` / `scripted` (token models) with `sequence` (finish rule,
response shape), `sampling`, `prefix_cache` (KV reuse across requests, SGLang's radix cache) and
`protocol` (SGLang's wire format).

SGLang pin. Field names, defaults, status codes, error wording and log-prob semantics were read
from sgl-project/sglang, main line after v0.5.6.post2 (python/sglang/version.py @ fd1216caabc4
says 0.5.6.post2; later mains dropped that file). The source index holds each file at its own
commit; the versions read were:
- srt/managers/io_struct.py @ 001067fffe33 (GenerateReqInput, PauseGenerationReqInput,
  ContinueGenerationReqInput, UpdateWeightFromDiskReqInput/-ReqOutput);
- srt/entrypoints/http_server.py @ 0025436eab05 (routes, methods, 200/400/503 codes,
  `_create_error_response`, /get_model_info and /get_weight_version bodies, the
  pause/continue answers);
- srt/sampling/sampling_params.py @ 00c17cafcb9e (names, defaults, `verify()` messages,
  `sampling_seed`, temperature < 1e-6 = greedy);
- srt/managers/tokenizer_manager.py (`_handle_batch_output` meta_info, `_validate_input_length`
  wording, `detokenize_logprob_tokens` triples);
- srt/managers/scheduler_output_processor_mixin.py (`_process_input_token_logprobs`: the input
  log-prob list starts with None) and srt/layers/sampler.py (temperature-scaled, pre-filter
  output log-probs; greedy reports the raw log-softmax);
- srt/utils/auth.py @ 0ce3659c2b55 (ADMIN_OPTIONAL routes, health and metrics always open).
"""
