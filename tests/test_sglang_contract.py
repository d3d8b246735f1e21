"""The stack against SGLang's own source, for the pinned version (the chart's image tag) and the
newest release: every route our client calls, every field it sends, every key it reads, every
request key the CPU engine accepts, every route it serves and every flag the chart passes exists in
each version as we use it (devkit.sglang). The source comes from the PyPI wheels that
scripts/install.sh fetches; it is read with `ast`, never installed or imported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helm_harness import render_chart
from test_chart_worker import engine, worker

from devkit.sglang import contract, facts, source

TARGETS = source.targets()


@pytest.fixture(scope="module")
def pinned() -> facts.SGLangFacts:
    return facts.read(source.load(source.pinned_version()))


@pytest.fixture(scope="module", params=TARGETS)
def target(request: pytest.FixtureRequest) -> facts.SGLangFacts:
    return facts.read(source.load(request.param))


def _chart_args(values: dict) -> list[str]:
    return engine(render_chart(values))["args"]


# Every value set that adds SGLang flags: the token, deterministic inference.
CHART_VALUES = {
    "defaults": worker(),
    "all-flags": {
        **worker(engine={"deterministicInference": True}),
        "adminToken": {"existingSecret": "bc-admin"},
    },
}


def test_the_pin_is_the_charts_image_and_the_newest_release_is_a_second_target() -> None:
    tag = engine(render_chart(worker()))["image"].rsplit(":", 1)[1]
    assert tag.startswith(f"v{source.pinned_version()}")
    assert TARGETS[0] == source.pinned_version() and len(TARGETS) == 2
    assert all(source.wheel_path(v) is not None for v in TARGETS), "scripts/install.sh fetches them"


def test_the_client_and_the_cpu_engine_use_only_what_sglang_has(target, pinned) -> None:
    uses = contract.client_uses() + contract.engine_uses()
    assert len(uses) > 60  # the reading found the lists it checks
    assert contract.check(target, uses, pinned) == []


@pytest.mark.parametrize("values", CHART_VALUES.values(), ids=CHART_VALUES.keys())
def test_every_flag_the_chart_passes_is_a_server_flag(target, values) -> None:
    uses = contract.flag_uses(_chart_args(values), target)
    assert {"--tp-size", "--context-length", "--enable-metrics"} <= {u.name for u in uses}
    assert contract.check(target, uses) == []


def test_routes_the_stack_relies_on_are_read_with_their_status(target) -> None:
    routes = target.of("route")
    assert "admin" in routes["POST /update_weights_from_disk"].tags
    assert "deprecated-alias" in routes["GET /get_model_info"].tags
    assert not routes["GET /model_info"].tags
    pause = target.of("PauseGenerationReqInput")["mode"]
    assert set(pause.choices) == {"abort", "retract", "in_place"}


def test_the_pinned_weight_version_routes_are_404_stubs(pinned) -> None:
    routes = pinned.of("route")
    for path in ("GET /get_weight_version", "GET /weight_version"):
        assert "deprecated-stub" in routes[path].tags, path


# --- the check fails where SGLang and the stack part ---------------------------------------------


def _edited(tmp_path: Path, version: str, path: str, old: str, new: str) -> facts.SGLangFacts:
    """Facts of a copy of the wheel's source in which `old` became `new` in `path`."""
    wheel = source.load(version)
    wheel.write(tmp_path, wheel.paths("sglang/srt/"))
    file = tmp_path / path
    text = file.read_text(encoding="utf-8")
    assert old in text
    file.write_text(text.replace(old, new, 1), encoding="utf-8")
    return facts.read(source.WheelSource.from_folder(version, tmp_path))


def test_a_field_renamed_in_sglang_fails_naming_both_lines(tmp_path) -> None:
    version = source.pinned_version()
    edited = _edited(
        tmp_path,
        version,
        facts.IO_STRUCT,
        "    # Whether to flush the cache after updating weights\n    flush_cache: bool = True",
        "    # Whether to flush the cache after updating weights\n    flush_kv_cache: bool = True",
    )
    problems = contract.check(edited, contract.client_uses())
    (problem,) = problems
    anchor = edited.anchors["UpdateWeightFromDiskReqInput"]
    assert problem.startswith("core/engine_client.py:")
    missing = f"UpdateWeightFromDiskReqInput has no field 'flush_cache' in sglang {version} ({anchor})"
    assert missing in problem
    assert anchor.startswith(f"{facts.IO_STRUCT}:")


def test_a_route_turned_into_a_deprecated_stub_fails(tmp_path) -> None:
    edited = _edited(
        tmp_path,
        source.pinned_version(),
        facts.HTTP_SERVER,
        '@app.get("/model_info")\nasync def model_info():\n    """Get the model information."""',
        '@app.get("/model_info")\nasync def model_info():\n    raise HTTPException(status_code=404, '
        'detail="deprecated")\n\n\nasync def _was_model_info():\n    """Get the model information."""',
    )
    problems = contract.check(edited, contract.client_uses())
    (problem,) = [p for p in problems if "GET /model_info" in p]
    assert problem.startswith("core/engine_client.py:")
    assert "GET /model_info answers 404 (a deprecated stub)" in problem
    assert f"{facts.HTTP_SERVER}:" in problem


def test_a_chart_flag_sglang_does_not_have_fails(target) -> None:
    args = [*_chart_args(worker()), "--tp", "1", "--enable-metrics=yes"]
    problems = contract.check(target, contract.flag_uses(args, target))
    assert any("there is no server flag '--tp'" in p for p in problems), problems
    assert any("--enable-metrics is a switch but is given 'yes'" in p for p in problems), problems


def test_fetch_is_idempotent(tmp_path) -> None:
    version = source.pinned_version()
    cached = source.wheel_path(version)
    assert cached is not None
    (tmp_path / version).mkdir()
    shutil.copy(cached, tmp_path / version / cached.name)
    assert source.fetch(version, tmp_path) == tmp_path / version / cached.name  # no download
