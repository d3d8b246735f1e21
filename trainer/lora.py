"""LoRA for the seed-004 specialists through `peft`: attach, merge, and the validated merge-lora export.

Seed 004: "LoRA rank 16, alpha 32, dropout 0; attention projections, MLP projections, and lm_head
adapted ... LoRA deltas were merged in FP32, then saved as BF16. Input embeddings were preserved and
the adapted output head is untied. Export validation checked all 506 adapter tensors and exact
logits after BF16 save/reload."

Target groups (`--lora-targets`): ``attn`` = q/k/v/o projections, ``mlp`` = gate/up/down, ``lm_head``.
On Qwen3-4B (36 layers) that is 36 x 7 + 1 = 253 adapted modules, each with an A and a B matrix:
506 adapter tensors, the seed's number (tests/test_lora.py counts them on the meta-device layout).

Untying. Qwen3-4B ties ``lm_head.weight`` to ``embed_tokens.weight`` (one tensor). Merging a head
delta into a tied weight would also change the input embedding, so the head is untied first (a copy
of the embedding), the delta goes into the copy, and the embedding stays bit for bit what it was.

`merge_lora` (``bcstack train merge-lora``) checks, and writes into ``model_provenance.json``:

1. every tensor in the adapter file is a LoRA A/B matrix of a module of the base, loaded into the
   model bit for bit: peft loads a state dict non-strictly and would skip a misnamed tensor with a
   warning, so a renamed or missing tensor fails here instead (``adapter_tensors`` counts them);
2. the FP32 merge equals the unmerged adapter: the merged model's logits against base + adapter
   computed through the LoRA branches, on probe prompts, within `merge_tolerance` (two float32
   summation orders of the same product: their rounding grows with the logits' size, so the bound is
   `MERGE_ATOL + MERGE_RTOL * max|logit|`, as `torch.allclose` bounds it; a skipped or wrong delta, or
   a dropped LoRA scaling, is orders of magnitude larger);
3. the input embedding is unchanged and the head untied;
4. exact logits after BF16 save/reload: the FP32-merged model cast to BF16 in memory and the BF16
   export read back from disk give bitwise-equal logits on the probes (the same weights in the same
   dtype through the same kernels; any lost, re-tied, reordered or re-rounded tensor breaks equality).
   Compared over the tokenizer's rows: the export trims the embedding's padding rows, which no
   token id reaches.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TARGET_GROUPS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "lm_head": ("lm_head",),
}
SEED_TARGETS = ("attn", "mlp", "lm_head")
PROVENANCE_FILE = "model_provenance.json"
MERGE_ATOL = 1e-4  # float32 merge vs the LoRA branch (see the module docstring, check 2)
MERGE_RTOL = 2e-5  # ~100 float32 ulps of the largest logit: a 1.2e-4 gap at |logit| ~ 10 is rounding
PROBE_TEXTS = (
    "Solve the following math problem step by step.",
    "What number comes next in the sequence 3, 5, 7?",
    "The quick brown fox jumps over the lazy dog 12 times.",
)


class LoraError(ValueError):
    """A LoRA setting, adapter or merge that fails (one line)."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16  # seed 004
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] = SEED_TARGETS

    def target_modules(self) -> list[str]:
        unknown = [t for t in self.targets if t not in TARGET_GROUPS]
        if unknown or not self.targets:
            raise LoraError(
                f"unknown LoRA target group {', '.join(unknown) or '(none)'}; use a comma list of "
                f"{', '.join(TARGET_GROUPS)}"
            )
        return [m for t in self.targets for m in TARGET_GROUPS[t]]

    def peft_config(self) -> Any:
        from peft import LoraConfig

        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise LoraError(f"LoRA needs rank >= 1, alpha > 0 and dropout in [0, 1); got {self}")
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules(),
            bias="none",
            task_type="CAUSAL_LM",
        )


def parse_targets(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def untie_head(model: torch.nn.Module) -> bool:
    """Give a tied output head its own copy of the embedding; True when it was tied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if tied:
        head.weight = torch.nn.Parameter(
            embed.weight.detach().clone(), requires_grad=head.weight.requires_grad
        )
    model.config.tie_word_embeddings = False
    # transformers re-ties on save/load when the class lists tied keys and the config says so.
    return tied


def attach_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """The peft model: `model` (untied first when the head is adapted) with fresh LoRA matrices."""
    from peft import get_peft_model

    if "lm_head" in settings.targets:
        untie_head(model)
    return get_peft_model(model, settings.peft_config())


def lora_layers(peft_model: Any) -> dict[str, Any]:
    """Module name (base model's naming) -> peft LoRA layer, for every adapted module."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {
        name.removeprefix(prefix): module
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    }


def adapter_tensor_count(peft_model: Any) -> int:
    """LoRA A and B matrices in the model (seed 004: 506 for Qwen3-4B over attn, MLP and lm_head)."""
    return sum(1 for name, _ in peft_model.named_parameters() if ".lora_A." in name or ".lora_B." in name)


def merged_state_dict(peft_model: Any, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta added in float32; the peft model is untouched.

    Keys are the plain transformers names (what `save_pretrained` of the base writes), so the result
    loads into the base architecture with an untied head.
    """
    layers = lora_layers(peft_model)
    base = peft_model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            module_name = plain.rsplit(".", 1)[0]
            layer = layers.get(module_name)
            if layer is not None and plain.endswith(".weight") and adapter in layer.lora_A:
                delta = layer.get_delta_weight(adapter).to(torch.float32)
                merged[plain] = (value.to(torch.float32) + delta).contiguous()
            else:
                merged[plain] = value.detach().to(torch.float32).clone()
    return merged


def save_merged(peft_model: Any, out: Path, tokenizer_dir: Path | None = None) -> None:
    """Write the FP32-merged model (untied head) as an HF folder with the base's tokenizer files."""
    from safetensors.torch import save_file

    base = peft_model.get_base_model()
    out.mkdir(parents=True, exist_ok=True)
    config = base.config.to_dict()
    config["tie_word_embeddings"] = False
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(merged_state_dict(peft_model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ):
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)


# --- merge-lora --------------------------------------------------------------------------------------


@dataclass
class MergeReport:
    adapter_tensors: int
    adapted_modules: int
    merge_max_abs_diff: float
    embedding_preserved: bool
    head_untied: bool
    logits_check: dict[str, Any]
    merge_tolerance: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _adapter_file_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = adapter_dir / "adapter_model.safetensors"
    if path.is_file():
        return load_file(str(path))
    bin_path = adapter_dir / "adapter_model.bin"
    if bin_path.is_file():
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise LoraError(f"{adapter_dir}: no adapter_model.safetensors (not a peft adapter folder)")


def _check_adapter_loaded(peft_model: Any, file_tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Every file tensor was loaded into the model bit for bit: (LoRA A/B matrices, full tensors).

    A full tensor is a module weight peft saved beside the adapter (`save_embedding_layers`, which it
    turns on by itself when lm_head is a target): it replaces that base weight, so it is checked too.
    """
    named = {name.removeprefix("base_model.model."): p for name, p in peft_model.named_parameters()}
    lora_params = {
        n.replace(".default.", "."): p for n, p in named.items() if ".lora_A." in n or ".lora_B." in n
    }
    unmatched = []
    lora = full = 0
    for key, tensor in file_tensors.items():
        plain = key.removeprefix("base_model.model.")
        is_lora = ".lora_A." in plain or ".lora_B." in plain
        param = lora_params.get(plain) if is_lora else named.get(plain)
        if param is None or param.shape != tensor.shape:
            unmatched.append(key)
            continue
        loaded, written = param.detach().to(torch.float32), tensor.to(torch.float32)
        # Bit for bit, NaN included (a NaN written is a NaN loaded; the merge check rejects it).
        if loaded.shape != written.shape or not torch.allclose(
            loaded, written, rtol=0, atol=0, equal_nan=True
        ):
            raise LoraError(f"adapter tensor {key} was not loaded as written")
        lora += is_lora
        full += not is_lora
    if unmatched:
        raise LoraError(
            f"{len(unmatched)} of {len(file_tensors)} adapter tensors match no tensor of the adapted base "
            f"(first: {unmatched[0]}); the merge would skip them"
        )
    if lora != len(lora_params):
        raise LoraError(
            f"the adapter file holds {lora} LoRA tensors but its config adapts {len(lora_params) // 2} "
            f"modules ({len(lora_params)} tensors); some modules would merge nothing"
        )
    return lora, full


def _probe_ids(tokenizer_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tok.encode(text, add_special_tokens=False).ids for text in PROBE_TEXTS]


def _logits(model: torch.nn.Module, probes: Sequence[Sequence[int]], rows: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0, :, :rows] for ids in probes]


def merge_tolerance(logits: Sequence[torch.Tensor]) -> float:
    """The largest gap two float32 summation orders of the same logits may show (check 2)."""
    return MERGE_ATOL + MERGE_RTOL * max(float(t.abs().max()) for t in logits)


def merge_lora(
    base_dir: Path,
    adapter_dir: Path,
    out_dir: Path,
    *,
    force: bool = False,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Merge a peft adapter into its base in FP32, export BF16, validate; returns the provenance."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from core.checkpoint import read_tokenizer_size, write_sha256sums
    from core.model_layout import read_json
    from trainer.export import export_checkpoint

    hf_logging.disable_progress_bar()
    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if not (base_dir / "config.json").is_file():
        raise LoraError(f"--base {base_dir}: not a model folder (no config.json)")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise LoraError(f"--adapter {adapter_dir}: not a peft adapter folder (no adapter_config.json)")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise LoraError(f"--out {out_dir} is not empty; pass --force to replace it")
    adapter_config = read_json(adapter_dir / "adapter_config.json", "adapter_config.json")
    if adapter_config.get("peft_type") != "LORA":
        raise LoraError(
            f"--adapter {adapter_dir}: peft_type {adapter_config.get('peft_type')!r}, expected LORA"
        )
    file_tensors = _adapter_file_tensors(adapter_dir)

    say("Loading the base in FP32")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    embedding_before = base.get_input_embeddings().weight.detach().clone()
    targets = PeftConfig.from_pretrained(str(adapter_dir)).target_modules or []
    head_adapted = "lm_head" in targets
    was_tied = untie_head(base) if head_adapted else False
    say("Applying the adapter")
    try:
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False).eval()
    except (ValueError, RuntimeError, KeyError) as e:
        raise LoraError(
            f"--adapter {adapter_dir}: peft could not load it: {str(e).splitlines()[0]}"
        ) from None
    count, full_tensors = _check_adapter_loaded(peft_model, file_tensors)
    tokenizer_rows = read_tokenizer_size(base_dir).rows
    probes = _probe_ids(base_dir)
    lora_logits = _logits(peft_model, probes, tokenizer_rows)

    with tempfile.TemporaryDirectory(
        prefix=".merge-", dir=out_dir.parent if out_dir.parent.exists() else None
    ) as tmp:
        merged_dir = Path(tmp) / "merged-fp32"
        say("Merging in FP32")
        save_merged(peft_model, merged_dir, tokenizer_dir=base_dir)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        merged_logits = _logits(merged, probes, tokenizer_rows)
        diff = max(float((a - b).abs().max()) for a, b in zip(lora_logits, merged_logits, strict=True))
        tolerance = merge_tolerance(lora_logits)
        if not diff <= tolerance:  # also catches nan
            raise LoraError(
                f"the FP32 merge differs from base + adapter by {diff:.3g} in the logits "
                f"(> {tolerance:.3g}, logits up to {max(float(t.abs().max()) for t in lora_logits):.3g})"
            )
        preserved = torch.equal(merged.get_input_embeddings().weight, embedding_before)
        if not preserved:
            raise LoraError("the merge changed the input embedding")
        untied = (
            merged.get_output_embeddings().weight.data_ptr()
            != merged.get_input_embeddings().weight.data_ptr()
        )
        # Weights cast to BF16 as loading casts them; `.to(bfloat16)` on the module would also round
        # the float32 RoPE buffers, which a BF16 load keeps in float32.
        cast = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).eval()
        cast_logits = _logits(cast, probes, tokenizer_rows)
        say("Exporting BF16")
        summary = export_checkpoint(merged_dir, out_dir, tokenizer_dir=base_dir, force=force)
    say("Checking the logits after the BF16 reload")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
    reload_logits = _logits(reloaded, probes, tokenizer_rows)
    mismatched = sum(int((a != b).sum()) for a, b in zip(cast_logits, reload_logits, strict=True))
    total = sum(a.numel() for a in cast_logits)
    logits_check = {
        "passed": mismatched == 0,
        "rule": "bitwise equal: FP32-merged model cast to BF16 in memory vs the BF16 export read from disk",
        "probes": len(probes),
        "positions": sum(len(p) for p in probes),
        "logits_compared": total,
        "logits_differing": mismatched,
    }
    report = MergeReport(count, count // 2, diff, preserved, untied, logits_check, tolerance)
    provenance = {
        "base": {"path": str(base_dir.resolve()), "revision": _revision(base_dir)},
        "adapter": {"path": str(adapter_dir.resolve()), "config": adapter_config},
        "merge": "FP32 (W + scale * B @ A), saved BF16; input embedding preserved, lm_head untied"
        if head_adapted
        else "FP32 (W + scale * B @ A), saved BF16",
        "head_was_tied": was_tied,
        "full_tensors": full_tensors,
        **report.as_dict(),
        "export": {
            "tensors": summary["tensors"],
            "dtype": summary["dtype"],
            "vocab_rows": summary["vocab_rows"],
        },
    }
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    write_sha256sums(out_dir)
    if not logits_check["passed"]:
        raise LoraError(
            f"logits after the BF16 save/reload differ in {mismatched:,} of {total:,} values; the export "
            f"is in {out_dir} with {PROVENANCE_FILE} for inspection"
        )
    return provenance


def _revision(model_dir: Path) -> str | None:
    """The base's revision: a Hub snapshot's commit, else a hash that pins the exact files.

    A folder under a Hub cache (`.../snapshots/<commit>/`) names its commit; a serving export is
    pinned by the hash of its SHA256SUMS, a tiny kit by its manifest's weights hash.
    """
    import hashlib

    resolved = model_dir.resolve()
    if resolved.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", resolved.name):
        return resolved.name
    sums = model_dir / "SHA256SUMS"
    if sums.is_file():
        return "sha256sums:" + hashlib.sha256(sums.read_bytes()).hexdigest()
    manifest = model_dir / "bcstack_model.json"
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text()).get("files", {})
        except json.JSONDecodeError:
            files = {}
        if isinstance(files, dict) and isinstance(files.get("model.safetensors"), str):
            return "sha256:" + files["model.safetensors"]
    return None
