"""The CPU engine: the subset of SGLang's native HTTP API the stack uses, served over
`transformers` on the CPU (the embedded default, DESIGN.md §6) or over a scripted toy-world policy.

Where to read: `service` (routes) -> `core` (admission, weight updates, health) -> `scheduler`
(continuous batching) -> `models` / `scripted` (token models) with `sequence` (finish rule,
response shape), `sampling`, `prefix_cache` (KV reuse across requests, SGLang's radix cache) and
`protocol` (SGLang's wire format).

SGLang pin. The engine mirrors the SGLang version the chart runs (its worker image tag in
charts/bcstack/values.yaml, 0.5.19) where the stack depends on behaviour: README "SGLang: the pin,
the contract, and what the CPU engine mirrors" lists each behaviour with the SGLang source it was
read from (the PyPI wheel, `pip download --no-deps`, read and never installed), and
tests/test_engine_pinned.py holds them. Names (routes, request keys) are checked against that
source by tests/test_sglang_contract.py. Field defaults, `verify()` wording, finish reasons and
log-prob semantics follow `srt/sampling/sampling_params.py`, `srt/managers/io_struct.py`,
`srt/managers/schedule_batch.py` and `srt/layers/sampler.py` of the same version.
"""
