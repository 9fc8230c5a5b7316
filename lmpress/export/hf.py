"""The modified model as an ordinary Hugging Face checkpoint (dense float weights, safetensors)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from lmpress.registry import register_exporter


@register_exporter("hf")
def export_hf(model: nn.Module, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
