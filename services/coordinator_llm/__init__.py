"""The stand-in coordinator LLM: an OpenAI-compatible chat completions server answered by a
coordinator policy (the toy world's scripted coordinator), in the coordinator protocol
(DESIGN.md §3). It is the embedded default for the production coordinator (MiniMax-M2.7 behind an
OpenAI-compatible endpoint) and the test double the coordinator gateway is tested against,
with configurable fault injection.

Where to read: `service` (routes, auth, faults) -> `protocol` (OpenAI's wire format, token
estimate) -> `policies` (what writes the turn) and `faults` (seeded failure draws); `settings`,
`metrics`, `cli`.
"""
