"""One llm-compressor FP4 row of bench/fp4_table.py, run by the python of llm-compressor's own virtual environment.

    LLMC_PYTHON bench/llmc_fp4.py ROW MODEL_DIR DATA.pt

``MODEL_DIR`` is SmolLM2 as a float32 Hugging Face checkpoint; ``DATA.pt`` holds the calibration samples and the
perplexity windows lmpress's own rows use (``bench/fp4_table.py`` writes both), so both sides see the same tokens.
The recipes are llm-compressor's own examples (examples/quantization_w4a4_fp4, examples/transform), with SmolLM2's
sizes: its hidden size 576 takes Hadamard blocks of 64, not the examples' 128. The quantized model is scored as
llm-compressor leaves it in memory (compressed-tensors' fake quantization in each Linear's forward: the weights'
FP4 values, and for W4A4 the activations' per-block FP4 quantization), the way its examples evaluate. Prints one
JSON line.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch


def recipe(row: str) -> list:
    from compressed_tensors.quantization import FP8_E4M3_DATA, QuantizationArgs, QuantizationStrategy, QuantizationType
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

    def plain(scheme: str) -> QuantizationModifier:
        return QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])

    # examples/transform/nvfp4_quip_gptq_example.py's weights: NVFP4, MSE observer, GPTQ with static act-order
    mse_nvfp4a16 = {
        "weights": QuantizationArgs(
            num_bits=4,
            actorder="static",
            type=QuantizationType.FLOAT,
            strategy=QuantizationStrategy.TENSOR_GROUP,
            symmetric=True,
            dynamic=False,
            group_size=16,
            scale_dtype=FP8_E4M3_DATA.dtype,
            zp_dtype=FP8_E4M3_DATA.dtype,
            observer="mse",
        ),
        "targets": ["Linear"],
    }
    recipes = {
        "llmc-nvfp4a16": lambda: [plain("NVFP4A16")],
        "llmc-nvfp4a16-gptq": lambda: [GPTQModifier(config_groups={"group_0": mse_nvfp4a16}, ignore=["lm_head"])],
        "llmc-quip-nvfp4a16-gptq": lambda: [
            QuIPModifier(rotations=["v", "u"], transform_block_size=64, transform_type="hadamard"),
            GPTQModifier(config_groups={"group_0": mse_nvfp4a16}, ignore=["lm_head"]),
        ],
        "llmc-mxfp4a16": lambda: [plain("MXFP4A16")],
        "llmc-nvfp4": lambda: [plain("NVFP4")],
        "llmc-quip-nvfp4": lambda: [
            QuIPModifier(rotations=["v", "u"], transform_block_size=64, transform_type="random-hadamard"),
            plain("NVFP4"),
        ],
        "llmc-spinquant-nvfp4": lambda: [
            SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_block_size=64, transform_type="hadamard"),
            plain("NVFP4"),
        ],
    }
    return recipes[row]()


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp of the mean next-token NLL over every window (each window on its own, no BOS): lmpress's protocol."""
    total, count = 0.0, 0
    for window in windows:
        logits = model(window[None]).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += window.numel() - 1
    return math.exp(total / count)


def main() -> int:
    row, model_dir, data_path = sys.argv[1:4]
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    data = torch.load(data_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    calibration = Dataset.from_list([{"input_ids": s.tolist()} for s in data["calibration"]])
    began = time.perf_counter()
    if row != "llmc-fp32":  # the float model through this evaluation: the protocol check against lmpress's 20.97
        oneshot(
            model=model,
            dataset=calibration,
            recipe=recipe(row),
            max_seq_length=data["calibration"].shape[1],
            num_calibration_samples=data["calibration"].shape[0],
        )
    seconds = time.perf_counter() - began
    model.eval()
    ppl = perplexity(model, data["windows"])
    versions = {"llmcompressor": llmcompressor.__version__, "torch": torch.__version__}
    print(json.dumps({"row": row, "ppl": ppl, "seconds": seconds, "versions": versions}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
