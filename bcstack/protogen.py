"""Generate the Python gRPC stubs in `core/v1/` from `proto/` (`make proto`).

`python -m bcstack.protogen` regenerates them in place; `--check` only compares and exits 1,
listing the stale files. Both use the protoc bundled with the pinned `grpcio-tools`
(constraints.txt), so every machine writes the same bytes.

Why `-I proto` with the files under `proto/core/v1/`: protoc names generated imports after
the proto import path, so `import "core/v1/common.proto"` becomes
`from core.v1 import common_pb2`, an absolute import that works as checked in, without the
usual sed fix-up of `*_pb2_grpc.py`.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# The generated package: proto/core/v1/*.proto -> core/v1/*_pb2*.py(i). The protobuf package
# stays `bcstack.v1` (the wire names, e.g. /bcstack.v1.WorkerService/RunEpisode); only the
# Python location is the core layer.
PACKAGE_DIR = Path("core") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc rejected the .proto files; the message holds its diagnostics."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files of the package, sorted (protoc output does not depend on the order)."""
    return sorted((proto_root / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every proto file, writing `core/v1/...` under `out_dir`; return the files."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    files = proto_files(proto_root)
    if not files:
        raise ProtocError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    # The well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise ProtocError(f"protoc failed on {proto_root / PACKAGE_DIR} (see its messages above)")
    return generated_files(out_dir)


def generated_files(root: Path) -> list[Path]:
    """The generated stub files under `root/core/v1`, sorted."""
    pkg = Path(root) / PACKAGE_DIR
    return sorted(p for p in pkg.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES))


def stale_files(repo_root: Path = REPO_ROOT, proto_root: Path | None = None) -> list[str]:
    """Stub paths (relative to the repo root) that differ from a fresh generation.

    Covers missing stubs, stubs whose bytes differ and stubs with no .proto left behind them.
    """
    repo_root = Path(repo_root)
    proto_root = proto_root or repo_root / "proto"
    with tempfile.TemporaryDirectory(prefix="bcstack-protogen-") as tmp:
        fresh = {p.name: p for p in generate(Path(tmp), proto_root)}
        current = (
            {p.name: p for p in generated_files(repo_root)} if (repo_root / PACKAGE_DIR).is_dir() else {}
        )
        stale = []
        for name in sorted(fresh.keys() | current.keys()):
            if (
                name not in fresh
                or name not in current
                or not filecmp.cmp(fresh[name], current[name], shallow=False)
            ):
                stale.append(str(PACKAGE_DIR / name))
        return stale


def write_stubs(repo_root: Path = REPO_ROOT) -> list[Path]:
    """Regenerate the stubs in place; remove stubs whose .proto is gone. Returns the files written."""
    repo_root = Path(repo_root)
    with tempfile.TemporaryDirectory(prefix="bcstack-protogen-") as tmp:
        fresh = generate(Path(tmp), repo_root / "proto")
        target = repo_root / PACKAGE_DIR
        target.mkdir(parents=True, exist_ok=True)
        names = {p.name for p in fresh}
        for old in generated_files(repo_root):
            if old.name not in names:
                old.unlink()
        written = []
        for src in fresh:
            dst = target / src.name
            dst.write_bytes(src.read_bytes())
            written.append(dst)
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bcstack.protogen", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare only; exit 1 and list stale stubs if any differ"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files()
            if stale:
                print("stale gRPC stubs (run `make proto`):", file=sys.stderr)
                for path in stale:
                    print(f"  {path}", file=sys.stderr)
                return 1
            print("gRPC stubs are current")
            return 0
        for path in write_stubs():
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    except ProtocError as exc:
        print(f"protogen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
