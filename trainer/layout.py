"""The job's [dp, tp] arithmetic, without torch: `bcstack train sft|grpo|rl` check `--tp` against
torchrun's WORLD_SIZE with it before importing torch and transformers, so a layout that cannot
work is one error line in half a second instead of six (`trainer.distributed` builds the mesh and
checks the model's shape with the same `check_layout`)."""

from __future__ import annotations

import os
from typing import Any


class LayoutError(ValueError):
    """The job's size and `--tp` (or the model's shape) make no valid [dp, tp] layout."""


def requested_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 outside torchrun or when it is not a number)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_layout(world_size: int, tp: int, config: Any | None = None) -> int:
    """dp for a job of `world_size` processes at tensor-parallel size `tp`; LayoutError when the
    numbers (or, given `config`, the model's heads, KV heads, MLP width and vocabulary) do not divide."""
    if tp < 1:
        raise LayoutError(f"--tp must be at least 1, got {tp}")
    if world_size % tp:
        raise LayoutError(
            f"--tp {tp} does not divide the job's {world_size} processes "
            "(torchrun --nproc_per_node x --nnodes)"
        )
    if config is not None and tp > 1:
        sizes = {
            "attention heads": config.num_attention_heads,
            "KV heads": config.num_key_value_heads,
            "MLP width": config.intermediate_size,
            "vocabulary": config.vocab_size,
        }
        uneven = [f"{name} {size}" for name, size in sizes.items() if size % tp]
        if uneven:
            raise LayoutError(f"--tp {tp} does not divide the model's {', '.join(uneven)}")
    return world_size // tp


def early_layout_error(tp: int) -> str | None:
    """Why `--tp` cannot lay out this torchrun job (None when it can, as far as sizes alone say)."""
    try:
        check_layout(requested_world_size(), tp)
    except LayoutError as error:
        return str(error)
    return None
