"""`make images`: build every image of docker/ with whichever of docker, podman or buildah is here,
in the order they depend on each other, tagged with the chart's appVersion; then print the
`--set` lines that point charts/bcstack at them.

    python -m devkit.images [--registry ghcr.io/browsecomp-stack] [--tool docker|podman|buildah]
                            [--only coordinator,judge] [--push] [--dry-run]

The plan: the common image (docker/bcstack.Dockerfile, every extra), then one variant of it per
service with that service's extra (`BCSTACK_EXTRA`, and `WITH_TORCH` where the extra needs torch),
then each service image FROM its variant (`BCSTACK_IMAGE`). The plan is written here rather than
discovered, and tests/test_images.py holds it to the Dockerfiles: each service Dockerfile's
`ARG BCSTACK_IMAGE` default names the variant this plan builds for it, at the chart's version.
Written by hand: no build tool here orders multi-file builds across docker, podman and buildah.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "bcstack" / "Chart.yaml"
TOOLS = ("docker", "podman", "buildah")
# Each service: its package extra and whether that extra needs torch (docker/bcstack.Dockerfile).
SERVICES: dict[str, bool] = {
    "coordinator": False,
    "judge": False,
    "worker": False,
    "retrieval": True,
    "trainer": True,
}


@dataclass(frozen=True)
class Build:
    name: str
    dockerfile: str
    tag: str
    args: dict[str, str] = field(default_factory=dict)

    def command(self, tool: str) -> list[str]:
        verb = ["build"] if tool != "buildah" else ["build", "--layers"]
        cmd = [tool, *verb, "-f", self.dockerfile, "-t", self.tag]
        for key, value in self.args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        return [*cmd, "."]


def app_version() -> str:
    return str(yaml.safe_load(CHART.read_text())["appVersion"])


def plan(registry: str, version: str, only: list[str] | None = None) -> list[Build]:
    """The builds in order: the common image, each service's variant, each service image."""
    registry = registry.rstrip("/")
    services = [s for s in SERVICES if not only or s in only]
    builds = [
        Build(
            "bcstack",
            "docker/bcstack.Dockerfile",
            f"{registry}/bcstack:{version}",
            {"BCSTACK_VERSION": version},
        )
    ]
    for service in services:
        builds.append(
            Build(
                f"bcstack-{service}-base",
                "docker/bcstack.Dockerfile",
                f"{registry}/bcstack:{version}-{service}",
                {
                    "BCSTACK_EXTRA": service,
                    "WITH_TORCH": str(SERVICES[service]).lower(),
                    "BCSTACK_VERSION": version,
                },
            )
        )
    for service in services:
        builds.append(
            Build(
                f"bcstack-{service}",
                f"docker/{service}.Dockerfile",
                f"{registry}/bcstack-{service}:{version}",
                {"BCSTACK_IMAGE": f"{registry}/bcstack:{version}-{service}", "BCSTACK_VERSION": version},
            )
        )
    return builds


def chart_values(registry: str, version: str, only: list[str] | None = None) -> list[str]:
    """`--set` arguments pointing the chart's images at the plan's tags."""
    host, _, prefix = registry.rstrip("/").partition("/")
    repo = f"{prefix}/" if prefix else ""
    sets = [f"image.registry={host}", f"image.repository={repo}bcstack", f"image.tag={version}"]
    sets += [f"{s}.image.repository={repo}bcstack-{s}" for s in SERVICES if not only or s in only]
    return sets


def find_tool(wanted: str | None) -> str | None:
    for tool in [wanted] if wanted else TOOLS:
        if shutil.which(tool):
            return tool
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make images", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--registry", default="ghcr.io/browsecomp-stack", help="registry/namespace of the tags"
    )
    parser.add_argument(
        "--tool", choices=TOOLS, help="the builder (default: the first of docker, podman, buildah found)"
    )
    parser.add_argument("--only", default="", help="comma-separated services (default: all five)")
    parser.add_argument("--push", action="store_true", help="push each image after building it")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SERVICES))
    if unknown:
        print(f"images: unknown service {unknown[0]} (known: {', '.join(SERVICES)})", file=sys.stderr)
        return 2
    version = app_version()
    builds = plan(args.registry, version, only)
    tool = find_tool(args.tool) or ("docker" if args.dry_run else None)
    if tool is None:
        wanted = args.tool or " or ".join(TOOLS)
        print(f"images: no {wanted} on PATH; install one (or see the plan with --dry-run)", file=sys.stderr)
        return 2
    for number, build in enumerate(builds, 1):
        cmd = build.command(tool)
        print(f"[{number}/{len(builds)}] {build.tag}", flush=True)
        print("  " + shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"images: building {build.tag} failed (the command above); stopping", file=sys.stderr)
            return 1
        if args.push and subprocess.run([tool, "push", build.tag], cwd=ROOT).returncode != 0:
            print(f"images: pushing {build.tag} failed; stopping", file=sys.stderr)
            return 1
    print("\nPoint the chart at them:")
    print("  helm install ... " + " ".join(f"--set {s}" for s in chart_values(args.registry, version, only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
