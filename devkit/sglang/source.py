"""Which SGLang versions the stack is held to, and their source files out of the PyPI wheels.

The pinned version is named in one place: the worker's SGLang image tag in
`charts/bcstack/values.yaml` (`worker.engine.image.tag`, e.g. `v0.5.19-cu129` -> 0.5.19), since
that is the server a deployment runs. `NEWEST` is the second contract target, so that moving the
pin to it is a one-line change whose contract test run says beforehand what would break.

Wheels are fetched with `pip download --no-deps` into `.cache/sglang/<version>/` (ignored by git;
`scripts/install.sh` runs `python -m devkit.sglang.source`), then read as zip files: nothing of
SGLang is installed or imported.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "charts" / "bcstack" / "values.yaml"
CACHE = REPO / ".cache" / "sglang"
# The newest SGLang release read for the contract (PyPI, checked when this was written).
NEWEST = "0.5.23"
# The only files read out of a wheel (devkit.sglang.facts says what each holds).
READ_PREFIXES = (
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/managers/",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/srt/utils/weight_versions.py",
    "sglang/srt/server_args.py",
    "sglang/srt/arg_groups/",
)
_TAG = re.compile(r"v?(\d+\.\d+\.\d+(?:\.post\d+)?)(?:-.*)?")


class SourceUnavailable(RuntimeError):
    """A wheel is not in the cache and could not be fetched."""


def pinned_version(values: Path = VALUES) -> str:
    """The SGLang version the chart runs: its worker image tag without `v` and the CUDA suffix."""
    tag = str(yaml.safe_load(values.read_text(encoding="utf-8"))["worker"]["engine"]["image"]["tag"])
    match = _TAG.fullmatch(tag)
    if match is None:
        raise ValueError(f"{values}: worker.engine.image.tag {tag!r} names no SGLang version")
    return match.group(1)


def targets() -> tuple[str, ...]:
    """Every version the contract is checked against: the pin first, then the newest release."""
    return tuple(dict.fromkeys((pinned_version(), NEWEST)))


def wheel_path(version: str, cache_dir: Path = CACHE) -> Path | None:
    found = sorted((cache_dir / version).glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def fetch(version: str, cache_dir: Path = CACHE) -> Path:
    """The wheel of `version`, downloaded once (`pip download --no-deps`); idempotent."""
    have = wheel_path(version, cache_dir)
    if have is not None:
        return have
    folder = cache_dir / version
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":none:", "-q"]
    command += ["--disable-pip-version-check", f"sglang=={version}", "-d", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    have = wheel_path(version, cache_dir)
    if done.returncode != 0 or have is None:
        raise SourceUnavailable(
            f"sglang {version}: pip download failed ({done.stderr.strip()[-300:] or done.returncode}); "
            f"run scripts/install.sh with network access, or put the wheel in {folder}"
        )
    return have


class WheelSource:
    """The `.py` files of one SGLang wheel, read by their path inside the package."""

    def __init__(self, version: str, files: dict[str, str]) -> None:
        self.version = version
        self._files = files

    @classmethod
    def from_wheel(cls, version: str, wheel: Path) -> WheelSource:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith(READ_PREFIXES) and n.endswith(".py")]
            return cls(version, {n: z.read(n).decode("utf-8") for n in names})

    @classmethod
    def from_folder(cls, version: str, root: Path) -> WheelSource:
        """A copied (possibly edited) tree laid out as in the wheel: `root/sglang/srt/...`."""
        files = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in root.rglob("*.py")}
        return cls(version, files)

    def read(self, path: str) -> str:
        try:
            return self._files[path]
        except KeyError:
            raise FileNotFoundError(f"sglang {self.version} has no {path}") from None

    def has(self, path: str) -> bool:
        return path in self._files

    def paths(self, prefix: str) -> list[str]:
        return sorted(p for p in self._files if p.startswith(prefix))

    def write(self, root: Path, paths: list[str]) -> None:
        """Copy `paths` under `root` (for a test that edits SGLang's source and re-checks)."""
        for path in paths:
            out = root / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(self._files[path], encoding="utf-8")


@cache
def load(version: str) -> WheelSource:
    """The source of `version` (fetched into the cache first when missing)."""
    return WheelSource.from_wheel(version, fetch(version))


def main() -> None:
    """`python -m devkit.sglang.source`: fetch every target's wheel (install.sh runs it)."""
    for version in targets():
        print(f"sglang {version}: {fetch(version).relative_to(REPO)}")


if __name__ == "__main__":
    main()
