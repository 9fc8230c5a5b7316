"""bitsandbytes stages: LLM.int8 (``Linear8bitLt``) and 4-bit NF4 / FP4 (``Linear4bit``), on bitsandbytes itself.

Dettmers, Lewis, Belkada, Zettlemoyer, "LLM.int8(): 8-bit Matrix Multiplication for
Transformers at Scale" (NeurIPS 2022, arXiv:2208.07339): vector-wise int8 weights
and activations, with the input columns holding an outlier above ``threshold``
multiplied in 16-bit (the mixed-precision decomposition, §3.2). Dettmers, Pagnoni,
Holtzman, Zettlemoyer, "QLoRA" (NeurIPS 2023, arXiv:2305.14314): 4-bit NormalFloat
(NF4) weights in blocks of 64 with absmax scales, and double quantization of those
scales (8-bit, blocks of 256, §3).

The stages swap each targeted float ``nn.Linear`` for bitsandbytes' module and let
bitsandbytes quantize the weight, so what is scored is bitsandbytes' own kernels
(CPU here). ``model.config.quantization_config`` records the transformers
``BitsAndBytesConfig``; the ``bitsandbytes`` export (``export/bnb.py``) saves the
checkpoint transformers reloads with its bitsandbytes integration.

Sample recipe stages:

    - method: llm_int8
      threshold: 6.0         # outlier threshold of the mixed-precision decomposition (0: none)
      ignore: [lm_head]

    - method: bnb_4bit
      quant_type: nf4        # nf4 | fp4
      double_quant: true     # quantize the block scales again (QLoRA §3)
      ignore: [lm_head]
"""

from __future__ import annotations

import re
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.registry import LayerPatterns, StageConfig, StageContext, register_stage


def _bnb(where: str) -> Any:
    try:
        import bitsandbytes
    except ImportError as e:
        raise LmpressInputError(f"{where}: bitsandbytes is not installed (pip install bitsandbytes)") from e
    return bitsandbytes


class BnBStageConfig(StageConfig):
    """Keys both bitsandbytes stages accept."""

    ignore: LayerPatterns = ["lm_head"]

    def ignored(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignore)

    def targets(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The float linears this stage wraps; LmpressInputError for a targeted layer bitsandbytes cannot wrap.

        bitsandbytes wraps float ``nn.Linear`` layers only: a layer an earlier stage already quantized
        (lmpress's QuantizedLinear / Fp8Linear, or a bitsandbytes module) is refused, not skipped.
        """
        found, refused = {}, []
        for name, module in model.named_modules():
            if not name or self.ignored(name):
                continue
            if type(module) is nn.Linear:
                found[name] = module
            elif hasattr(module, "in_features") and hasattr(module, "out_features") and not list(module.children()):
                refused.append((name, type(module).__name__))
        if refused:
            name, kind = refused[0]
            raise LmpressInputError(
                f"stage {self.method}: bitsandbytes cannot wrap {len(refused)} layer(s), e.g. {name} ({kind}): "
                "it quantizes float nn.Linear layers; run this stage on the float model, or add them to ignore"
            )
        return found

    def check(self, model: nn.Module) -> None:
        _bnb(f"stage {self.method}")
        self.targets(model)

    def transformers_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def wrap(self, linear: nn.Linear) -> nn.Module:
        raise NotImplementedError


class LLMInt8Config(BnBStageConfig):
    method: Literal["llm_int8"] = "llm_int8"
    threshold: float = Field(6.0, ge=0)

    def transformers_config(self) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        skip = self.ignore or None
        return BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_threshold=self.threshold, llm_int8_skip_modules=skip
        ).to_dict()

    def wrap(self, linear: nn.Linear) -> nn.Module:
        bnb = _bnb("stage llm_int8")
        module = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=self.threshold,
            device="meta",
        )
        module.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        return module.to(linear.weight.device)  # Int8Params quantizes on this move


class BnB4bitConfig(BnBStageConfig):
    method: Literal["bnb_4bit"] = "bnb_4bit"
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True

    def transformers_config(self) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=torch.float32,
            llm_int8_skip_modules=self.ignore or None,
        ).to_dict()

    def wrap(self, linear: nn.Linear) -> nn.Module:
        bnb = _bnb("stage bnb_4bit")
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=torch.float32,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            linear.weight.data.clone(),
            requires_grad=False,
            quant_type=self.quant_type,
            compress_statistics=self.double_quant,
            module=module,
        )
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        return module.to(linear.weight.device)  # Params4bit quantizes on this move


def bnb_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The bitsandbytes linears of ``model``."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return {}
    kinds = (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def keep_unpacked(model: nn.Module) -> nn.Module:
    """Run ``model``'s 4-bit layers on bitsandbytes' dequantizing path, never its CPU repacking.

    On an AVX512-BF16 CPU, ``Linear4bit`` repacks its weight for a faster kernel on the first forward
    and unpacks it when saved; that round trip is not exact (bitsandbytes 0.50), so a candidate that
    ran a forward before its export would no longer hold the weights it exports. lmpress's candidate
    and every bitsandbytes artifact lmpress loads keep the packed layout as quantized.
    """
    for module in bnb_layers(model).values():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def run_bnb(model: nn.Module, config: BnBStageConfig, ctx: StageContext) -> dict:
    config.check(model)
    targets = config.targets(model)
    for name, linear in ctx.bars.track(targets.items(), f"{config.method}: layers", total=len(targets)):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, config.wrap(linear).train(linear.training))
    keep_unpacked(model)
    model.config.quantization_config = config.transformers_config()
    return {"quantized_layers": len(targets)}


register_stage("llm_int8", LLMInt8Config)(torch.no_grad()(run_bnb))
register_stage("bnb_4bit", BnB4bitConfig)(torch.no_grad()(run_bnb))
