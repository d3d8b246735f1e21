"""gRPC fuzzing kit: every RPC of every `bcstack.v1` service, Hypothesis strategies for any request
message built from its protobuf descriptor, raw calls that put arbitrary bytes on the wire, and
the status codes a call may end with.

    for rpc in all_rpcs():                       # from the service descriptors in core/v1
        strategy = message_strategy(rpc.request)  # valid, boundary and garbage field values
        outcome = call(channel, rpc, strategy.example().SerializeToString(), timeout=30)

The processes it calls are `devkit.fuzzstack`'s, which the HTTP fuzzing shares. Nothing here
knows a field by name: a new field, message, enum value, RPC or service is fuzzed as soon as its
stubs are regenerated. `hints` (field name -> strings) only adds plausible values
(a real docid, a chat role) so that generated requests also reach past validation.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

import core.v1

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
# A string that no length limit of a service lets through, yet far below the 64 MiB message limit.
HUGE_CHARS = 300_000

# Codes a fuzzed call may end with when the service behaves; anything else is a finding. Each is
# a documented answer of some RPC (the service comments in proto/core/v1/*.proto):
ALLOWED_CODES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "a normal answer",
    grpc.StatusCode.INVALID_ARGUMENT: "the request is malformed or out of range, with the reason",
    grpc.StatusCode.NOT_FOUND: "Retrieval Open of a docid or url the corpus lacks",
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        "admission: a worker batch larger than its free episode slots, a full gateway, or a message "
        "over the size limit"
    ),
    grpc.StatusCode.ABORTED: "the gateway runs an episode with this episode_id right now",
    grpc.StatusCode.UNAVAILABLE: "an upstream (engine, grader, every retriever) is down",
}
# Never acceptable: UNKNOWN is an exception that escaped a servicer, INTERNAL a serialization or
# framework failure, DEADLINE_EXCEEDED a call that did not end within the fuzzer's (generous) limit.
FORBIDDEN_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
# Details of a status the client's transport made up because the server's did not arrive (an
# oversized status trailer turns any code into RESOURCE_EXHAUSTED "Stream removed (received
# metadata size exceeds hard limit ...)"): a finding whatever the code.
TRANSPORT_FAILURES = ("Stream removed", "metadata size exceeds")


@dataclass(frozen=True)
class Rpc:
    """One method of a service, as the descriptors describe it."""

    service: str  # full service name, e.g. "bcstack.v1.RetrievalService"
    method: str  # e.g. "Search"
    request: Descriptor
    response: Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method}"

    @property
    def id(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.method}"


def all_services() -> list[ServiceDescriptor]:
    """Every service declared by the generated `core.v1.*_pb2` modules, in module order."""
    found = []
    for info in sorted(pkgutil.iter_modules(core.v1.__path__), key=lambda m: m.name):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"core.v1.{info.name}")
            found.extend(module.DESCRIPTOR.services_by_name.values())
    return found


def all_rpcs() -> list[Rpc]:
    return [
        Rpc(
            service.full_name,
            method.name,
            method.input_type,
            method.output_type,
            method.client_streaming,
            method.server_streaming,
        )
        for service in all_services()
        for method in service.methods
    ]


# --- strategies ----------------------------------------------------------------------------------


def _bounded_ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, lo + 1, -1, 0, 1, 2, hi - 1, hi) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(0, 64), st.integers(lo, hi))


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, math.inf, -math.inf, math.nan]
    return st.one_of(st.sampled_from(edges), st.floats(0, 2), st.floats(width=width))


def _strings(hints: Sequence[str]) -> st.SearchStrategy[str]:
    edges = [
        "",
        " ",
        "\n\t ",
        "\x00",
        "<function=finish>\n<parameter=answer>x</parameter>\n</function>",
        "\u202e\ufeff\u200b",
    ]
    huge = ["a" * HUGE_CHARS, "é" * HUGE_CHARS, "😀" * (HUGE_CHARS // 2)]
    ordinary = [
        st.sampled_from(edges),
        st.text(max_size=40),
        st.text(st.characters(codec="utf-8"), max_size=200),
    ]
    if hints:
        ordinary += [st.sampled_from(list(hints))] * 2
    # one string in ~(3 x len(ordinary)) is huge: often enough to be tried on every field, rare
    # enough that most requests are small and get past the length checks
    return st.one_of(*ordinary * 3, st.sampled_from(huge))


_INTS = {
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: UINT32,
    FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_FIXED64: UINT64,
}


@dataclass
class _Builder:
    hints: Mapping[str, Sequence[str]]
    max_depth: int
    max_repeated: int
    _cache: dict[tuple[str, int], st.SearchStrategy] = field(default_factory=dict)

    def scalar(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy:
        t = f.type
        if t in _INTS:
            return _bounded_ints(*_INTS[t])
        if t == FieldDescriptor.TYPE_DOUBLE:
            return _floats(64)
        if t == FieldDescriptor.TYPE_FLOAT:
            return _floats(32)
        if t == FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if t == FieldDescriptor.TYPE_STRING:
            return _strings(self.hints.get(f.name, ()))
        if t == FieldDescriptor.TYPE_BYTES:
            return st.one_of(st.binary(max_size=200), st.just(b"\xff" * HUGE_CHARS))
        if t == FieldDescriptor.TYPE_ENUM:
            # proto3 enums are open: an unknown number must be carried and handled like any other
            known = [v.number for v in f.enum_type.values]
            return st.one_of(st.sampled_from(known), _bounded_ints(*INT32))
        if t == FieldDescriptor.TYPE_MESSAGE:
            return self.message(f.message_type, depth + 1)
        raise TypeError(f"{f.full_name}: field type {t} is not supported by the fuzzer")

    def value(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            return st.dictionaries(
                self.scalar(key, depth), self.scalar(value, depth), max_size=self.max_repeated
            )
        if f.is_repeated:
            if f.message_type is not None and depth + 1 > self.max_depth:
                return st.just([])
            return st.lists(self.scalar(f, depth), max_size=self.max_repeated)
        return self.scalar(f, depth)

    def message(self, descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        key = (descriptor.full_name, depth)
        if key in self._cache:
            return self._cache[key]
        cls = message_factory.GetMessageClass(descriptor)
        if depth > self.max_depth:
            return st.builds(cls)
        # A field in a oneof (real, or the synthetic one of a proto3 `optional`) is set or not,
        # one member at a time; a singular message field is set or not; any other field always
        # gets a value (its default is indistinguishable from unset on the wire).
        parts: list[st.SearchStrategy[dict]] = []
        in_oneof = set()
        for oneof in descriptor.oneofs:
            members = [st.tuples(st.just(f.name), self.value(f, depth)) for f in oneof.fields]
            in_oneof.update(f.name for f in oneof.fields)
            parts.append(st.one_of(st.none(), *members).map(lambda kv: dict([kv]) if kv else {}))
        for f in descriptor.fields:
            if f.name in in_oneof:
                continue
            strategy = self.value(f, depth)
            if not f.is_repeated and f.message_type is not None:
                strategy = st.one_of(st.none(), strategy)
            parts.append(strategy.map(lambda v, name=f.name: {} if v is None else {name: v}))

        def assemble(dicts: tuple[dict, ...]) -> Message:
            kwargs: dict = {}
            for d in dicts:
                kwargs.update(d)
            return cls(**kwargs)

        built = st.tuples(*parts).map(assemble)
        self._cache[key] = built
        return built


def message_strategy(
    descriptor: Descriptor,
    *,
    hints: Mapping[str, Sequence[str]] | None = None,
    max_depth: int = 3,
    max_repeated: int = 4,
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor` with every field drawn from valid, boundary and garbage values:
    strings empty, blank, NUL, huge ASCII/accented/emoji, bidi controls, protocol syntax or random
    Unicode; integers at their type's bounds, small or anywhere in range; floats incl. nan, +-inf,
    -0.0 and subnormal; enums known or any int32; repeated and map fields up to `max_repeated`
    items; oneofs and optional fields set or not; nested messages down to `max_depth`."""
    return _Builder(dict(hints or {}), max_depth, max_repeated).message(descriptor)


def garbage_bytes() -> st.SearchStrategy[bytes]:
    """Serialized requests that are no valid message, or are one by accident: random bytes,
    truncated varints, wrong wire types, a length prefix far past the end, deep nesting."""
    crafted = [
        b"\x08",  # field 1 varint, value missing
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
        b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length 4 GiB, no bytes
        b"\x0b",  # start group (deprecated wire type 3)
        b"\x0f",  # wire type 7 (does not exist)
        b"\x00",  # field number 0
        b"\x0a\x02\xc3\x28",  # field 1 as a string with invalid UTF-8
        b"\x12\x02\xff\xfe",
        b"\x22" + b"\x22\x7f" * 100,  # nested length prefixes that lie
        (b"\x22\x00" * 10_000),
    ]
    return st.one_of(st.sampled_from(crafted), st.binary(max_size=512))


# --- calls ---------------------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]  # serialized answers (a streaming RPC may send some before failing)

    @property
    def allowed(self) -> bool:
        return self.code in ALLOWED_CODES and not any(t in self.details for t in TRANSPORT_FAILURES)


def call(channel: grpc.Channel, rpc: Rpc, payload: bytes, *, timeout: float) -> Outcome:
    """Send `payload` as the serialized request of `rpc` (no client-side serialization, so any
    bytes reach the server) and read the whole answer, kept serialized (see `parse_response`)."""
    if rpc.client_streaming:
        requests: Iterator[bytes] = iter([payload])
        if rpc.server_streaming:
            stub = channel.stream_stream(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
        else:
            stub = channel.stream_unary(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
        target = requests
    else:
        if rpc.server_streaming:
            stub = channel.unary_stream(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
        else:
            stub = channel.unary_unary(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
        target = payload
    received: list[bytes] = []
    try:
        if rpc.server_streaming:
            for answer in stub(target, timeout=timeout):
                received.append(answer)
        else:
            received.append(stub(target, timeout=timeout))
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", received)
    return Outcome(grpc.StatusCode.OK, "", received)


def parse_response(rpc: Rpc, data: bytes) -> Message:
    """The server's answer as a message of the RPC's response type (a check that it parses)."""
    return message_factory.GetMessageClass(rpc.response).FromString(data)


# --- plausible and known-good requests -----------------------------------------------------------


def world_hints(world: Path, n: int = 4) -> dict[str, list[str]]:
    """Plausible strings from a toy world (field name -> values): real docids and urls, its
    questions and answers, the chat roles, so generated requests also do real work."""
    from devkit.toyworld.policies import WORKER_TASK_TEMPLATE

    with open(world / "corpus.jsonl") as f:
        docs = [json.loads(line) for line, _ in zip(f, range(n), strict=False)]
    with open(world / "questions.jsonl") as f:
        questions = [json.loads(line) for line, _ in zip(f, range(n), strict=False)]
    asked = [q["query"] for q in questions]
    tasks = [WORKER_TASK_TEMPLATE.format(question=q) for q in asked]
    answers = [q["answer"] for q in questions]
    return {
        "docid": [d["docid"] for d in docs],
        "url": [d["url"] for d in docs],
        "role": ["system", "user", "assistant"],
        "content": tasks,
        "prompt": tasks,
        "question": asked,
        "query": [*asked, "Nobel laureate"],
        "response": [f"Exact Answer: {a}\nConfidence: 90%" for a in answers],
        "report": answers,
        "correct_answer": answers,
        "gold_answer": answers,
        "final_answer": answers,
    }


def known_good(service: str, channel: grpc.Channel, question: Mapping[str, str], timeout: float = 60) -> None:
    """Send `service` a request a user would send (about a toy-world `question`) and check that it
    is answered as usual: the service still does its job. AssertionError otherwise."""
    from core.v1 import (
        coordinator_pb2,
        coordinator_pb2_grpc,
        judge_pb2,
        judge_pb2_grpc,
        retrieval_pb2,
        retrieval_pb2_grpc,
        worker_pb2,
        worker_pb2_grpc,
    )
    from devkit.toyworld.policies import WORKER_TASK_TEMPLATE

    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING, f"{service} is not SERVING"
    asked, answer = question["query"], question["answer"]
    if service == "bcstack.v1.RetrievalService":
        found = retrieval_pb2_grpc.RetrievalServiceStub(channel).Search(
            retrieval_pb2.SearchRequest(query=asked, k=3), timeout=timeout
        )
        assert len(found.hits) == 3, found
    elif service == "bcstack.v1.JudgeService":
        verdict = judge_pb2_grpc.JudgeServiceStub(channel).GradeAnswer(
            judge_pb2.GradeAnswerRequest(
                question=asked, response=f"Exact Answer: {answer}", correct_answer=answer
            ),
            timeout=timeout,
        )
        assert verdict.correct, verdict
    elif service == "bcstack.v1.WorkerService":
        task = worker_pb2.BranchTask(description="answer", prompt=WORKER_TASK_TEMPLATE.format(question=asked))
        done = worker_pb2_grpc.WorkerServiceStub(channel).RunEpisode(
            worker_pb2.RunWorkerEpisodeRequest(branch=task), timeout=timeout
        )
        assert done.report.answer == answer, done.report
    elif service == "bcstack.v1.CoordinatorService":
        done = coordinator_pb2_grpc.CoordinatorServiceStub(channel).RunEpisode(
            coordinator_pb2.RunCoordinatorEpisodeRequest(question=asked), timeout=timeout
        )
        assert (done.status, done.answer) == ("finish", answer), done
    else:
        raise AssertionError(f"no known-good request for {service}: add one to devkit.grpcfuzz.known_good")
