"""The agreement matrix: every scheme lmpress writes x every format, each export run by every side.

For one (scheme, format) pair: the recipe's stages and the format are first checked as a run checks
them before any work (:func:`refusal_before_work`); a pair lmpress refuses there is listed as refused.
Otherwise the model is quantized, written in the format, and run by lmpress's runtime, lmpress's
evaluator, each installed consumer of the format, and compared with the dequantized float reference
(the candidate's own weights in float64, activations quantized as the scheme says). A writer that
refuses only after quantizing is a finding of its own ("refused late").
"""

from __future__ import annotations

import copy
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.evals.agreement import (
    BFLOAT16_UNIT,
    FLOAT16_UNIT,
    FLOAT32_UNIT,
    INT8_ACTIVATION_UNIT,
    PairResult,
    Side,
    compare,
    execution_unit,
    greedy_by_logits,
    hf_side,
    logit_scale,
    read_side,
    runtime_side,
)
from lmpress.weights.hadamard import hadamard_matrix
from lmpress.weights.online_rotation import input_rotation_of

FORMATS = ("hf", "gptq", "awq", "compressed-tensors", "gguf", "onnx", "bitsandbytes")
# how a format rounds what the candidate holds: float16 scales (GPTQ, AWQ, GGUF blocks); the rest keep float32
STORAGE_UNIT = {"gptq": FLOAT16_UNIT, "awq": FLOAT16_UNIT, "gguf": FLOAT16_UNIT}
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1905, Albert Einstein published",
    "The following is a list of",
)


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    stages: tuple[dict[str, Any], ...]  # recipe stages, as YAML gives them


SCHEMES = (
    SchemeSpec("W4 g32 sym", ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": True},)),
    SchemeSpec("W4 g32 asym", ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},)),
    SchemeSpec("W8 g32 sym", ({"method": "rtn", "bits": 8, "group_size": 32, "symmetric": True},)),
    SchemeSpec("W8 g32 asym", ({"method": "rtn", "bits": 8, "group_size": 32, "symmetric": False},)),
    SchemeSpec("W4 g32 act-order (GPTQ)", ({"method": "gptq", "bits": 4, "group_size": 32, "act_order": True},)),
    SchemeSpec(
        "2:4 sparse + W4 g32 (SparseGPT)",
        ({"method": "sparsegpt", "pattern": "2:4", "quantize": {"bits": 4, "group_size": 32, "symmetric": True}},),
    ),
    SchemeSpec("W8A8 int8 (SmoothQuant)", ({"method": "smoothquant"},)),
    SchemeSpec(
        "W4A8 g64, int8 activations (RTN)", ({"method": "rtn", "bits": 4, "group_size": 64, "activations": "int8"},)
    ),
    SchemeSpec("FP8 W8A8 (E4M3)", ({"method": "fp8"},)),
    SchemeSpec("bitsandbytes LLM.int8", ({"method": "llm_int8"},)),
    SchemeSpec("bitsandbytes NF4", ({"method": "bnb_4bit"},)),
    SchemeSpec("W4 k-quant (Q4_K)", ({"method": "rtn", "bits": 4, "group_size": 32, "k_quant_scales": True},)),
    SchemeSpec("NVFP4A16 (RTN, MSE scales)", ({"method": "rtn", "fp4": "nvfp4", "mse": True},)),
    SchemeSpec("MXFP4A16 (RTN)", ({"method": "rtn", "fp4": "mxfp4"},)),
    # NVFP4 W4A4 needs a calibrated input_global_scale, which rtn refuses to guess; MXFP4 activations scale per call
    SchemeSpec("MXFP4 W4A4 (RTN)", ({"method": "rtn", "fp4": "mxfp4", "activations": "fp4"},)),
    SchemeSpec(
        "W8A8 int8, rotated with R4 (rotate + SmoothQuant)",
        ({"method": "rotate", "rotate_down_proj": True}, {"method": "smoothquant"}),
    ),
    SchemeSpec(
        "MXFP4 W4A4, rotated with R4 (rotate + RTN)",
        ({"method": "rotate", "rotate_down_proj": True}, {"method": "rtn", "fp4": "mxfp4", "activations": "fp4"}),
    ),
)


def scheme_named(name: str) -> SchemeSpec:
    return next(spec for spec in SCHEMES if spec.name == name)


def stage_configs(spec: SchemeSpec) -> list[Any]:
    from lmpress.registry import stage_config

    return [stage_config(stage["method"])(**stage) for stage in spec.stages]


def refusal_before_work(spec: SchemeSpec, fmt: str, skeleton: nn.Module) -> str | None:
    """What a recipe run would refuse before loading weights (``check_recipe_exports`` and the plan checks)."""
    from lmpress.export.formats import check_export_plan, check_recipe_exports

    stages = stage_configs(spec)
    try:
        check_recipe_exports(stages, [fmt])
        targets = {}
        for stage in stages:
            stage.check(skeleton)
            targets.update(stage.quantized_linears(skeleton))
        check_export_plan(fmt, skeleton, targets)
    except LmpressInputError as e:
        return str(e)
    return None


def build_candidate(model_dir: Path, spec: SchemeSpec, calibration: torch.Tensor, state_dir: Path) -> nn.Module:
    """The model at ``model_dir`` with ``spec``'s stages run on it (in memory, float32)."""
    from transformers import AutoModelForCausalLM

    from lmpress.registry import StageContext, stage_handler_for

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, config in enumerate(stage_configs(spec)):
        ctx = StageContext(lambda: calibration, state_dir / f"{i}", resume=False, fingerprint=spec.name)
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        stage_handler_for(config)(model, config, ctx)
    return model


# The dequantized float reference ------------------------------------------------------------------------


class ReferenceLinear(nn.Module):
    """``y = A(x) W^T + b`` in float64: W the layer's dequantized weight, A the scheme's activation quantization."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activations: str | None,
        fp4: str | None = None,
        input_global_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.double())
        self.register_buffer("bias", None if bias is None else bias.detach().double())
        self.register_buffer("input_global_scale", input_global_scale)
        self.register_buffer("rotation", None)  # R4's V, a dense float64 matrix (``with_input_rotation``)
        self.activations, self.fp4 = activations, fp4

    def with_input_rotation(self, block: int) -> ReferenceLinear:
        """Turn the input by ``V`` first (R4): here a dense matmul by blockdiag(H_block), not the butterfly."""
        n = self.weight.shape[1]
        self.rotation = torch.block_diag(*[hadamard_matrix(block)] * (n // block))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        if self.rotation is not None:
            x = x @ self.rotation  # V is symmetric: x V
        if self.activations == "int8":  # symmetric per token, codes in [-127, 127] (int8_linear.py)
            scale = x.abs().amax(-1, keepdim=True) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            x = torch.round(x / scale).clamp(-127, 127) * scale
        elif self.activations == "fp8":
            from lmpress.weights.float8 import fake_quantize_fp8_per_token

            x = fake_quantize_fp8_per_token(x.float()).double()
        elif self.activations == "fp4":  # per block of the FP4 grid's width, E2M1 codes (weights/fp4.py)
            from lmpress.weights.fp4 import fake_quantize_fp4_activations

            x = fake_quantize_fp4_activations(x.float(), self.fp4, self.input_global_scale).double()
        return F.linear(x, self.weight, self.bias)


def dequantized_layer(module: nn.Module) -> ReferenceLinear | None:
    """``module``'s reference, or None for a module that is not a quantized linear."""
    kind = type(module).__name__
    if kind == "QuantizedLinear":
        return ReferenceLinear(module.dequantized_weight(torch.float32), module.bias, module.scheme.activations)
    if kind == "Fp8Linear":
        return ReferenceLinear(module.dequantized_weight(torch.float32), module.bias, "fp8")
    if kind == "Fp4Linear":
        weight = module.dequantized_weight(torch.float32)
        return ReferenceLinear(weight, module.bias, module.scheme.activations, module.fmt, module.input_global_scale)
    if kind == "Linear8bitLt":
        state = module.state
        codes = module.weight.data if state.CB is None else state.CB
        scb = module.weight.SCB if getattr(module.weight, "SCB", None) is not None else state.SCB
        return ReferenceLinear(codes.float() * (scb.float()[:, None] / 127), module.bias, None)
    if kind == "Linear4bit":
        import bitsandbytes.functional as bnbf

        weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        return ReferenceLinear(weight, module.bias, None)
    return None


def reference_model(candidate: nn.Module) -> nn.Module:
    """The candidate with every quantized linear replaced by its float64 dequantized reference."""
    reference = copy.deepcopy(candidate)
    for name, module in list(candidate.named_modules()):
        replacement = dequantized_layer(module)
        rotation = input_rotation_of(module)
        if replacement is not None and rotation is not None:
            replacement.with_input_rotation(rotation.block)
        if replacement is not None:
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent) if parent else reference, child, replacement)
    return reference.double().eval()


# Consumers ----------------------------------------------------------------------------------------------


@dataclass
class Consumers:
    sides: list[Side] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # consumer -> why it did not run


def consumer_sides(fmt: str, export_dir: Path, evaluator: nn.Module) -> Consumers:
    """Every installed consumer that loads ``fmt``, as sides (and those skipped, with the reason)."""
    found = Consumers()
    try:
        _add_transformers(found, fmt, export_dir, evaluator)
        if fmt == "compressed-tensors":
            _add_compressed_tensors(found, export_dir, evaluator)
        if fmt == "onnx":
            _add_onnxruntime(found, export_dir, evaluator)
        if fmt == "gguf":
            _add_llama_cpp(found, export_dir)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        found.skipped.setdefault("(loading)", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return found


def fp4_formats(fmt: str, export_dir: Path) -> set[str]:
    """The FP4 formats (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``) of a compressed-tensors export's
    config groups; empty for anything else."""
    if fmt != "compressed-tensors":
        return set()
    from lmpress.checkpoint_files import read_config

    qc = read_config(export_dir).get("quantization_config") or {}
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    return formats & {"nvfp4-pack-quantized", "mxfp4-pack-quantized"}


def _add_transformers(found: Consumers, fmt: str, export_dir: Path, evaluator: nn.Module) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    from lmpress.checkpoint_files import read_config

    needs = {"gptq": ("gptqmodel", "GPTQModel"), "awq": ("awq", "AutoAWQ"), "onnx": (None, "an ONNX graph")}
    if fmt in needs:
        package, what = needs[fmt]
        if package is None or importlib.util.find_spec(package) is None:
            found.skipped["transformers"] = f"{fmt} needs {what}" + ("" if package is None else ", not installed")
            return
    if fmt == "compressed-tensors" and read_config(export_dir)["quantization_config"].get("transform_config"):
        found.skipped["transformers"] = (
            f"transformers {transformers.__version__} loads compressed-tensors checkpoints without their "
            "transform_config: it would run the rotated weights on unrotated inputs"
        )
        return
    kwargs: dict[str, Any] = {"gguf_file": "model.gguf"} if fmt == "gguf" else {}
    # compressed-tensors decompresses FP4 weights into bfloat16 (a float32 model then fails in its first matmul):
    # FP4 checkpoints run in bfloat16 there, as they are served
    fp4 = bool(fp4_formats(fmt, export_dir))
    unit = max(execution_unit(evaluator, runtime=False), BFLOAT16_UNIT if fp4 else FLOAT32_UNIT)
    try:
        dtype = torch.bfloat16 if fp4 else torch.float32
        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, **kwargs).eval()
    except (OSError, ValueError, ImportError) as e:
        found.skipped["transformers"] = f"load failed: {str(e).splitlines()[0][:160]}"
        return
    found.sides.append(hf_side("transformers", model, unit))


def _add_compressed_tensors(found: Consumers, export_dir: Path, evaluator: nn.Module) -> None:
    """compressed-tensors' own decompressor for the weights and its own dynamic activation quantization."""
    if importlib.util.find_spec("compressed_tensors") is None:
        found.skipped["compressed-tensors"] = "not installed"
        return
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmpress.checkpoint_files import read_config, read_tensors
    from lmpress.export.compressed_tensors import layer_group

    raw = read_config(export_dir)["quantization_config"]
    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    tensors = read_tensors(export_dir)
    config = AutoConfig.from_pretrained(export_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if raw.get("transform_config"):  # its online hooks, before the weights (whose fused halves it then overwrites)
        from compressed_tensors.transform import TransformConfig, apply_transform_config

        apply_transform_config(model, TransformConfig.model_validate(raw["transform_config"]))
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    dense = {k: v for k, v in tensors.items() if not any(k.startswith(n + ".") and "bias" not in k for n in names)}
    model.load_state_dict(dense, strict=False)
    model.tie_weights()
    for name in names:
        group = layer_group(raw, name)
        scheme = QuantizationScheme.model_validate(
            {k: group.get(k) for k in ("targets", "weights", "input_activations")}
        )
        fmt = group.get("format") or qc.format
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight")}
        weight = BaseCompressor.load_from_registry(fmt).decompress(local, scheme)["weight"].float()
        module = model.get_submodule(name)
        module.weight = nn.Parameter(weight, requires_grad=False)
        if scheme.input_activations is not None:
            args = scheme.input_activations

            def quantize_input(mod: nn.Module, inputs: tuple, args: Any = args) -> tuple:
                scale, zero = compute_dynamic_scales_and_zp(inputs[0], args, mod)
                return (fake_quantize(inputs[0], scale, zero, args),)

            module.register_forward_pre_hook(quantize_input)
    # its dequantize computes NVFP4 weights in bfloat16 (MXFP4's power-of-two scales keep them exact there)
    nvfp4 = "nvfp4-pack-quantized" in fp4_formats("compressed-tensors", export_dir)
    unit = max(execution_unit(evaluator, runtime=False), BFLOAT16_UNIT if nvfp4 else FLOAT32_UNIT)
    found.sides.append(hf_side("compressed-tensors", model, unit))


def _add_onnxruntime(found: Consumers, export_dir: Path, evaluator: nn.Module) -> None:
    """ONNX Runtime's own session: full-sequence logits, greedy decoding through the graph's KV cache."""
    if importlib.util.find_spec("onnxruntime") is None:
        found.skipped["onnxruntime"] = "not installed"
        return
    import numpy as np

    from lmpress.export.onnx import FILE_NAME, greedy_generate, onnx_session, run_decoder

    session = onnx_session(export_dir / FILE_NAME)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(run_decoder(session, ids.numpy().astype(np.int64))[0][0]).float()

    def greedy(prompt: list[int], n: int) -> list[int]:
        return greedy_generate(session, prompt, n)

    found.sides.append(Side("onnxruntime", logits, greedy, execution_unit(evaluator, runtime=False)))


def _add_llama_cpp(found: Consumers, export_dir: Path) -> None:
    """llama.cpp (llama-cpp-python), float32 KV cache; its quantized matmuls take Q8 activation blocks."""
    if importlib.util.find_spec("llama_cpp") is None:
        found.skipped["llama.cpp"] = "llama-cpp-python not installed"
        return
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        str(export_dir / "model.gguf"), n_ctx=512, logits_all=True, verbose=False, type_k=0, type_v=0, n_batch=512
    )

    def logits(ids: torch.Tensor) -> torch.Tensor:
        llm.reset()
        tokens = ids[0].tolist()
        llm.eval(tokens)
        return torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))

    found.sides.append(Side("llama.cpp", logits, greedy_by_logits(logits), INT8_ACTIVATION_UNIT))


# One pair -----------------------------------------------------------------------------------------------


@dataclass
class PairOutcome:
    scheme: str
    format: str
    status: str  # "agree", "disagree", "refused before work", "refused late", "failed"
    detail: str = ""
    results: list[PairResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "format": self.format,
            "status": self.status,
            "detail": self.detail,
            "results": [r.as_dict() for r in self.results],
            "skipped": self.skipped,
            "seconds": self.seconds,
        }


def encode_prompts(tokenizer: Any, max_tokens: int = 24) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens] for text in PROMPTS]


def check_pair(
    model_dir: Path,
    spec: SchemeSpec,
    fmt: str,
    calibration: torch.Tensor,
    workdir: Path,
    new_tokens: int = 8,
    candidate: nn.Module | None = None,
) -> PairOutcome:
    """Quantize, write, load every side, compare; ``candidate`` reuses a model ``spec`` already produced."""
    from transformers import AutoTokenizer

    from lmpress.loader import load_model, model_skeleton
    from lmpress.registry import exporter
    from lmpress.runtime.text import load_runtime

    began = time.perf_counter()
    refusal = refusal_before_work(spec, fmt, model_skeleton(model_dir))
    if refusal:
        return PairOutcome(spec.name, fmt, "refused before work", refusal)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if candidate is None:
        candidate = build_candidate(model_dir, spec, calibration, workdir / "state")
    out = workdir / f"export-{fmt}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        exporter(fmt)(candidate, tokenizer, out)
    except LmpressInputError as e:
        return PairOutcome(spec.name, fmt, "refused late", f"after quantizing: {e}")
    prompts = encode_prompts(tokenizer)
    reference = reference_model(candidate)
    storage = STORAGE_UNIT.get(fmt, FLOAT32_UNIT)
    ref_side = hf_side("reference", reference, storage)
    ref_reading = read_side(ref_side, prompts, new_tokens)
    scale = logit_scale(ref_reading)
    outcome = PairOutcome(spec.name, fmt, "agree")
    try:
        evaluator = load_model(str(out), "float32", fingerprint=False).model
        runtime, _ = load_runtime(str(out))
    except LmpressInputError as e:
        outcome.status, outcome.detail = "disagree", f"lmpress cannot load its own export: {e}"
        return outcome
    consumers = consumer_sides(fmt, out, evaluator)
    sides = [
        hf_side("evaluator", evaluator, execution_unit(evaluator, runtime=False)),
        runtime_side(runtime, execution_unit(evaluator, runtime=True)),
        *consumers.sides,
    ]
    outcome.skipped = consumers.skipped
    evaluator_reading = None
    for side in sides:
        reading = read_side(side, prompts, new_tokens)
        outcome.results.append(compare(side, reading, ref_side, ref_reading, prompts, scale, ref_side.logits))
        if side.name == "evaluator":
            evaluator_reading = reading
        elif side.name == "runtime" and evaluator_reading is not None:
            against = sides[0]
            outcome.results.append(compare(side, reading, against, evaluator_reading, prompts, scale, ref_side.logits))
    failed = [r for r in outcome.results if not r.agrees]
    if failed:
        outcome.status = "disagree"
        outcome.detail = "; ".join(
            f"{r.side} vs {r.against}: max |diff| {r.max_abs_diff:.3g} > {r.tolerance:.3g}"
            if not r.logits_agree
            else f"{r.side} vs {r.against}: greedy parts ({r.first_split})"
            for r in failed
        )
    outcome.seconds = time.perf_counter() - began
    return outcome


# The matrix as Markdown (docs/agreement.md) -------------------------------------------------------------

CELL = {
    "agree": "agree",
    "disagree": "**DISAGREE**",
    "refused before work": "refused",
    "refused late": "**refused late**",
}


def render_matrix(outcomes: list[PairOutcome], model: str, command: str) -> str:
    """The matrix of what ran (scheme rows, format columns), each pair's sides and worst ratio, and refusals."""
    import platform

    by_pair = {(o.scheme, o.format): o for o in outcomes}
    lines = [
        f"Model: {model}. Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"torch {torch.__version__}, {platform.machine()}; {len(outcomes)} of {len(SCHEMES) * len(FORMATS)} pairs run.",
        "",
        "| scheme | " + " | ".join(FORMATS) + " |",
        "| --- |" + " --- |" * len(FORMATS),
    ]
    for spec in SCHEMES:
        cells = []
        for fmt in FORMATS:
            outcome = by_pair.get((spec.name, fmt))
            cells.append("not run" if outcome is None else CELL.get(outcome.status, outcome.status))
        lines.append(f"| {spec.name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Sides compared in each pair that ran (max |logit difference| / tolerance; greedy prompts equal + near ties):",
        "",
    ]
    lines += ["| scheme | format | side vs | max diff | tolerance | ratio to u*M | greedy | skipped consumers |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        skipped = "; ".join(f"{k}: {v}" for k, v in o.skipped.items())
        for r in o.results:
            lines.append(
                f"| {o.scheme} | {o.format} | {r.side} vs {r.against} | {r.max_abs_diff:.3g} | {r.tolerance:.3g} | "
                f"{r.ratio:.2f} | {r.greedy_same}+{r.greedy_ties}/{r.prompts} | {skipped} |"
            )
            skipped = ""
    worst = max((r.ratio for o in outcomes for r in o.results if r.agrees), default=float("nan"))
    lines += ["", f"Largest ratio max|diff| / (u*M) among agreeing sides: {worst:.2f} (the safety factor K is 16).", ""]
    refused = [o for o in outcomes if o.status != "agree"]
    if refused:
        lines += ["Pairs not run to agreement, and why:", ""]
        lines += [f"- {o.scheme} / {o.format}: {o.status}: {o.detail}" for o in refused]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, key: str, body: str) -> None:
    """Replace the generated section ``key`` of ``doc`` (between its begin/end markers) with ``body``."""
    begin, end = f"<!-- agreement:{key}:begin -->", f"<!-- agreement:{key}:end -->"
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + body + end + rest.split(end, 1)[1]
    else:
        text = text + f"\n{begin}\n{body}{end}\n"
    doc.write_text(text)
