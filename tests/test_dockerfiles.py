"""docker/*.Dockerfile: parsed (no Docker engine here) and held to the image rules every file keeps.

Rules: bases pinned (a version tag that is not `latest`, or a digest); the final stage runs as a
non-root USER; a HEALTHCHECK, or a `# probe:` comment saying which Kubernetes probe checks the
service; no ADD of remote URLs (unverified downloads); no secret-looking ENV or ARG with a
literal value (it would be baked into the image and its history).

`check_dockerfile` applies the rules; `commands_by_instruction` and `build_args` read a file for
the per-image tests, and `assert_service_image` holds what every bcstack service image
(docker/retrieval.Dockerfile, docker/worker.Dockerfile) shares.
"""

from __future__ import annotations

import re
from pathlib import Path

import dockerfile
import pytest

DOCKER_DIR = Path(__file__).resolve().parents[1] / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
PROBE_COMMENT = re.compile(r"^\s*#\s*probe:\s*\S", re.MULTILINE)
REMOTE_SOURCE = re.compile(r"^([a-z][a-z0-9+.-]*://|git@)", re.IGNORECASE)
VARIABLE = re.compile(r"\$\{(\w+)(?::?[-+][^}]*)?\}|\$(\w+)")
ROOT_USERS = {"root", "0"}


def _expand(text: str, args: dict[str, str]) -> str:
    """Substitute build args the way `docker build` does with no --build-arg given."""
    return VARIABLE.sub(lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def _unpinned_reason(image: str) -> str | None:
    """Why `image` is not pinned, or None when it is (a digest, or a tag other than latest)."""
    if "$" in image:
        return "has an unresolved build arg"
    if "@sha256:" in image:
        return None
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return "has no tag (means latest)"
    if name.rsplit(":", 1)[1] == "latest":
        return "uses the latest tag"
    return None


def _is_literal(value: str) -> bool:
    """A value typed into the file, as opposed to empty or a reference to a build arg."""
    value = value.strip().strip("\"'")
    return bool(value) and not re.fullmatch(r"\$\{?\w+\}?", value)


def check_dockerfile(path: Path) -> list[str]:
    """Every rule `path` breaks, one message each; an empty list means it passes."""
    commands = dockerfile.parse_file(str(path))
    problems: list[str] = []
    global_args: dict[str, str] = {}
    # The USER each named stage ends with (None: the base's, i.e. root); FROM <stage> inherits it.
    stage_users: dict[str, str | None] = {}
    user: str | None = None
    has_healthcheck = False
    seen_from = False
    stage: str | None = None

    for command in commands:
        cmd, where = command.cmd.upper(), f"line {command.start_line}"
        if cmd == "ARG":
            for declaration in command.value:
                name, _, default = declaration.partition("=")
                if not seen_from:
                    global_args[name] = default
                if SECRET_NAME.search(name) and _is_literal(default):
                    problems.append(f"{where}: ARG {name} has a literal default (a secret in the image)")
        elif cmd == "FROM":
            seen_from = True
            image = _expand(command.value[0], global_args)
            user = stage_users.get(image.lower())
            if image.lower() not in stage_users and image != "scratch":
                reason = _unpinned_reason(image)
                if reason:
                    problems.append(f"{where}: FROM {command.value[0]} is not pinned: it {reason}")
            stage = command.value[2].lower() if len(command.value) == 3 else None
            if stage:
                stage_users[stage] = user
        elif cmd == "USER":
            user = command.value[0]
            if stage:
                stage_users[stage] = user
        elif cmd == "HEALTHCHECK":
            has_healthcheck = command.value[0].upper() != "NONE"
        elif cmd == "ADD":
            for source in command.value[:-1]:
                if REMOTE_SOURCE.match(source):
                    problems.append(f"{where}: ADD of a remote URL {source} (download and verify in RUN)")
        elif cmd == "ENV":
            pairs = zip(command.value[::2], command.value[1::2], strict=True)
            for name, value in pairs:
                if SECRET_NAME.search(name) and _is_literal(value):
                    problems.append(f"{where}: ENV {name} has a literal value (a secret in the image)")

    if not seen_from:
        problems.append("no FROM")
    if user is None:
        problems.append("the final stage sets no USER (nor inherits one from a stage), so it runs as root")
    elif user.split(":")[0] in ROOT_USERS:
        problems.append(f"the final stage runs as USER {user} (root)")
    if not has_healthcheck and not PROBE_COMMENT.search(path.read_text()):
        problems.append("no HEALTHCHECK and no '# probe:' comment naming the Kubernetes probe")
    return problems


def commands_by_instruction(path: Path) -> dict[str, list[dockerfile.Command]]:
    """`path`'s instructions by (upper-case) instruction name, each list in file order."""
    by_cmd: dict[str, list[dockerfile.Command]] = {}
    for command in dockerfile.parse_file(str(path)):
        by_cmd.setdefault(command.cmd.upper(), []).append(command)
    return by_cmd


def build_args(by_cmd: dict[str, list[dockerfile.Command]]) -> dict[str, str]:
    """ARG name -> its default ("" when it has none), from `commands_by_instruction`."""
    return dict(a.value[0].partition("=")[::2] for a in by_cmd["ARG"])


def assert_service_image(
    path: Path, service: str, http_port: int, grpc_port: int
) -> dict[str, list[dockerfile.Command]]:
    """`path` keeps the image rules and is a bcstack service image: one stage FROM the pinned
    common image (the BCSTACK_IMAGE arg), run as 10001:10001, exposing both ports, with the
    exec-form ENTRYPOINT `bcstack serve <service>` and a HEALTHCHECK of /health on the HTTP port
    that needs no curl. Returns `commands_by_instruction(path)` for the service's own checks."""
    assert check_dockerfile(path) == []
    by_cmd = commands_by_instruction(path)
    args = build_args(by_cmd)
    (base,) = by_cmd["FROM"]
    assert base.value[0] == "${BCSTACK_IMAGE}"
    # the common image built with this service's extra only (pyproject.toml; docker/bcstack.Dockerfile)
    assert re.fullmatch(rf"ghcr\.io/browsecomp-stack/bcstack:\d+\.\d+\.\d+-{service}", args["BCSTACK_IMAGE"])
    assert by_cmd["USER"][-1].value[0] == "10001:10001"
    assert sorted(by_cmd["EXPOSE"][0].value) == sorted([str(http_port), str(grpc_port)])
    (entrypoint,) = by_cmd["ENTRYPOINT"]
    assert entrypoint.json and entrypoint.value == ("bcstack", "serve", service)
    (health,) = by_cmd["HEALTHCHECK"]
    assert f"http://127.0.0.1:{http_port}/health" in " ".join(health.value)
    assert "curl" not in " ".join(health.value)
    return by_cmd


def test_docker_dir_has_the_common_image() -> None:
    assert DOCKER_DIR / "bcstack.Dockerfile" in DOCKERFILES


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_keeps_the_image_rules(path: Path) -> None:
    assert check_dockerfile(path) == []


def test_common_image() -> None:
    by_cmd = commands_by_instruction(DOCKER_DIR / "bcstack.Dockerfile")
    args = build_args(by_cmd)
    assert args["PYTHON_IMAGE"] == "python:3.11.7-slim-bookworm"
    froms = by_cmd["FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    assert all(_expand(f.value[0], args) == "python:3.11.7-slim-bookworm" for f in froms)
    runs = " ".join(c.value[0] for c in by_cmd["RUN"])
    assert 'pip install -c constraints.txt ".[${BCSTACK_EXTRA}]"' in runs
    assert (args["BCSTACK_EXTRA"], args["WITH_TORCH"]) == ("all", "true")  # the default: everything
    assert "--uid 10001" in runs
    final_start = froms[-1].start_line
    assert [u.value[0] for u in by_cmd["USER"] if u.start_line > final_start] == ["10001:10001"]
    assert [e.value for e in by_cmd["ENTRYPOINT"]] == [("bcstack",)]
    assert by_cmd["ENTRYPOINT"][0].json, "exec form, so signals reach bcstack"
    copies = [c for c in by_cmd["COPY"] if c.start_line > final_start]
    assert any("--from=build" in c.flags for c in copies)


BAD_DOCKERFILE = """\
ARG BASE=ubuntu
FROM python AS build
FROM ${BASE}
FROM debian:latest
FROM ${UNSET_BASE}
ADD https://example.com/model.tar.gz /models/
ADD --chmod=755 git@github.com:org/repo.git /src
ENV HF_TOKEN=hf_abc123 LOG_LEVEL=INFO
ENV DB_PASSWORD hunter2
ARG API_KEY=sk-123
USER bcstack
USER root
"""

GOOD_DOCKERFILE = """\
ARG BASE=python:3.11.7-slim-bookworm
FROM ${BASE} AS build
FROM build AS test
FROM alpine@sha256:0000000000000000000000000000000000000000000000000000000000000000
COPY --from=build /opt/venv /opt/venv
ADD vendor.tar.gz /opt/
ARG HF_TOKEN
ENV HF_TOKEN=${HF_TOKEN} API_KEY_FILE=
HEALTHCHECK CMD ["bcstack", "--version"]
USER 10001
"""


def test_checker_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.Dockerfile"
    path.write_text(BAD_DOCKERFILE)
    problems = check_dockerfile(path)
    expected = [
        "line 2: FROM python is not pinned: it has no tag",
        "line 3: FROM ${BASE} is not pinned: it has no tag",
        "line 4: FROM debian:latest is not pinned: it uses the latest tag",
        "line 5: FROM ${UNSET_BASE} is not pinned: it has an unresolved build arg",
        "line 6: ADD of a remote URL https://example.com/model.tar.gz",
        "line 7: ADD of a remote URL git@github.com:org/repo.git",
        "line 8: ENV HF_TOKEN has a literal value",
        "line 9: ENV DB_PASSWORD has a literal value",
        "line 10: ARG API_KEY has a literal default",
        "the final stage runs as USER root",
        "no HEALTHCHECK and no '# probe:' comment",
    ]
    for message in expected:
        assert any(p.startswith(message) for p in problems), (message, problems)
    assert len(problems) == len(expected), problems


def test_checker_passes_pinned_stages_digests_and_arg_references(tmp_path: Path) -> None:
    path = tmp_path / "good.Dockerfile"
    path.write_text(GOOD_DOCKERFILE)
    assert check_dockerfile(path) == []


@pytest.mark.parametrize(
    ("final_stage", "problem"),
    [
        ("FROM python:3.11.7-slim-bookworm\n", "sets no USER"),
        ("FROM python:3.11.7-slim-bookworm\nUSER 10001\nUSER 0:0\n", "runs as USER 0:0"),
        ("FROM root-stage\n", "sets no USER"),
        ("FROM user-stage\nUSER root\n", "runs as USER root"),
        ("FROM user-stage\n", None),
        ("FROM root-stage\nUSER 10001\n", None),
    ],
)
def test_checker_final_stage_user(tmp_path: Path, final_stage: str, problem: str | None) -> None:
    path = tmp_path / "x.Dockerfile"
    path.write_text(
        "# probe: httpGet /health on the service's HTTP port\n"
        "FROM python:3.11.7-slim-bookworm AS root-stage\n"
        "FROM python:3.11.7-slim-bookworm AS user-stage\nUSER 10001\n" + final_stage
    )
    problems = check_dockerfile(path)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    ("health", "ok"),
    [
        ('HEALTHCHECK CMD ["bcstack", "--version"]\n', True),
        ("HEALTHCHECK NONE\n", False),
        ("HEALTHCHECK NONE\n# probe: httpGet /health on the HTTP port\n", True),
        ("# probe:\n", False),
        ("# a probe: comment must start the line\n", False),
    ],
)
def test_checker_wants_a_healthcheck_or_probe_comment(tmp_path: Path, health: str, ok: bool) -> None:
    path = tmp_path / "x.Dockerfile"
    path.write_text("FROM python:3.11.7-slim-bookworm\nUSER 10001\n" + health)
    assert check_dockerfile(path) == (
        [] if ok else ["no HEALTHCHECK and no '# probe:' comment naming the Kubernetes probe"]
    )
