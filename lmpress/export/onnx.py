"""ONNX decoders for ONNX Runtime: ``OUT/onnx/model.onnx`` (+ ``model.onnx.data``), quantized linears as MatMulNBits.

One graph serves prefill and decode (the layout ONNX Runtime GenAI and Optimum use):

- inputs ``input_ids`` int64 ``(batch, seq)``, ``attention_mask`` int64 ``(batch, past + seq)``
  (1 = attend), ``position_ids`` int64 ``(batch, seq)``, and per layer ``past_key_values.{i}.key``
  / ``.value`` float32 ``(batch, kv_heads, past, head_dim)`` (``past`` may be 0);
- outputs ``logits`` float32 ``(batch, seq, vocab)`` and ``present.{i}.key`` / ``.value``
  ``(batch, kv_heads, past + seq, head_dim)``.

Llama-family decoders (llama, mistral without a sliding window, qwen2 with its q/k/v biases)
are built op by op from standard ONNX operators (RMSNorm, rotary embeddings, grouped-query
attention with a causal + padding mask, SwiGLU) computed in float32. A quantized linear
(4 or 8 bits, groups of 32, 64 or 128) becomes ``com.microsoft.MatMulNBits`` holding
lmpress's codes, float32 scales and, where a layer is asymmetric, its packed zero points; an
act-order layer (``g_idx``) has its codes stored with columns sorted by group and a Gather
that reorders its input the same way, so the product is unchanged. Other linears are MatMul
with the transposed float weight.

``read_onnx`` reads the initializers back into a transformers model (quantized layers as
QuantizedLinear, for the read-back check) whose forward runs the ONNX graph in ONNX Runtime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.export.formats import (
    PlannedLayer,
    act_order_g_idx,
    quantized_layers,
    refuse_fp4_layers,
)
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

FORMAT = "onnx"
FILE_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
OPSET = 17
MS_DOMAIN = "com.microsoft"
BLOCK_SIZES = (32, 64, 128)
BITS = (4, 8)
FAMILIES = ("llama", "mistral", "qwen2")
CONFIG_KEY = "lmpress.config"  # metadata_props: the transformers config, for reading back
INSTALL_HINT = "pip install 'lmpress[onnx]' (onnx, onnxruntime)"


def onnx_scheme_refusal(scheme: QuantScheme, act_order: bool) -> str | None:
    """Why MatMulNBits cannot hold a layer quantized with ``scheme``, or None."""
    if scheme.bits not in BITS:
        return f"{scheme.bits}-bit weights: ONNX export holds 4- or 8-bit MatMulNBits; use bits: 4 or 8"
    if scheme.group_size not in BLOCK_SIZES:
        group = "per-channel scales" if scheme.group_size == -1 else f"group_size {scheme.group_size}"
        return f"{group}: MatMulNBits blocks are 32, 64 or 128 columns; use group_size: 32, 64 or 128"
    return None


def check_family(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise LmpressInputError(
            f"export onnx: architecture {model_type!r} is not written by lmpress's ONNX exporter "
            f"(it writes {', '.join(FAMILIES)})"
        )
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", model_type == "mistral") and window is not None:
        if window < config.max_position_embeddings:
            raise LmpressInputError(f"export onnx: a sliding window ({window}) is not written by lmpress")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise LmpressInputError(f"export onnx: rope_type {rope.get('rope_type')!r} is not written (default only)")
    if getattr(config, "mlp_bias", False) or (model_type != "qwen2" and getattr(config, "attention_bias", False)):
        raise LmpressInputError(f"export onnx: {model_type} with extra biases is not written by lmpress")


def check_onnx_plan(model: nn.Module, plan: dict[str, PlannedLayer]) -> None:
    check_family(model.config)


# MatMulNBits packing ---------------------------------------------------------------------------


def pack_matmul_nbits(codes: torch.Tensor, bits: int, block_size: int) -> np.ndarray:
    """MatMulNBits ``B``: uint8 ``(N, K / block, block * bits / 8)``; two 4-bit codes a byte, the first low."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n, k // block_size, block_size).numpy()
    if bits == 8:
        return np.ascontiguousarray(q)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << np.uint8(4)))


def unpack_matmul_nbits(blob: np.ndarray, bits: int, k: int) -> torch.Tensor:
    n = blob.shape[0]
    if bits == 8:
        return torch.from_numpy(blob.reshape(n, k).copy())
    q = np.stack([blob & np.uint8(0x0F), blob >> np.uint8(4)], axis=-1)
    return torch.from_numpy(q.reshape(n, k).copy())


def pack_zero_points(zeros: torch.Tensor, bits: int) -> np.ndarray:
    """MatMulNBits ``zero_points``: uint8 ``(N, ceil(blocks * bits / 8))``, two 4-bit zeros a byte, the first low."""
    z = zeros.round().to(torch.uint8).numpy()
    if bits == 8:
        return np.ascontiguousarray(z)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << np.uint8(4)))


def unpack_zero_points(packed: np.ndarray, bits: int, blocks: int) -> torch.Tensor:
    if bits == 8:
        return torch.from_numpy(packed.reshape(-1, blocks).astype(np.float32))
    z = np.stack([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1).reshape(packed.shape[0], -1)
    return torch.from_numpy(z[:, :blocks].astype(np.float32))


# Graph building --------------------------------------------------------------------------------


class Graph:
    """Nodes and initializers of one ONNX graph, named as they are added."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.counter = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        from onnx import helper

        self.counter += 1
        outputs = [f"/{op_type}_{self.counter}/{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain or None, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, values: list[int]) -> str:
        self.counter += 1
        return self.const(f"/const_{self.counter}", np.array(values, dtype=np.int64))

    def scalar(self, value: float) -> str:
        self.counter += 1
        return self.const(f"/const_{self.counter}", np.array(value, dtype=np.float32))


def _f32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().float().numpy()


def linear(g: Graph, x: str, name: str, module: nn.Module) -> str:
    """``module`` applied to ``x``: MatMulNBits for a QuantizedLinear, MatMul otherwise (+ bias)."""
    if isinstance(module, QuantizedLinear):
        reason = onnx_scheme_refusal(module.scheme, False)
        if reason:
            raise LmpressInputError(f"export onnx: {name} ({module.scheme.describe()}): {reason}")
        bits, block = module.scheme.bits, module.scheme.group_size
        codes, zeros, scales = module.codes(), module.zeros.float(), module.scales.float()
        g_idx = act_order_g_idx(module)
        if g_idx is not None:
            perm = torch.argsort(g_idx.long(), stable=True)
            if not bool((torch.bincount(g_idx.long(), minlength=scales.shape[1]) == block).all()):
                raise LmpressInputError(f"export onnx: {name}: act-order groups of unequal size cannot be sorted")
            codes = codes[:, perm]
            x = g.op("Gather", [x, g.const(f"{name}.input_order", perm.numpy().astype(np.int64))], axis=-1)
        inputs = [
            x,
            g.const(f"{name}.MatMulNBits.B", pack_matmul_nbits(codes, bits, block)),
            g.const(f"{name}.MatMulNBits.scales", _f32(scales)),
        ]
        if bool((zeros != 2 ** (bits - 1)).any()):
            inputs.append(g.const(f"{name}.MatMulNBits.zero_points", pack_zero_points(zeros, bits)))
        y = g.op(
            "MatMulNBits",
            inputs,
            domain=MS_DOMAIN,
            K=module.in_features,
            N=module.out_features,
            bits=bits,
            block_size=block,
        )
    else:
        y = g.op("MatMul", [x, g.const(f"{name}.weight.T", _f32(module.weight).T)])
    if module.bias is not None:
        y = g.op("Add", [y, g.const(f"{name}.bias", _f32(module.bias))])
    return y


def rms_norm(g: Graph, x: str, name: str, module: nn.Module, eps: float) -> str:
    variance = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [variance, g.scalar(eps)])])])
    return g.op("Mul", [g.op("Mul", [x, inv]), g.const(f"{name}.weight", _f32(module.weight))])


def rotate(g: Graph, x: str, cos: str, sin: str, half: int) -> str:
    """``x * cos + rotate_half(x) * sin`` on ``(batch, heads, seq, head_dim)``."""
    x1, x2 = g.op("Split", [x, g.ints([half, half])], n_out=2, axis=-1)
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def attention(g: Graph, x: str, prefix: str, layer: nn.Module, config: Any, ctx: dict[str, str], i: int) -> str:
    heads, kv_heads, head_dim = ctx["heads"], ctx["kv_heads"], ctx["head_dim"]
    attn = layer.self_attn

    def project(proj: str, n: int) -> str:
        y = linear(g, x, f"{prefix}.self_attn.{proj}", getattr(attn, proj))
        y = g.op("Reshape", [y, g.ints([0, 0, n, head_dim])])
        return g.op("Transpose", [y], perm=[0, 2, 1, 3])

    q = rotate(g, project("q_proj", heads), ctx["cos"], ctx["sin"], head_dim // 2)
    k = rotate(g, project("k_proj", kv_heads), ctx["cos"], ctx["sin"], head_dim // 2)
    v = project("v_proj", kv_heads)
    k_all = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2)
    v_all = g.op("Concat", [f"past_key_values.{i}.value", v], axis=2)
    g.nodes.append(_identity(k_all, f"present.{i}.key"))
    g.nodes.append(_identity(v_all, f"present.{i}.value"))
    if heads != kv_heads:  # grouped-query attention: each kv head serves heads // kv_heads query heads
        expand = g.ints([1, 1, heads // kv_heads, 1, 1])
        k_all, v_all = (
            g.op(
                "Reshape",
                [g.op("Expand", [g.op("Unsqueeze", [t, g.ints([2])]), expand]), g.ints([0, heads, -1, head_dim])],
            )
            for t in (k_all, v_all)
        )
    scores = g.op("MatMul", [q, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
    scores = g.op("Add", [g.op("Mul", [scores, g.scalar(1.0 / math.sqrt(head_dim))]), ctx["mask"]])
    out = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v_all])
    out = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.ints([0, 0, heads * head_dim])])
    return linear(g, out, f"{prefix}.self_attn.o_proj", attn.o_proj)


def _identity(source: str, target: str) -> Any:
    from onnx import helper

    return helper.make_node("Identity", [source], [target])


def rope_and_mask(g: Graph, config: Any, head_dim: int) -> dict[str, str]:
    """cos/sin ``(batch, 1, seq, head_dim)`` from position_ids, and the additive mask ``(batch, 1, seq, total)``."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = g.op("Unsqueeze", [g.op("Cast", ["position_ids"], to=1), g.ints([-1])])
    freqs = g.op("Mul", [positions, g.const("rotary.inv_freq", inv_freq.numpy())])
    emb = g.op("Concat", [freqs, freqs], axis=-1)
    cos = g.op("Unsqueeze", [g.op("Cos", [emb]), g.ints([1])])
    sin = g.op("Unsqueeze", [g.op("Sin", [emb]), g.ints([1])])

    seq = g.op("Gather", [g.op("Shape", ["input_ids"]), g.ints([1])], axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), g.ints([1])], axis=0)
    past = g.op("Sub", [total, seq])
    zero, one = g.const("/zero", np.array(0, np.int64)), g.const("/one", np.array(1, np.int64))
    keys = g.op("Range", [zero, _scalar_of(g, total), one])
    queries = g.op("Range", [_scalar_of(g, past), _scalar_of(g, total), one])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [keys, g.ints([0])]), g.op("Unsqueeze", [queries, g.ints([1])])])
    padding = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=9), g.ints([1, 2])])
    allowed = g.op("And", [g.op("Unsqueeze", [causal, g.ints([0, 1])]), padding])
    lowest = float(np.finfo(np.float32).min)
    mask = g.op("Where", [allowed, g.scalar(0.0), g.scalar(lowest)])
    return {"cos": cos, "sin": sin, "mask": mask}


def _scalar_of(g: Graph, one_element: str) -> str:
    return g.op("Squeeze", [one_element, g.ints([0])])


def build_decoder(model: nn.Module) -> Any:
    """The ONNX ModelProto of ``model``'s decoder with KV-cache inputs and outputs."""
    from onnx import TensorProto, helper

    config = model.config
    check_family(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps = float(config.rms_norm_eps)
    g = Graph()
    ctx: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    ctx.update(rope_and_mask(g, config, head_dim))
    embed = model.get_input_embeddings()
    embed_name = g.const("model.embed_tokens.weight", _f32(embed.weight))
    x = g.op("Gather", [embed_name, "input_ids"], axis=0)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        h = rms_norm(g, x, f"{prefix}.input_layernorm", layer.input_layernorm, eps)
        x = g.op("Add", [x, attention(g, h, prefix, layer, config, ctx, i)])
        h = rms_norm(g, x, f"{prefix}.post_attention_layernorm", layer.post_attention_layernorm, eps)
        mlp = layer.mlp
        gate = linear(g, h, f"{prefix}.mlp.gate_proj", mlp.gate_proj)
        up = linear(g, h, f"{prefix}.mlp.up_proj", mlp.up_proj)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        x = g.op("Add", [x, linear(g, act, f"{prefix}.mlp.down_proj", mlp.down_proj)])
    x = rms_norm(g, x, "model.norm", model.model.norm, eps)
    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear) or head.weight.data_ptr() != embed.weight.data_ptr():
        logits = linear(g, x, "lm_head", head)
    else:  # tied: the embedding matrix serves as the head, stored once
        logits = g.op("MatMul", [x, g.op("Transpose", [embed_name], perm=[1, 0])])
    g.nodes.append(_identity(logits, "logits"))

    float_t, int_t = TensorProto.FLOAT, TensorProto.INT64
    cache_shape = ["batch", kv_heads, "past", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", int_t, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", int_t, ["batch", "total"]),
        helper.make_tensor_value_info("position_ids", int_t, ["batch", "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", float_t, ["batch", "seq", config.vocab_size])]
    for i in range(config.num_hidden_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", float_t, cache_shape))
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", float_t, ["batch", kv_heads, "total", head_dim])
            )
    graph = helper.make_graph(g.nodes, "lmpress_decoder", inputs, outputs, initializer=g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="lmpress")
    proto.ir_version = 8
    helper.set_model_props(proto, {CONFIG_KEY: config.to_json_string(use_diff=False)})
    return proto


# Writing ----------------------------------------------------------------------------------------


def write_onnx(model: nn.Module, path: Path) -> None:
    """Write ``model``'s decoder to ``path`` with its weights in ``model.onnx.data`` beside it."""
    try:
        import onnx
    except ImportError as e:
        raise LmpressInputError(f"export onnx needs the onnx package: {INSTALL_HINT}") from e
    proto = build_decoder(model)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_NAME)


def export_onnx(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """``OUT/onnx/model.onnx`` + ``model.onnx.data`` and the transformers tokenizer files."""
    refuse_fp4_layers(model, FORMAT)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_onnx(model, out_dir / FILE_NAME)
    tokenizer.save_pretrained(out_dir)


# Running in ONNX Runtime -----------------------------------------------------------------------


ONNX_DEVICES = ("cpu", "cuda", "auto")


def onnx_providers(device: str, available: list[str]) -> list[str]:
    """ONNX Runtime's execution providers for ``device``: cpu, cuda (CUDA first, CPU for any op it lacks)
    or auto (cuda where ``available`` has it, else cpu)."""
    if device not in ONNX_DEVICES:
        raise LmpressInputError(f"ONNX device must be one of {', '.join(ONNX_DEVICES)}, got {device!r}")
    has_cuda = "CUDAExecutionProvider" in available
    if device == "cuda" and not has_cuda:
        raise LmpressInputError(
            f"ONNX device cuda: this onnxruntime has no CUDA provider (it has {', '.join(available)}); on a CUDA "
            "machine install onnxruntime-gpu in place of onnxruntime, or use device cpu"
        )
    if device == "cuda" or (device == "auto" and has_cuda):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def onnx_session(path: Path, threads: int | None = None, device: str = "cpu") -> Any:
    """An ONNX Runtime session on ``path`` (``threads``: intra-op threads, default ORT's; ``device``: as
    ``onnx_providers`` takes it). Asked for cuda, a session that ONNX Runtime could not give its CUDA
    provider (no GPU, a CUDA library missing) is an error rather than a silent run on the CPU; auto falls back."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise LmpressInputError(f"running an ONNX export needs onnxruntime: {INSTALL_HINT}") from e
    providers = onnx_providers(device, ort.get_available_providers())
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=providers)
    if device == "cuda" and providers[0] not in session.get_providers():
        running = ", ".join(session.get_providers())
        raise LmpressInputError(
            f"ONNX Runtime could not start its {providers[0]} for {path} (running: {running}); check the CUDA "
            "and cuDNN libraries onnxruntime-gpu needs, or use device cpu"
        )
    return session


def cache_layout(session: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from the session's past_key_values inputs."""
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    return len(past) // 2, int(past[0].shape[1]), int(past[0].shape[3])


def run_decoder(
    session: Any, input_ids: np.ndarray, past: list[np.ndarray] | None = None, attention_mask: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One call of the decoder: (logits, present caches [k0, v0, k1, ...]) after ``input_ids`` ``(batch, seq)``.

    ``past`` is the previous call's present caches (None: empty); ``attention_mask`` covers past + seq
    (default: all ones); positions continue from the past length.
    """
    layers, kv_heads, head_dim = cache_layout(session)
    batch, seq = input_ids.shape
    if past is None:
        past = [np.zeros((batch, kv_heads, 0, head_dim), np.float32) for _ in range(2 * layers)]
    past_len = past[0].shape[2]
    if attention_mask is None:
        attention_mask = np.ones((batch, past_len + seq), np.int64)
    positions = np.cumsum(attention_mask, axis=1)[:, past_len:] - 1
    feeds = {
        "input_ids": input_ids.astype(np.int64),
        "attention_mask": attention_mask.astype(np.int64),
        "position_ids": np.maximum(positions, 0).astype(np.int64),
    }
    for i in range(layers):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    logits, *present = session.run(None, feeds)
    return logits, present


def greedy_generate(session: Any, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding with the KV cache: the new token ids (stops after ``eos_token_id``)."""
    logits, past = run_decoder(session, np.array([prompt], np.int64))
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits, past = run_decoder(session, np.array([[token]], np.int64), past)
    return tokens


# Reading back ------------------------------------------------------------------------------------


def _initializers(proto: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def _matmul_nbits_attrs(proto: Any) -> dict[str, dict[str, int]]:
    """B initializer name -> the attributes of the MatMulNBits node reading it."""
    from onnx import helper

    return {
        node.input[1]: {a.name: helper.get_attribute_value(a) for a in node.attribute}
        for node in proto.graph.node
        if node.op_type == "MatMulNBits"
    }


def quantized_weight_of(name: str, arrays: dict[str, np.ndarray], attrs: dict[str, int]) -> QuantizedWeight:
    """The QuantizedWeight a MatMulNBits layer holds (act-order columns put back in place)."""
    bits, block, k, n = attrs["bits"], attrs["block_size"], attrs["K"], attrs["N"]
    codes = unpack_matmul_nbits(arrays[f"{name}.MatMulNBits.B"], bits, k)
    blocks = k // block
    scales = torch.from_numpy(arrays[f"{name}.MatMulNBits.scales"].reshape(n, blocks).copy())
    packed = arrays.get(f"{name}.MatMulNBits.zero_points")
    if packed is None:
        zeros = torch.full((n, blocks), float(2 ** (bits - 1)))
    else:
        zeros = unpack_zero_points(packed, bits, blocks)
    g_idx = None
    order = arrays.get(f"{name}.input_order")
    if order is not None:
        perm = torch.from_numpy(order.copy()).long()
        unsorted = torch.empty_like(codes)
        unsorted[:, perm] = codes
        codes = unsorted
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // block).to(torch.int32)
    return QuantizedWeight(
        codes, scales, zeros, QuantScheme(bits, block, bool((zeros == 2 ** (bits - 1)).all())), g_idx
    )


def onnx_forward(model: nn.Module, session: Any) -> Any:
    """A forward for ``model`` that runs ``session``: logits (and, with use_cache, its caches) as transformers'."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: list[np.ndarray] | None = None,
        use_cache: bool = False,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        mask = None if attention_mask is None else attention_mask.cpu().numpy()
        logits, present = run_decoder(session, input_ids.cpu().numpy(), past_key_values, mask)
        return CausalLMOutputWithPast(logits=torch.from_numpy(logits), past_key_values=present if use_cache else None)

    return forward


def read_onnx_tensors(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight]]:
    """(the model config the ONNX export in directory ``path`` records, {module: QuantizedWeight of its
    MatMulNBits codes, or HF tensor name: float tensor}); the graph's own constants are left out."""
    return read_onnx_file(Path(path) / FILE_NAME)


def read_onnx_file(file: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight]]:
    """``read_onnx_tensors`` of the ONNX file ``file`` (its external data beside it)."""
    import onnx

    return read_onnx_proto(file, onnx.load(str(file)))


def read_onnx_proto(file: Path, proto: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight]]:
    """``read_onnx_file`` of ``proto``, the ONNX file ``file`` loaded with its external data."""
    props = {p.key: p.value for p in proto.metadata_props}
    if CONFIG_KEY not in props:
        raise LmpressInputError(f"{file}: no {CONFIG_KEY} metadata; lmpress reads back the ONNX files it wrote")
    arrays = _initializers(proto)
    nbits = _matmul_nbits_attrs(proto)
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    for key, array in arrays.items():
        if key.endswith(".MatMulNBits.B"):
            name = key.removesuffix(".MatMulNBits.B")
            tensors[name] = quantized_weight_of(name, arrays, nbits[key])
        elif key.endswith(".weight.T"):  # a float linear, stored transposed for MatMul
            tensors[key.removesuffix(".T")] = torch.from_numpy(array.T.copy())
        elif key == "model.embed_tokens.weight" or key.endswith(("norm.weight", ".bias")):
            tensors[key] = torch.from_numpy(array.copy())
    return json.loads(props[CONFIG_KEY]), tensors


def initializer_bytes(proto: Any) -> dict[str, int]:
    """The stored bytes of each initializer of the ONNX model ``proto`` (from their shapes and types)."""
    from onnx import helper

    return {
        t.name: math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in proto.graph.initializer
    }


def read_onnx(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The ONNX export in directory ``path``: its weights in a transformers model whose forward runs ONNX Runtime.

    Quantized layers are QuantizedLinear holding the MatMulNBits codes, scales and zero points
    (so the read-back check compares them with the candidate's); the logits come from the graph.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from lmpress.weights.apply import apply_quantized_weight

    file = Path(path) / FILE_NAME
    values, tensors = read_onnx_tensors(path)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            if isinstance(tensors.get(name), QuantizedWeight):
                apply_quantized_weight(model, name, tensors[name])
            elif f"{name}.weight" not in tensors and name != "lm_head":
                raise LmpressInputError(f"{file}: no weight for {name}")
    dense = {key: value.to(dtype) for key, value in tensors.items() if isinstance(value, torch.Tensor)}
    model.load_state_dict(dense, strict=False)
    if getattr(config, "tie_word_embeddings", False) and not quantized_layers(model).get("lm_head"):
        model.tie_weights()
    model.forward = onnx_forward(model, onnx_session(file, device="auto"))
    return model.eval()


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_onnx,
        refuse_scheme=onnx_scheme_refusal,
        check_plan=check_onnx_plan,
        artifact_file=FILE_NAME,
        load_artifact=read_onnx,
        read_tensors=read_onnx_tensors,
    )
)
