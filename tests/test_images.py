"""`make images` (devkit/images.py): the build plan against the Dockerfiles and the chart, the
commands each builder gets (a recording stand-in for docker/podman/buildah: no engine runs here),
and hadolint (the real linter, from its PyPI wheel) on every Dockerfile."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_harness import CHART_DIR, render_chart

from devkit.images import SERVICES, app_version, chart_values, plan

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def default_arg(dockerfile: Path, name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    return value


def test_the_plan_builds_every_dockerfile_after_what_it_is_built_from() -> None:
    version = app_version()
    builds = plan("ghcr.io/browsecomp-stack", version)
    assert {b.dockerfile for b in builds} == {f"docker/{p.name}" for p in DOCKERFILES}
    built: list[str] = []
    for build in builds:
        base = build.args.get("BCSTACK_IMAGE")
        if base is not None:
            assert base in built, f"{build.tag} is built before its base {base}"
            # The Dockerfile's own default names the same variant, at the chart's version.
            assert default_arg(ROOT / build.dockerfile, "BCSTACK_IMAGE") == base
        assert build.tag.split(":")[1].startswith(version)
        assert default_arg(ROOT / build.dockerfile, "BCSTACK_VERSION") == version
        built.append(build.tag)
    assert len(built) == len(set(built)) == 1 + 2 * len(SERVICES)


def test_the_printed_set_lines_point_every_bcstack_container_at_a_built_tag() -> None:
    registry = "registry.example.com:5000/team"
    built = {b.tag for b in plan(registry, app_version())}
    sets: dict = {}
    for line in chart_values(registry, app_version()):
        key, value = line.split("=", 1)
        node = sets
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    values = yaml.safe_load((CHART_DIR / "presets" / "rl-training.yaml").read_text())
    for key, value in sets.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    for component in SERVICES:
        values[component] = {
            **values.get(component, {}),
            "image": {**values.get(component, {}).get("image", {}), **sets[component]["image"]},
        }
    images = set()
    for m in render_chart(values):
        spec = m.get("spec", {}).get("template", {}).get("spec") or (
            m.get("spec") if m["kind"] == "Pod" else None
        )
        for c in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
            images.add(c["image"])
    ours = {i for i in images if i.startswith("registry.example.com")}
    others = images - ours
    assert ours and ours <= built, ours - built
    assert all(not i.startswith("ghcr.io/browsecomp-stack") for i in others), others
    assert {
        f"{registry}/bcstack-{s}:{app_version()}"
        for s in ("coordinator", "judge", "retrieval", "worker", "trainer")
    } <= ours


def fake_tool(folder: Path, name: str, log: Path, fail_on: str | None = None) -> None:
    """An executable `name` that records its arguments (and fails on a tag containing fail_on)."""
    script = folder / name
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$0 $*" >> {log}\n'
        + (f'case "$*" in *{fail_on}*) exit 1;; esac\n' if fail_on else "")
        + "exit 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def run_images(path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [sys.executable, "-m", "devkit.images", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


@pytest.mark.parametrize("tool", ["docker", "podman", "buildah"])
def test_each_builder_gets_the_builds_in_order(tmp_path: Path, tool: str) -> None:
    log = tmp_path / "calls.log"
    fake_tool(tmp_path, tool, log)
    done = run_images(str(tmp_path), "--only", "coordinator,trainer")
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    tags = [c.split(" -t ")[1].split()[0] for c in calls]
    version = app_version()
    assert tags == [
        f"ghcr.io/browsecomp-stack/bcstack:{version}",
        f"ghcr.io/browsecomp-stack/bcstack:{version}-coordinator",
        f"ghcr.io/browsecomp-stack/bcstack:{version}-trainer",
        f"ghcr.io/browsecomp-stack/bcstack-coordinator:{version}",
        f"ghcr.io/browsecomp-stack/bcstack-trainer:{version}",
    ]
    assert all(c.split()[1] == "build" for c in calls)
    assert "--build-arg WITH_TORCH=true" in calls[2] and "--build-arg BCSTACK_EXTRA=trainer" in calls[2]
    assert "--set coordinator.image.repository=browsecomp-stack/bcstack-coordinator" in done.stdout
    assert "--set image.tag=" + version in done.stdout


def test_no_builder_is_one_line_and_a_failed_build_stops_the_rest(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_images(str(empty))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "no docker or podman or buildah on PATH" in done.stderr
    dry = run_images(str(empty), "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("docker build -f docker/") == 1 + 2 * len(SERVICES)
    log = tmp_path / "calls.log"
    fake_tool(tmp_path, "podman", log, fail_on="0.1.0-judge")
    failed = run_images(str(tmp_path))
    assert failed.returncode == 1 and "building ghcr.io/browsecomp-stack/bcstack:" in failed.stderr
    assert not any("bcstack-judge:" in c or "bcstack-coordinator:" in c for c in log.read_text().splitlines())
    assert run_images(str(empty), "--only", "gateway").returncode == 2


HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.stem for p in DOCKERFILES])
def test_hadolint_passes_every_dockerfile(dockerfile: Path) -> None:
    done = subprocess.run(
        [HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_is_not_a_rubber_stamp(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n")
    done = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "DL3007" in done.stdout and "DL3008" in done.stdout
