"""MkDocs hook: the benchmark results (bench/results/*.png, *.md) become part of the site at
bench/results/, so the docs show the plots the benchmarks commit without copying them into docs/.

Hand-written because it is a dozen lines; mkdocs-gen-files would add a plugin for the same."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent  # the repository


def on_files(files, config):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    for path in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(
            File(
                str(path.relative_to(ROOT)),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
