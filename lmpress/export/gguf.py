"""GGUF files for llama.cpp (and Ollama, LM Studio): ``OUT/gguf/model.gguf``.

Llama-family models (``model_type`` llama, or mistral without a sliding window), Qwen2
(its q/k/v biases) and Qwen3 (its q/k norms) are written, as llama.cpp's ``llama``,
``qwen2`` and ``qwen3`` architectures, with the metadata and tokenizer llama.cpp needs: the
byte-level BPE vocabulary, its merges and token types, the pre-tokenizer name, BOS/EOS and
the chat template.

Quantized layers keep lmpress's integer codes; each maps onto a GGML block type exactly:

- W4, groups of 32, symmetric (zero point 8), scales on the k-quant grid (``k_quant_scales:
  true``; input width a multiple of 256): ``Q4_K`` (per 256 columns a float16 ``d`` and
  ``dmin``, eight 6-bit scales ``sc_j`` and mins ``m_j``, 128 bytes of nibbles,
  ``w = d * sc_j * q - dmin * m_j``; here ``dmin = 8 * d`` and ``m_j = sc_j``, so
  ``w = (q - 8) * d * sc_j``). Whether a layer's scales are on that grid is read from the
  scales themselves (``kquant.kquant_grid``), so a GPTQ or compressed-tensors checkpoint read
  back qualifies too;
- other W4, groups of 32, symmetric: ``Q4_0`` (per block of 32 columns a float16 scale ``d``
  and 16 bytes of nibbles, ``w = (q - 8) * d``);
- W8, groups of 32, symmetric (zero point 128): ``Q8_0`` (``d`` and 32 int8 ``q - 128``);
- MXFP4 (``Fp4Linear``: E2M1 codes in blocks of 32, E8M0 scales): ``MXFP4`` (per block the exponent byte and
  16 bytes of nibbles, ``ggml_blocks.pack_mxfp4``), codes and exponents as they are. NVFP4 is refused: gguf's
  ``NVFP4`` blocks (64 columns, unsigned E4M3 scales) have no per-tensor global scale to divide by.

Groups of a multiple of 32 columns (64, 128, or one per row) land on these blocks as they are: each group's
scale is written to each of its 32-column blocks, so the file holds the same codes and scales.

The scales are stored as float16, so the file dequantizes to the candidate's weights with
its scales rounded to float16 (what GPTQ and AWQ checkpoints store too), bit for bit; k-quant
scales are float16 products ``d * sc_j`` already. Other schemes have no exact GGML block
(groups not a multiple of 32, act-order ``g_idx`` that permutes columns across blocks, asymmetric
zero points, 2 or 3 bits) and are refused from the recipe alone, before any weight is
loaded, naming what would work. Every other tensor is written in the model's float type
(F32, F16 or BF16), norms as F32.

llama.cpp's ``llama`` rotates query/key pairs interleaved where transformers' Llama rotates
halves, so ``q_proj`` and ``k_proj`` rows are permuted as llama.cpp's own converter does; a row
permutation leaves the blocks, which lie within a row, intact. ``read_gguf`` undoes it when
reading back. Its ``qwen2`` and ``qwen3`` rotate halves (NEOX), as transformers does: no permutation.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.export.artifact_checks import check_gguf, gguf_field
from lmpress.export.formats import (
    PlannedLayer,
    act_order_g_idx,
    fp16_scales,
    quantized_layers,
)
from lmpress.export.ggml_blocks import (
    BLOCK,
    pack_mxfp4,
    pack_q4_0,
    pack_q4_k,
    pack_q8_0,
    unpack_mxfp4,
    unpack_q4_0,
    unpack_q4_k,
    unpack_q8_0,
)
from lmpress.export.gguf_metadata import add_metadata
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight, decode_e8m0, fp4_layers
from lmpress.weights.kquant import SUPER_BLOCK, kquant_grid
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

if TYPE_CHECKING:
    from lmpress.export.gguf_layout import GgufLayout

FORMAT = "gguf"
FILE_NAME = "model.gguf"
# transformers model_type -> GGUF architecture (gguf-py's MODEL_ARCH_NAMES)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
PERMUTED_ROPE = ("llama",)  # GGUF architectures whose q/k rows llama.cpp's converter permutes
# GGUF architecture -> the linears whose biases it holds (as ``<name>.bias``, F32)
BIASES = {"qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Phi-3's fused linears: llama.cpp's phi3 holds qkv_proj as attn_qkv and gate_up_proj (gate rows first) as ffn_up
FUSED_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ARCH_LAYER_NAMES = {"phi3": {k: v for k, v in LAYER_NAMES.items() if k not in SPLIT} | FUSED_NAMES}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


# What GGUF can hold ------------------------------------------------------------------------------


def gguf_scheme_refusal(scheme: QuantScheme, act_order: bool) -> str | None:
    """Why a layer quantized with ``scheme`` has no exact GGML block type, or None (Q4_K / Q4_0 / Q8_0)."""
    what = (
        "W4 sym, groups of a multiple of 32 -> Q4_0, or Q4_K with k_quant_scales: true; W8 sym likewise -> Q8_0; "
        "fp4: mxfp4 -> MXFP4; or export gptq / compressed-tensors"
    )
    if scheme.fp4 == "mxfp4":
        return None
    if scheme.fp4 is not None:
        return (
            f"{scheme.fp4.upper()}: gguf's NVFP4 blocks (64 columns, unsigned E4M3 scales) have no per-tensor "
            "global scale to hold it; use fp4: mxfp4 for GGUF (GGML type MXFP4), or export compressed-tensors "
            "(nvfp4-pack-quantized) or hf"
        )
    if scheme.bits not in (4, 8):
        return f"{scheme.bits}-bit weights have no exact GGUF block type (GGUF here holds {what})"
    if scheme.group_size != -1 and scheme.group_size % BLOCK:
        return (
            f"group_size {scheme.group_size} does not land on GGUF's 32-column blocks: "
            f"use group_size: 32 or a multiple of it ({what})"
        )
    if not scheme.symmetric:
        return f"asymmetric zero points do not fit Q4_0 / Q4_K / Q8_0 exactly: use symmetric: true ({what})"
    if act_order:
        return (
            "act-order g_idx permutes columns across GGUF's 32-column blocks: "
            "set static_groups: true (or act_order: false), or export gptq"
        )
    return None


def gguf_architecture(config: Any) -> str:
    """The GGUF architecture of a transformers config, or a one-line refusal naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise LmpressInputError(
            f"export gguf: architecture {model_type!r} is not written by lmpress's GGUF writer "
            f"(it writes {', '.join(sorted(ARCHITECTURES))}); export hf and convert with llama.cpp's converter"
        )
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise LmpressInputError(f"export gguf: {model_type} with attention/MLP biases is not written by lmpress")
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < getattr(config, "max_position_embeddings", 0):
        raise LmpressInputError(f"export gguf: mistral with a sliding window ({window}) is not written by lmpress")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise LmpressInputError(f"export gguf: {model_type} with sliding-window layers is not written by lmpress")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise LmpressInputError(
            f"export gguf: rope_type {rope.get('rope_type')!r} is not written by lmpress (only default RoPE)"
        )
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise LmpressInputError(f"export gguf: partial rotary embeddings ({partial}) are not written by lmpress")
    return ARCHITECTURES[model_type]


def check_gguf_plan(model: nn.Module, plan: dict[str, PlannedLayer]) -> None:
    gguf_architecture(model.config)
    for name, layer in plan.items():
        if layer.in_features % BLOCK:
            raise LmpressInputError(
                f"export gguf: {name} has in_features {layer.in_features}, "
                f"not a multiple of GGUF's {BLOCK}-column blocks"
            )


# Rows -------------------------------------------------------------------------------------------


def rope_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """Row order llama.cpp's converter gives q/k weights: per head, halves interleaved into pairs."""
    return torch.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).transpose(1, 2).reshape(rows)


# Writing ----------------------------------------------------------------------------------------


def layer_names(arch: str) -> dict[str, str]:
    """A decoder layer's modules (relative names) -> their GGUF names in architecture ``arch``."""
    return ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)


def gguf_tensor_name(name: str, arch: str = "llama", layers_prefix: str = "model.layers.") -> str | None:
    """The GGUF name of module ``name`` (no ``.weight`` suffix), or None when GGUF has no such tensor."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if name.startswith(layers_prefix):
        index, _, rest = name.removeprefix(layers_prefix).partition(".")
        names = layer_names(arch)
        if rest in names:
            return f"blk.{index}.{names[rest]}"
    return None


def _rope_heads(name: str, config: Any) -> int | None:
    if ARCHITECTURES.get(config.model_type) not in PERMUTED_ROPE:
        return None
    if name.endswith("self_attn.q_proj"):
        return config.num_attention_heads
    if name.endswith("self_attn.k_proj"):
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


def widest_groups(scales: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-block scales ``(N, K / 32)`` as the widest groups whose blocks all share one scale, and that group
    size (-1: one per row): a layer written with groups of 64 reads back as it was quantized."""
    rows, blocks = scales.shape
    for runs in range(blocks, 1, -1):
        if blocks % runs == 0 and bool((scales.view(rows, -1, runs) == scales.view(rows, -1, runs)[..., :1]).all()):
            return scales[:, ::runs].contiguous(), -1 if runs == blocks else BLOCK * runs
    return scales, BLOCK


def quantized_blocks(name: str, module: QuantizedLinear | Fp4Linear) -> tuple[np.ndarray, str]:
    """One quantized layer as GGML blocks (rows in GGUF order) and the block type's name.

    W4 layers whose scales are on the k-quant grid are written as Q4_K, other W4 layers as Q4_0;
    a layer quantized with ``k_quant_scales`` whose scales have left the grid is refused. MXFP4 layers are
    written as MXFP4.
    """
    if isinstance(module, Fp4Linear):
        reason = gguf_scheme_refusal(module.scheme, False)
        if reason or module.scheme.activations is not None:
            raise LmpressInputError(
                f"export gguf: {name} ({module.scheme.describe()}): "
                f"{reason or 'FP4 activations, which GGUF cannot describe; export compressed-tensors'}"
            )
        return pack_mxfp4(module.unpack().codes.cpu(), module.weight_scale.cpu()), "MXFP4"
    reason = gguf_scheme_refusal(module.scheme, act_order_g_idx(module) is not None)
    if reason:
        raise LmpressInputError(f"export gguf: {name} ({module.scheme.describe()}): {reason}")
    codes, zeros = module.codes(), module.zeros
    expected_zero = 8 if module.scheme.bits == 4 else 128
    if not bool((zeros == expected_zero).all()):
        raise LmpressInputError(f"export gguf: {name} has zero points other than {expected_zero}; it is not symmetric")
    repeats = module.scheme.group_width(module.in_features) // BLOCK  # each group's scale on each of its blocks
    scales = fp16_scales(module.scales.float(), name, FORMAT).repeat_interleave(repeats, dim=1)
    if module.scheme.bits == 8:
        return pack_q8_0(codes, scales), "Q8_0"
    grid = kquant_grid(scales) if module.in_features % SUPER_BLOCK == 0 else None
    if grid is not None:
        d, sc = grid
        return pack_q4_k(codes, d, d * 8, sc, sc), "Q4_K"
    if module.scheme.k_quant_scales:
        raise LmpressInputError(
            f"export gguf: {name} was quantized with k_quant_scales but its float16 scales are not "
            "d * (integer 0..63) per 256 columns (changed after quantizing?); quantize with k_quant_scales: true "
            "(rtn, gptq, awq) and leave the scales as they come out, or set k_quant_scales: false for Q4_0"
        )
    return pack_q4_0(codes, scales), "Q4_0"


def float_array(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, str]:
    """A float tensor as numpy in ``dtype`` (F32, F16, or BF16 as its raw uint16 bits)."""
    t = tensor.detach().cpu().to(dtype).contiguous()
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    return t.numpy(), "F32" if dtype == torch.float32 else "F16"


def model_tensors(model: nn.Module, float_dtype: torch.dtype) -> list[tuple[str, np.ndarray, str]]:
    """Every tensor of the GGUF file: (GGUF name, data, GGML type name), rows in GGUF order."""
    config = model.config
    arch = gguf_architecture(config)
    biased = BIASES.get(arch, ())
    tensors: list[tuple[str, np.ndarray, str]] = []
    quantized = quantized_layers(model) | fp4_layers(model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, module in model.named_modules():
        target = gguf_tensor_name(name, arch)
        if isinstance(module, (QuantizedLinear, Fp4Linear)):
            if target is None:
                raise LmpressInputError(f"export gguf: quantized layer {name} has no place in a GGUF {arch} model")
            data, kind = quantized_blocks(name, module)
        elif isinstance(module, (nn.Linear, nn.Embedding)) or name.endswith("norm"):
            if target is None:
                continue
            if name == "lm_head" and tied and "lm_head" not in quantized:
                continue  # llama.cpp reads token_embd as the output head when output.weight is absent
            weight = module.weight
            if weight.dim() == 1:
                data, kind = float_array(weight, torch.float32)  # norms stay F32, as llama.cpp's converter writes
            else:
                data, kind = float_array(weight, float_dtype)
        else:
            continue
        heads = _rope_heads(name, config)
        if heads is not None:
            data = data[rope_row_order(data.shape[0], heads).numpy()]
        tensors.append((f"{target}.weight", np.ascontiguousarray(data), kind))
        if getattr(module, "bias", None) is not None:
            if not name.endswith(biased):
                raise LmpressInputError(f"export gguf: {name} has a bias, which GGUF's {arch} does not hold")
            tensors.append((f"{target}.bias", *float_array(module.bias, torch.float32)))
    return tensors


def file_type(kinds: list[str]) -> int:
    """general.file_type: the type most of the 2-D weights are stored in (llama.cpp's LLAMA_FTYPE)."""
    from gguf import LlamaFileType

    by_kind = {
        "F32": LlamaFileType.ALL_F32,
        "F16": LlamaFileType.MOSTLY_F16,
        "BF16": LlamaFileType.MOSTLY_BF16,
        "Q4_0": LlamaFileType.MOSTLY_Q4_0,
        "Q8_0": LlamaFileType.MOSTLY_Q8_0,
        "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,  # llama.cpp's one MXFP4 label (its converter's for gpt-oss)
        # the label closest to all-Q4_K layers (llama.cpp's Q4_K_M raises attn_v and ffn_down to Q6_K)
        "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    }
    main = max(set(kinds), key=lambda k: (kinds.count(k), k.startswith("Q")))
    return int(by_kind[main])


def write_gguf(model: nn.Module, tokenizer: Any, path: Path, float_dtype: torch.dtype | None = None) -> None:
    """Write ``model`` (quantized layers as Q4_K / Q4_0 / Q8_0) and its tokenizer as one GGUF file at ``path``.

    ``float_dtype`` is the type of the unquantized 2-D weights (float32, float16 or bfloat16);
    by default the model's own.
    """
    import gguf

    architecture = gguf_architecture(model.config)
    if float_dtype is None:
        float_dtype = model.get_input_embeddings().weight.dtype
    if float_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise LmpressInputError(f"export gguf: float type {float_dtype} is not one GGUF holds (F32, F16, BF16)")
    tensors = model_tensors(model, float_dtype)
    writer = gguf.GGUFWriter(str(path), architecture)
    add_metadata(writer, model, tokenizer, file_type([kind for _, data, kind in tensors if data.ndim == 2]))
    for name, data, kind in tensors:
        raw = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw if kind not in ("F32", "F16") else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """``OUT/gguf/model.gguf`` plus the transformers tokenizer files (for ``lmpress eval OUT/gguf``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_gguf(model, tokenizer, out_dir / FILE_NAME)
    tokenizer.save_pretrained(out_dir)


# Reading back ------------------------------------------------------------------------------------


CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "phi3": "Phi3Config"}


def gguf_config_values(reader: GgufLayout) -> dict[str, Any]:
    """The model config (``model_type`` and the transformers config's arguments) that the metadata of a GGUF file of
    a Llama, Qwen2, Qwen3 or Phi-3 architecture gives."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in CONFIG_CLASSES:
        raise LmpressInputError(
            f"GGUF architecture {arch!r}: lmpress reads back {', '.join(CONFIG_CLASSES)} GGUF files only"
        )
    names = {t.name for t in reader.tensors}
    heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    return dict(
        model_type=arch,
        vocab_size=len(gguf_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in names,
    )


def gguf_config(values: dict[str, Any]) -> Any:
    """The transformers config of ``gguf_config_values``."""
    import transformers

    values = dict(values)
    return getattr(transformers, CONFIG_CLASSES[values.pop("model_type")])(**values)


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight | Fp4Weight]]:
    """(``gguf_config_values``, {HF module name: QuantizedWeight or Fp4Weight, or HF tensor name: float tensor}) of
    a GGUF file lmpress wrote."""
    reader = check_gguf(path)
    values = gguf_config_values(reader)
    config = SimpleNamespace(**values)
    per_layer = {
        f"blk.{i}.{v}.{kind}": (f"model.layers.{i}.{k}", kind)
        for i in range(config.num_hidden_layers)
        for k, v in layer_names(gguf_field(reader, "general.architecture")).items()
        for kind in ("weight", "bias")
    }
    hf_names = {f"{v}.weight": (k, "weight") for k, v in TOP_NAMES.items()} | per_layer
    out: dict[str, torch.Tensor | QuantizedWeight | Fp4Weight] = {}
    for tensor in reader.tensors:
        module, kind_of = hf_names.get(tensor.name, (None, None))
        if module is None:
            raise LmpressInputError(f"{path}: tensor {tensor.name!r} is not one of a {config.model_type} model")
        cols = int(tensor.shape[0])
        kind = tensor.tensor_type.name
        data = np.asarray(tensor.data)
        if kind in ("Q4_0", "Q8_0"):
            codes, scales = (unpack_q4_0 if kind == "Q4_0" else unpack_q8_0)(data, cols)
            scales, group = widest_groups(scales)
            scheme = QuantScheme(4 if kind == "Q4_0" else 8, group, True)
            value: torch.Tensor | QuantizedWeight | Fp4Weight = QuantizedWeight(
                qweight=codes,
                scales=scales,
                zeros=torch.full(scales.shape, float(8 if kind == "Q4_0" else 128)),
                scheme=scheme,
            )
        elif kind == "Q4_K":
            value = q4_k_weight(data, cols, f"{path}: {tensor.name}")
        elif kind == "MXFP4":
            value = mxfp4_weight(data, cols, f"{path}: {tensor.name}")
        elif kind in ("F32", "F16", "BF16"):
            array = data.view(np.int16) if kind == "BF16" else data
            value = torch.from_numpy(array.copy())
            value = value.view(torch.bfloat16) if kind == "BF16" else value
            value = value.reshape([int(s) for s in reversed(tensor.shape)])
        else:
            raise LmpressInputError(
                f"{path}: {tensor.name} is {kind}; lmpress reads back F32/F16/BF16/Q4_0/Q4_K/Q8_0/MXFP4"
            )
        heads = _rope_heads(module, config)
        if heads is not None:
            inverse = torch.argsort(rope_row_order(int(tensor.shape[1]), heads))
            value = _take_rows(value, inverse)
        out[module if isinstance(value, (QuantizedWeight, Fp4Weight)) else f"{module}.{kind_of}"] = value
    return values, out


def q4_k_weight(data: np.ndarray, cols: int, where: str) -> QuantizedWeight:
    """A Q4_K tensor as lmpress's W4 symmetric weight (groups of 32, or wider where they repeat): scale
    ``d * sc_j``, zero point 8.

    Only Q4_K whose mins are 8 times its scales (``dmin * m_j == 8 * d * sc_j``, what lmpress writes)
    is a symmetric grid; other Q4_K files (llama.cpp's own quantizer) are refused.
    """
    codes, d, dmin, sc, m = unpack_q4_k(data, cols)
    scales = d.float()[..., None] * sc.float()  # exact: 11 x 6 significant bits
    if not torch.equal(dmin.float()[..., None] * m.float(), 8 * scales):
        raise LmpressInputError(
            f"{where} is Q4_K with minimums that are not 8 x its scales: not a symmetric grid lmpress holds "
            "(lmpress reads back the Q4_K it writes)"
        )
    scales, group = widest_groups(scales.reshape(scales.shape[0], -1))
    half = scales.to(torch.float16)
    return QuantizedWeight(
        qweight=codes,
        scales=half if torch.equal(half.float(), scales) else scales,
        zeros=torch.full(scales.shape, 8.0),
        scheme=QuantScheme(4, group, True, k_quant_scales=group == BLOCK),
    )


def mxfp4_weight(data: np.ndarray, cols: int, where: str) -> Fp4Weight:
    """An MXFP4 tensor as lmpress's MXFP4 weight (E2M1 codes, power-of-two block scales); an exponent byte of 255
    (E8M0's NaN, which ggml reads as 2**127) is refused."""
    codes, exponents = unpack_mxfp4(data, cols)
    if bool((exponents == 255).any()):
        raise LmpressInputError(f"{where} is MXFP4 with an E8M0 exponent byte 255 (NaN); lmpress holds 0..254")
    codes[codes == 8] = 0  # -0: the same value, the code compressed-tensors writes for it
    return Fp4Weight(codes, decode_e8m0(exponents), QuantScheme(4, BLOCK, True, fp4="mxfp4"))


def _take_rows(
    value: torch.Tensor | QuantizedWeight | Fp4Weight, rows: torch.Tensor
) -> torch.Tensor | QuantizedWeight | Fp4Weight:
    if isinstance(value, Fp4Weight):
        return Fp4Weight(value.codes[rows], value.scales[rows], value.scheme)
    if isinstance(value, QuantizedWeight):
        return QuantizedWeight(value.qweight[rows], value.scales[rows], value.zeros[rows], value.scheme)
    return value[rows]


def read_gguf(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The GGUF export in directory ``path`` as a transformers model; Q4_K / Q4_0 / Q8_0 layers as QuantizedLinear,
    MXFP4 layers as Fp4Linear.

    Float tensors take ``dtype``; quantized layers keep their float16 scales.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from lmpress.weights.apply import apply_quantized_weight

    values, tensors = read_gguf_tensors(Path(path) / FILE_NAME)
    config = gguf_config(values)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if config.tie_word_embeddings:
        model.tie_weights()
    dense = {}
    for name, value in tensors.items():
        if isinstance(value, (QuantizedWeight, Fp4Weight)):
            apply_quantized_weight(model, name, value)
        else:
            dense[name] = value.to(dtype)
    expected = {k for k in model.state_dict() if k.endswith(".weight") and k in dict(model.named_parameters())}
    missing = sorted(expected - set(dense) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise LmpressInputError(f"{path}: the GGUF file lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    model.load_state_dict(dense, strict=False)
    return model.eval()


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_gguf,
        refuse_scheme=gguf_scheme_refusal,
        check_plan=check_gguf_plan,
        artifact_file=FILE_NAME,
        load_artifact=read_gguf,
        read_tensors=lambda directory: read_gguf_tensors(Path(directory) / FILE_NAME),
    )
)
