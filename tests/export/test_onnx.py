"""ONNX export: the decoder run by onnxruntime (CPU) against lmpress's candidate, read-back, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install 'lmpress[onnx]')")
pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (pip install 'lmpress[onnx]')")

from lmpress.errors import LmpressInputError  # noqa: E402
from lmpress.export.formats import check_recipe_exports, quantized_layers
from lmpress.export.onnx import (  # noqa: E402
    FILE_NAME,
    greedy_generate,
    onnx_providers,
    onnx_scheme_refusal,
    onnx_session,
    run_decoder,
    write_onnx,
)
from lmpress.export.verify import compare_weights  # noqa: E402
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig  # noqa: E402
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

TEXT = "def f(x):\n    return x + 1  # a comment, and then some more words for the window"


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def candidate_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def act_order(model, seed: int = 0) -> None:
    """Give every quantized layer a shuffled act-order g_idx (each group keeps group_size columns)."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in quantized_layers(model).items():
        qw = module.unpack()
        width = module.scheme.group_size
        perm = torch.randperm(module.in_features, generator=gen)
        g_idx = torch.empty(module.in_features, dtype=torch.int32)
        g_idx[perm] = (torch.arange(module.in_features) // width).to(torch.int32)
        apply_quantized_weight(model, name, QuantizedWeight(qw.qweight, qw.scales, qw.zeros, qw.scheme, g_idx))


SCHEMES = [
    ({"bits": 4, "group_size": 32, "symmetric": True}, False),
    ({"bits": 4, "group_size": 64, "symmetric": False}, False),
    ({"bits": 4, "group_size": 128, "symmetric": True}, True),
    ({"bits": 8, "group_size": 32, "symmetric": False}, False),
]


@pytest.mark.parametrize(("scheme", "shuffled"), SCHEMES, ids=["w4g32sym", "w4g64asym", "w4g128act", "w8g32asym"])
def test_onnxruntime_logits_match_lmpress(quantized_tiny, export, scheme, shuffled):
    model, tokenizer = quantized_tiny(**scheme)
    if shuffled:
        act_order(model)
    out = export("onnx", model, tokenizer)
    session = onnx_session(out / FILE_NAME)
    ids = tokenizer(TEXT, return_tensors="np").input_ids
    logits, present = run_decoder(session, ids)
    want = candidate_logits(model, ids)
    # Same float32 weights in both; only the order of float32 sums differs (measured < 1e-6).
    assert relative_rms(logits, want) < 1e-5
    assert len(present) == 2 * model.config.num_hidden_layers
    assert present[0].shape == (1, model.config.num_key_value_heads, ids.shape[1], model.config.head_dim)


def test_kv_cache_and_padding(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    session = onnx_session(export("onnx", model, tokenizer) / FILE_NAME)
    ids = tokenizer(TEXT, return_tensors="np").input_ids
    full, _ = run_decoder(session, ids)
    first, past = run_decoder(session, ids[:, :7])
    rest, _ = run_decoder(session, ids[:, 7:], past)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), full, rtol=0, atol=1e-5)
    # Left padding: the padded row's real positions score as the unpadded sequence does.
    short = ids[:, 5:]
    batch = np.stack([ids[0], np.concatenate([np.zeros(5, np.int64), short[0]])])
    mask = np.stack([np.ones(ids.shape[1], np.int64), np.concatenate([np.zeros(5, np.int64), np.ones(short.shape[1])])])
    padded, _ = run_decoder(session, batch, attention_mask=mask.astype(np.int64))
    alone, _ = run_decoder(session, short)
    np.testing.assert_allclose(padded[1, 5:], alone[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(padded[0], full[0], rtol=0, atol=1e-5)


def test_the_device_picks_onnxruntimes_provider():
    cpu_only, with_cuda = ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert onnx_providers("cpu", with_cuda) == ["CPUExecutionProvider"]
    assert onnx_providers("cuda", with_cuda) == with_cuda  # the CPU provider runs any op CUDA lacks
    assert onnx_providers("auto", with_cuda) == with_cuda
    assert onnx_providers("auto", cpu_only) == ["CPUExecutionProvider"]
    with pytest.raises(LmpressInputError, match="no CUDA provider .* install onnxruntime-gpu"):
        onnx_providers("cuda", cpu_only)
    with pytest.raises(LmpressInputError, match="ONNX device must be one of cpu, cuda, auto, got 'gpu'"):
        onnx_providers("gpu", with_cuda)


HAS_CUDA_PROVIDER = "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers()


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has a CUDA provider")
def test_asking_for_cuda_without_its_provider_is_one_clear_error(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=True)
    path = export("onnx", model, tokenizer) / FILE_NAME
    with pytest.raises(LmpressInputError, match="install onnxruntime-gpu in place of onnxruntime"):
        onnx_session(path, device="cuda")
    assert onnx_session(path, device="auto").get_providers() == ["CPUExecutionProvider"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_PROVIDER, reason="needs onnxruntime-gpu on a CUDA GPU")
@pytest.mark.parametrize(
    "scheme", [{"bits": 4, "group_size": 32, "symmetric": True}, {"bits": 4, "group_size": 64, "symmetric": False}]
)
def test_cuda_provider_logits_and_greedy_tokens_match_the_cpu(quantized_tiny, export, scheme):
    model, tokenizer = quantized_tiny(**scheme)
    path = export("onnx", model, tokenizer) / FILE_NAME
    cuda, cpu = onnx_session(path, device="cuda"), onnx_session(path, device="cpu")
    assert cuda.get_providers()[0] == "CUDAExecutionProvider"
    ids = tokenizer(TEXT, return_tensors="np").input_ids
    logits, _ = run_decoder(cuda, ids)
    assert relative_rms(logits, candidate_logits(model, ids)) < 1e-3  # CUDA's MatMulNBits sums in its own order
    prompt = ids[0].tolist()
    assert greedy_generate(cuda, prompt, 32) == greedy_generate(cpu, prompt, 32)


def test_onnx_reads_back_as_the_candidate(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=64, symmetric=False)
    act_order(model, seed=1)
    out = export("onnx", model, tokenizer)
    artifact = load_model(str(out), fingerprint=False)
    mismatch, change, how = compare_weights(model, artifact.model)
    assert mismatch is None, mismatch
    assert change == 0.0 and how == "quantized, scales as float32"
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        got = artifact.model(ids, use_cache=False).logits.numpy()
    assert relative_rms(got, candidate_logits(model, ids.numpy())) < 1e-5


def test_inspect_summarises_an_onnx_export_layer_by_layer(quantized_tiny, export):
    """``lmpress inspect`` on an ONNX export: every MatMulNBits layer's bits, block, zero points, act-order and
    bytes, as the checkpoint formats list theirs, and the size on disk with the external data file (it was the
    graph's 0.23 MB for SmolLM2's 180 MB export)."""
    from lmpress.export.inspect import inspect_artifact

    model, tokenizer = quantized_tiny(bits=4, group_size=64, symmetric=False)
    act_order(model, seed=1)
    out = export("onnx", model, tokenizer)
    info = inspect_artifact(out)
    layers = quantized_layers(model)
    assert info["format"] == "onnx" and info["quantized_layers"] == len(layers)
    assert (info["bits"], info["group_size"], info["sym"], info["act_order"]) == (4, 64, False, True)
    assert sorted(r["name"] for r in info["layers"]) == sorted(layers)
    files = sum(p.stat().st_size for p in out.glob("model.onnx*"))
    assert info["size_bytes"] == files > (out / "model.onnx").stat().st_size
    codes = {r["name"]: r["bytes"] for r in info["layers"]}
    name, layer = next(iter(layers.items()))
    assert codes[name] >= layer.out_features * layer.in_features // 2  # 4-bit codes, then scales and zero points


def test_dense_model_exports(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    write_onnx(model, tmp_path / FILE_NAME)
    session = onnx_session(tmp_path / FILE_NAME)
    ids = np.arange(3, 40, dtype=np.int64)[None]
    logits, _ = run_decoder(session, ids)
    assert relative_rms(logits, candidate_logits(model, ids)) < 1e-5


@pytest.mark.parametrize(
    ("scheme", "fragment"),
    [
        (QuantScheme(3, 32, True), "3-bit weights: ONNX export holds 4- or 8-bit MatMulNBits"),
        (QuantScheme(4, -1, True), "per-channel scales: MatMulNBits blocks are 32, 64 or 128 columns"),
    ],
)
def test_schemes_onnx_cannot_hold_are_refused(scheme, fragment):
    assert fragment in onnx_scheme_refusal(scheme, False)
    with pytest.raises(LmpressInputError, match="export.formats.0. onnx"):
        check_recipe_exports([GPTQConfig(method="gptq", bits=scheme.bits, group_size=scheme.group_size)], ["onnx"])


def test_unsupported_architecture_is_refused(tiny_opt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_opt_dir)
    with pytest.raises(LmpressInputError, match="architecture 'opt' is not written by lmpress's ONNX exporter"):
        write_onnx(model, tmp_path / FILE_NAME)


@pytest.mark.long
@pytest.mark.integration
def test_smollm2_onnx_greedy_generation_is_identical(smollm2_dir, tmp_path):
    from lmpress.quantize.rtn import RTNConfig, run_rtn
    from lmpress.registry import StageContext

    loaded = load_model(str(smollm2_dir), fingerprint=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "s", resume=False, fingerprint="x")
    run_rtn(model, RTNConfig(bits=4, group_size=64, symmetric=False), ctx)
    write_onnx(model, tmp_path / FILE_NAME)
    session = onnx_session(tmp_path / FILE_NAME)
    prompt = tokenizer("The history of the Roman Empire").input_ids
    logits, _ = run_decoder(session, np.array([prompt]))
    assert relative_rms(logits, candidate_logits(model, np.array([prompt]))) < 1e-5
    ours = greedy_generate(session, prompt, 64)
    for name, module in quantized_layers(model).items():  # the same weights as dense layers: generate runs faster
        dense = torch.nn.Linear(module.in_features, module.out_features, bias=False)
        dense.weight.data = module.dequantized_weight()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, dense)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours == theirs[0, len(prompt) :].tolist()


def test_run_exports_gguf_and_onnx_and_checks_them(tiny_llama_dir, tmp_path, monkeypatch):
    import json

    import yaml

    from lmpress.cli import main

    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    recipe = {
        "model": {"source": str(tiny_llama_dir)},
        "data": {"samples": 2, "seq_len": 32},
        "stages": [{"method": "rtn", "bits": 4, "group_size": 32}],
        "export": {"formats": ["onnx", "gguf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 100"],
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    checks = {c["format"]: c for c in report["export_checks"]}
    assert checks["onnx"]["passed"] and checks["onnx"]["weights"].endswith("(quantized, scales as float32)")
    assert checks["gguf"]["passed"] and checks["gguf"]["weights"].endswith("(quantized, scales as float16)")
    assert report["measured_on"]["candidate"].startswith("onnx/")


def test_qwen2_with_attention_biases(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:  # transformers initializes biases to zero: make them count
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    write_onnx(model, tmp_path / FILE_NAME)
    ids = np.arange(5, 60, dtype=np.int64)[None]
    logits, _ = run_decoder(onnx_session(tmp_path / FILE_NAME), ids)
    assert relative_rms(logits, candidate_logits(model, ids)) < 1e-5
