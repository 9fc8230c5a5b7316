"""The memory forecast (lmpress.memory_plan) and the memory the GPTQ solve takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmpress.api import quantize_model
from lmpress.calib.statistics import inverse_hessian_factor, invert_upper_triangular_, reverse_storage_
from lmpress.cli import main
from lmpress.loader import load_model, model_skeleton
from lmpress.memory_plan import PROCESS_BYTES, ModelShape, forecast_memory, packed_bytes
from lmpress.registry import stage_config
from lmpress.weights.qlinear import QuantizedLinear

REPO = Path(__file__).resolve().parents[1]


def spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, n, generator=g)
    return x.T @ x / n


def test_inverse_hessian_factor_is_the_textbook_factor():
    """U with Uᵀ U = (H + λI)⁻¹, against float64 Cholesky, inverse and Cholesky again."""
    H = spd(300)
    U, damp = inverse_hessian_factor(H.clone, 0.01)
    damped = H.double() + 0.01 * H.diagonal().mean().double() * torch.eye(300, dtype=torch.float64)
    reference = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    assert damp == 0.01
    assert U.mT.is_contiguous() and torch.equal(U, U.triu())
    assert torch.allclose(U.double(), reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


def test_triangular_inverse_in_place_whatever_the_block():
    R = torch.linalg.cholesky(spd(200, seed=1), upper=True)
    expected = torch.linalg.inv(R.double())
    for rows in (200, 64, 7):
        inverted = R.clone()
        invert_upper_triangular_(inverted, rows)
        assert torch.allclose(inverted.double(), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


def test_reverse_storage_flips_rows_and_columns():
    m = torch.arange(30.0).reshape(5, 6)
    reversed_m = m.clone()
    reverse_storage_(reversed_m, chunk=4)
    assert torch.equal(reversed_m, m.flip(0, 1))


PEAK_PROBE = """
import sys, torch
from lmpress.calib.statistics import inverse_hessian_factor
n = int(sys.argv[1])
x = torch.randn(n + 64, n)
H = x.T @ x
del x
def hwm():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
import lmpress.memory as memory
memory.trim_c_heap()
open("/proc/self/clear_refs", "w").write("5")
before = hwm()
U, _ = inverse_hessian_factor(H.clone, 0.01)
print((hwm() - before) / (n * n * 4))
"""


def test_gptq_solve_holds_two_matrices_beside_the_hessian():
    """The working copy and row-block temporaries beyond the caller's H (the textbook sequence, with its
    identity and LAPACK's copies, took 5 n x n); measured in a fresh process by the kernel's high-water mark."""
    n = 3072
    done = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(n)], capture_output=True, text=True, check=True)
    extra = float(done.stdout.strip().splitlines()[-1])
    assert extra < 2.5, f"the solve took {extra:.2f} x n^2 float32 beyond H"


def test_quantized_part_is_what_the_model_then_holds(tiny_llama_dir):
    """The forecast's quantized bytes against the buffers of the QuantizedLinear layers an RTN stage leaves."""
    settings = {"bits": 4, "group_size": 32, "overrides": {".*down_proj": {"bits": 8}}, "ignore": ["lm_head"]}
    config = stage_config("rtn")(method="rtn", **settings)
    skeleton = model_skeleton(tiny_llama_dir)
    forecast = forecast_memory(skeleton, tiny_llama_dir, "float32", [config], 4, 32, torch.device("cpu"))
    loaded = load_model(str(tiny_llama_dir))
    quantize_model(loaded.model, method="rtn", **settings)
    held = sum(
        buffer.numel() * buffer.element_size()
        for module in loaded.model.modules()
        if isinstance(module, QuantizedLinear)
        for buffer in (module.qweight, module.scales, module.zeros)
    )
    assert forecast.parts["quantized"] == held


def test_streamed_layers_hold_one_layer_of_packed_weights(tiny_llama_dir):
    """The layer-wise engine maps finished layers' packed weights from its state files: a streamed GPTQ run's
    forecast holds the largest layer's, an RTN stage (whole model, no state files) or an eval's all of them."""
    skeleton = model_skeleton(tiny_llama_dir)
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    cpu = torch.device("cpu")
    streamed = forecast_memory(skeleton, tiny_llama_dir, "float32", [gptq], 4, 32, cpu)
    whole = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, cpu)
    scored = forecast_memory(skeleton, tiny_llama_dir, "float32", [gptq], 4, 32, cpu, 4 * 64)
    layers = len(skeleton.model.layers)
    assert layers > 1 and whole.parts["quantized"] == scored.phases["stages"]["quantized"]
    assert streamed.parts["quantized"] * layers == whole.parts["quantized"]  # alike layers; lm_head is not planned


def test_packed_bytes_counts_words_scales_and_zeros():
    assert packed_bytes(16, 96, 4, 32) == 16 * 12 * 4 + 16 * 3 * 5  # 96 4-bit codes in 12 words, 3 groups
    assert packed_bytes(16, 96, 3, 96) == 16 * 9 * 4 + 16 * 5  # 288 bits in 9 words, one group per row


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", None])
def test_a_plans_bytes_are_what_the_quantized_layer_holds(fmt):
    """The forecast's bytes for a layer are its module's buffers (FP4: packed E2M1 and a byte per block scale; FP8:
    a byte per weight and a float32 scale per row; integer W4 g32: codes, scales and zero points), within the
    per-tensor global scales."""
    from lmpress.memory_plan import scale_bytes
    from lmpress.quantize.fp8 import FP8_WEIGHTS
    from lmpress.weights.float8 import Fp8Linear
    from lmpress.weights.fp4 import FP4_BLOCK, Fp4Linear, quantize_weight_fp4
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 16, bias=False)
    if fmt == "fp8":
        scheme, layer = FP8_WEIGHTS, Fp8Linear.from_linear(linear, "channel")
    elif fmt:
        scheme = QuantScheme(4, FP4_BLOCK[fmt], True, fp4=fmt)
        layer = Fp4Linear.from_weight(quantize_weight_fp4(linear.weight.data, scheme), None)
    else:
        scheme = QuantScheme(4, 32, False)
        layer = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(linear.weight.data, scheme), None)
    held = sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)
    planned = packed_bytes(16, 96, scheme.bits, scheme.group_width(96), scale_bytes(scheme))
    assert 0 <= held - planned <= 8  # NVFP4's float32 global scale (and its input one) are not planned


def test_forecast_streams_a_mapped_checkpoint_without_eval(tiny_llama_dir):
    """A bfloat16 run with no eval keeps about a layer of the float model; an eval holds it all."""
    skeleton = model_skeleton(tiny_llama_dir)
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    streamed = forecast_memory(skeleton, tiny_llama_dir, "float32", [gptq], 4, 32, torch.device("cpu"))
    scored = forecast_memory(skeleton, tiny_llama_dir, "float32", [gptq], 4, 32, torch.device("cpu"), 4 * 64)
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in skeleton.model.layers)
    whole = sum(p.numel() for p in skeleton.parameters()) * 4
    assert streamed.parts["weights"] == 2 * layer * 4 < whole
    assert streamed.phase == "stages"
    baseline = scored.phases["baseline eval"]
    assert baseline["weights"] == whole and baseline["eval"] > 0  # the model and the eval's logits
    assert scored.phase in ("baseline eval", "candidate eval")


def test_a_rotation_holds_the_whole_float_model(tiny_llama_dir):
    """rotate rewrites every weight at once: a rotate + GPTQ run without eval cannot stream the layers."""
    skeleton = model_skeleton(tiny_llama_dir)
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    rotate = stage_config("rotate")(method="rotate")
    streamed = forecast_memory(skeleton, tiny_llama_dir, "float32", [gptq], 4, 32, torch.device("cpu"))
    rotated = forecast_memory(skeleton, tiny_llama_dir, "float32", [rotate, gptq], 4, 32, torch.device("cpu"))
    whole = sum(p.numel() for p in skeleton.parameters()) * 4
    assert streamed.parts["weights"] < whole
    linears = sum(
        m.weight.numel() for n, m in skeleton.named_modules() if ".layers." in n and hasattr(m, "in_features")
    )
    # the model is held whole: what is not quantized stays float (and the head R1 unties from the embedding),
    # and every layer's codes are held
    table = skeleton.get_output_embeddings().weight.numel() * 4
    assert skeleton.config.tie_word_embeddings and rotated.parts["weights"] == whole - 4 * linears + table
    assert rotated.parts["quantized"] > streamed.parts["quantized"]
    # ... and the quantized linears' float pages stay mapped beside their codes; streamed layers' are dropped
    assert rotated.parts["mapped float pages"] == 4 * linears and "mapped float pages" not in streamed.parts


def test_float_pages_stay_resident_only_where_the_checkpoint_is_mapped(tiny_llama_dir):
    """A checkpoint read in its stored dtype is memory-mapped: after the baseline eval (or any whole read) the
    quantized linears' float pages stay resident through every later phase, which the forecast counts; a run in
    another dtype converts the weights into memory of its own and frees them as they are quantized."""
    skeleton = model_skeleton(tiny_llama_dir)
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    cpu = torch.device("cpu")
    mapped = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, cpu, 4 * 64, ["compressed-tensors"])
    converted = forecast_memory(skeleton, tiny_llama_dir, "bfloat16", [rtn], 4, 32, cpu, 4 * 64, ["gguf"])
    linears = sum(
        m.weight.numel() for n, m in skeleton.named_modules() if ".layers." in n and hasattr(m, "in_features")
    )
    for phase in ("stages", "read-back", "runtime agreement", "candidate eval"):
        assert mapped.phases[phase]["mapped float pages"] == 4 * linears
        assert "mapped float pages" not in converted.phases[phase]
    assert "mapped float pages" not in mapped.phases["baseline eval"]  # there the whole model is "weights"


@pytest.mark.parametrize("native", [True, False])
def test_a_16bit_model_s_evals_hold_one_float32_layer_where_its_matmuls_are_slow(tiny_llama_dir, monkeypatch, native):
    """layers_in_float32 widens one decoder layer at a time in every phase that runs the model's forward (the evals,
    the read-back's window, the runtime agreement's evaluator); the stages count their own."""
    from lmpress.calib import compute_dtype

    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: native)
    skeleton = model_skeleton(tiny_llama_dir)
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    cpu = torch.device("cpu")
    forecast = forecast_memory(skeleton, tiny_llama_dir, "bfloat16", [rtn], 4, 32, cpu, 4 * 64, ["compressed-tensors"])
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in skeleton.model.layers)
    widest = max(layer, skeleton.lm_head.weight.numel())  # a decoder layer or the output layer
    for phase in ("baseline eval", "read-back", "runtime agreement", "candidate eval"):
        assert forecast.phases[phase].get("float32 layer") == (None if native else 4 * widest)
    assert "float32 layer" not in forecast.phases["stages"]  # RTN reads the whole model: no layer is widened


def rtn_recipe(model, tmp_path, formats: list[str]):
    """A short RTN W4 run of ``model`` exporting ``formats``, scored on two 64-token windows."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"source": str(model)},
                "data": {"samples": 2, "seq_len": 32},
                "stages": [{"method": "rtn", "bits": 4, "group_size": 32}],
                "export": {"formats": formats},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
            }
        )
    )
    return recipe


def test_run_prints_and_reports_its_forecast(tiny_llama_dir, tmp_path, capsys):
    recipe = rtn_recipe(tiny_llama_dir, tmp_path, [])
    assert main(["run", str(recipe), "--out", str(tmp_path / "out")]) == 0
    assert "memory forecast:" in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["memory_forecast_phases_mb"]) == {"stages", "baseline eval", "candidate eval"}
    assert sum(report["memory_forecast_mb"].values()) == pytest.approx(
        max(report["memory_forecast_phases_mb"].values()), abs=0.5
    )


def test_a_tied_table_whose_head_is_quantized_stays_in_the_candidate(tiny_llama_dir):
    """The tiny Llama ties its embedding and head: quantizing the head leaves the table float as the embedding, so
    the candidate the read-back and the runtime agreement hold is what the quantized model holds (its float
    parameters and its packed buffers), the table included."""
    settings = {"bits": 4, "group_size": 32, "overrides": {"lm_head": {"bits": 8, "group_size": -1}}, "ignore": []}
    rtn = stage_config("rtn")(method="rtn", **settings)
    skeleton = model_skeleton(tiny_llama_dir)
    assert skeleton.config.tie_word_embeddings
    forecast = forecast_memory(
        skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, torch.device("cpu"), 4 * 64, ["compressed-tensors"], 64
    )
    loaded = load_model(str(tiny_llama_dir))
    quantize_model(loaded.model, method="rtn", **settings)
    assert isinstance(loaded.model.lm_head, QuantizedLinear)
    floats = {id(p): p.numel() * p.element_size() for p in loaded.model.parameters()}
    packed = sum(
        b.numel() * b.element_size()
        for m in loaded.model.modules()
        if isinstance(m, QuantizedLinear)
        for b in (m.qweight, m.scales, m.zeros)
    )
    assert forecast.phases["runtime agreement"]["candidate"] == sum(floats.values()) + packed


def test_a_rotation_that_unties_the_head_counts_its_table_in_the_candidate_and_dense_exports(tiny_llama_dir, tmp_path):
    """R1 folds the final norm's scale into a tied head: the head gets a float table of its own, which the stages,
    the candidate and a dense export (hf) hold beside the embedding's."""
    loaded = load_model(str(tiny_llama_dir))
    loaded.model.model.norm.weight.data.uniform_(0.5, 1.5)  # a trained norm's scale: never all ones
    loaded.model.save_pretrained(tmp_path)
    loaded.tokenizer.save_pretrained(tmp_path)
    rotate = stage_config("rotate")(method="rotate")
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    skeleton = model_skeleton(tmp_path)
    assert skeleton.config.tie_word_embeddings
    args = (tmp_path, "float32", [rotate, rtn], 4, 32, torch.device("cpu"), 4 * 64, ["compressed-tensors", "hf"], 64)
    forecast = forecast_memory(skeleton, *args)
    model = load_model(str(tmp_path)).model
    quantize_model(model, method="rotate")
    quantize_model(model, method="rtn", bits=4, group_size=32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, kept float
    floats = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    packed = sum(
        b.numel() * b.element_size()
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
        for b in (m.qweight, m.scales, m.zeros)
    )
    assert forecast.phases["runtime agreement"]["candidate"] == sum(floats.values()) + packed
    dense = sum(p.numel() for p in skeleton.parameters()) * 4 + model.lm_head.weight.numel() * 4
    assert forecast.phases["read-back"]["read-back"] == sum(floats.values()) + packed + dense
    kept = forecast_memory(skeleton, tmp_path, "float32", [rtn], 4, 32, torch.device("cpu"), 4 * 64, ["hf"], 64)
    table = model.lm_head.weight.numel() * 4
    assert forecast.phases["stages"]["weights"] == kept.phases["stages"]["weights"] + table


@pytest.mark.parametrize("activations", [None, "fp4"])
def test_the_runtime_model_counts_the_float_weights_of_fp4_w4a4_layers(tiny_llama_dir, tmp_path, activations):
    """The runtime holds an FP4 W4A4 layer's weight dequantized once (float, the run's dtype); A16 layers stay
    packed on the CPU. The forecast's runtime model adds those float weights over the candidate's codes."""
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.kernels import kernel_of
    from tests.runtime.test_fp4_runtime import export_fp4

    scheme = {"fp4": "mxfp4", "activations": activations}  # MXFP4: no static activation scale for RTN to lack
    rtn = stage_config("rtn")(method="rtn", **scheme)
    skeleton = model_skeleton(tiny_llama_dir)
    forecast = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, torch.device("cpu"), 0, ["hf"], 64)
    extra = forecast.phases["runtime agreement"]["runtime model"] - forecast.phases["runtime agreement"]["candidate"]
    _, out = export_fp4(tiny_llama_dir, tmp_path, "compressed-tensors", **scheme)
    runtime = load_checkpoint(out)
    float_weights = sum(m.weight.numel() * 4 for m in runtime.modules() if kernel_of(m) == "fp4-simulated")
    assert (float_weights > 0) == (activations is not None)
    # MXFP4: packed E2M1 codes and an E8M0 byte a block
    packed = sum(packed_bytes(o, i, 4, 32, 1) for o, i in linear_shapes(skeleton)) if activations else 0
    assert extra == float_weights - packed


@pytest.mark.parametrize(("group", "kernel"), [(32, "int8-simulated"), (64, "cpu-w4a8")])
def test_the_runtime_model_counts_the_float_weights_of_w4a8_layers_it_dequantizes(
    tiny_llama_dir, tmp_path, group, kernel
):
    """A W4A8 layer (int4 weights in groups, int8 activations per token) runs on lmpress's CPU kernel where it holds
    the groups (packed, as the candidate holds it), else with its weight dequantized once (``int8-simulated``):
    the forecast's runtime model adds those float weights over its codes."""
    from lmpress.runtime.kernels import cpu_int

    if kernel == "cpu-w4a8" and not cpu_int.available():
        pytest.skip("the C++ kernels do not build on this host")
    from lmpress.export.compressed_tensors import export_compressed_tensors
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.kernels import kernel_of

    scheme = {"bits": 4, "group_size": group, "activations": "int8"}
    skeleton = model_skeleton(tiny_llama_dir)
    rtn = stage_config("rtn")(method="rtn", **scheme)
    forecast = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, torch.device("cpu"), 0, ["hf"], 64)
    extra = forecast.phases["runtime agreement"]["runtime model"] - forecast.phases["runtime agreement"]["candidate"]
    loaded = load_model(str(tiny_llama_dir))
    quantize_model(loaded.model, method="rtn", **scheme)
    export_compressed_tensors(loaded.model, loaded.tokenizer, tmp_path / "ct")
    runtime = load_checkpoint(tmp_path / "ct")
    kernels = {kernel_of(m) for m in runtime.layers.modules() if hasattr(m, "KERNEL")}
    float_weights = sum(m.weight.numel() * 4 for m in runtime.modules() if kernel_of(m) == "int8-simulated")
    packed = sum(packed_bytes(o, i, 4, group) for o, i in linear_shapes(skeleton)) if float_weights else 0
    assert kernels == {kernel} and extra == float_weights - packed


@pytest.mark.parametrize("fp8_matmul", [False, True])
def test_an_fp8_stage_counts_its_codes_and_the_runtime_its_float32_values(
    tiny_llama_dir, tmp_path, fp8_matmul, monkeypatch
):
    """An FP8 stage's layers hold a byte per weight and a scale per row; where no FP8 matmul runs (the CPU), the
    runtime keeps each one's E4M3 values in float32 beside the codes (kernels.fp8.Fp8SimulatedLinear)."""
    import lmpress.memory_plan
    from lmpress.export.compressed_tensors import export_compressed_tensors
    from lmpress.quantize.fp8 import run_fp8
    from lmpress.registry import StageContext
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.kernels import kernel_of
    from lmpress.weights.float8 import fp8_layers

    monkeypatch.setattr(lmpress.memory_plan, "real_fp8_matmul_available", lambda device: fp8_matmul)
    config = stage_config("fp8")(method="fp8")
    skeleton = model_skeleton(tiny_llama_dir)
    forecast = forecast_memory(
        skeleton, tiny_llama_dir, "float32", [config], 4, 32, torch.device("cpu"), 0, ["compressed-tensors"], 64
    )
    loaded = load_model(str(tiny_llama_dir))
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "state", resume=False, fingerprint="x")
    run_fp8(loaded.model, config, ctx)
    layers = fp8_layers(loaded.model)
    held = sum(b.numel() * b.element_size() for m in layers.values() for b in (m.weight, m.weight_scale))
    rows = sum(m.out_features for m in layers.values())
    assert held <= forecast.phases["stages"]["quantized"] <= held + rows  # plus a zero point's byte per row
    out = tmp_path / "artifact"
    export_compressed_tensors(loaded.model, loaded.tokenizer, out)
    runtime = load_checkpoint(out)
    values = sum(m.values.numel() * 4 for m in runtime.modules() if kernel_of(m) == "fp8-simulated")
    assert values == sum(m.weight.numel() * 4 for m in layers.values())
    agreement = forecast.phases["runtime agreement"]
    assert agreement["runtime model"] - agreement["candidate"] == (0 if fp8_matmul else values)


def linear_shapes(model) -> list[tuple[int, int]]:
    return [
        (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if ".layers." in n and hasattr(m, "in_features")
    ]


def test_every_phase_after_the_stages_is_forecast(tiny_llama_dir):
    """With exports, the read-back holds the candidate and the export, the runtime agreement the candidate, the
    read-back export, the runtime's model and both sides' logits over the first window, the candidate eval the
    read-back export and the eval's logits; a dense export reads back the whole float model."""
    skeleton = model_skeleton(tiny_llama_dir)
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    cpu = torch.device("cpu")
    packed = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, cpu, 4 * 64, ["compressed-tensors"], 64)
    dense = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 4, 32, cpu, 4 * 64, ["hf"], 64)
    whole = sum(p.numel() for p in skeleton.parameters()) * 4
    vocab = skeleton.config.vocab_size
    agreement = packed.phases["runtime agreement"]
    assert agreement["logits"] == 2 * 64 * vocab * 4
    assert agreement["candidate"] == agreement["read-back"] == agreement["runtime model"] < whole
    assert dense.phases["read-back"]["read-back"] == whole == dense.phases["runtime agreement"]["read-back"]
    assert packed.phases["candidate eval"] == {"process": PROCESS_BYTES} | {
        "read-back": agreement["read-back"],
        "eval": packed.phases["baseline eval"]["eval"],
        "mapped float pages": agreement["mapped float pages"],
    }


def test_each_phase_of_a_run_reports_its_own_time_and_peak(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    # In a fresh process: a long-lived one (the test session) holds freed heap that a new block may reuse unseen.
    script = (
        "import json, torch\n"
        "from lmpress.memory import RunPhases\n"
        "phases = RunPhases()\n"
        "with phases.phase('big'):\n"
        "    block = torch.ones(300 << 18)  # 300 MiB, touched\n"
        "    del block\n"
        "with phases.phase('small'):\n"
        "    pass\n"
        "print(json.dumps(phases.measured))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(done.stdout.splitlines()[-1])
    big, small = measured["big"], measured["small"]
    assert big["peak_rss_mb"] >= small["peak_rss_mb"] + 250  # the second phase's mark starts after the first's

    recipe = rtn_recipe(tiny_llama_dir, tmp_path, ["compressed-tensors"])
    assert main(["run", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    measured = report["phases"]
    assert list(measured) == ["load", "baseline eval", "export", "read-back", "runtime agreement", "candidate eval"]
    assert all(m["seconds"] >= 0 and 0 < m["peak_rss_mb"] <= report["peak_rss_mb"] + 1 for m in measured.values())


def test_run_refuses_more_than_the_machine_has(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Refused before any work: exit 2, one line that says how much it needs, --out untouched."""
    import lmpress.pipeline

    monkeypatch.setattr(lmpress.pipeline, "available_memory", lambda device: (64 << 20, None))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"model": str(tiny_llama_dir), "stages": [{"method": "rtn"}]}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("mine")
    code = main(["run", str(recipe), "--out", str(out), "--overwrite", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "needs about" in err and "0.1 GiB is available" in err, err
    assert [p.name for p in out.iterdir()] == ["kept.txt"]


@pytest.mark.slow
def test_scale_bench_runs(tmp_path):
    """bench/scale.py end to end on the 1B shape (builds a 2.5 GB checkpoint once): see docs/scale.md."""
    command = [sys.executable, str(REPO / "bench" / "scale.py"), "--shapes", "llama-3.2-1b", "--layers", "1"]
    subprocess.run([*command, "--check-layers", "0", "--out", str(tmp_path / "scale.json")], check=True)
    row = json.loads((tmp_path / "scale.json").read_text())["rows"][0]
    assert 0.8 <= row["forecast_vs_peak"] <= 1.2


def test_a_spread_pass_forecasts_each_process_its_share_of_the_activations(tiny_llama_dir):
    skeleton, cpu = model_skeleton(tiny_llama_dir), torch.device("cpu")
    gptq = stage_config("gptq")(bits=4, group_size=32)  # spreads (lmpress.calib.ranks)
    learned = stage_config("learned")(bits=4, group_size=32)  # half of each batch's samples
    awq_learned = stage_config("learned")(bits=4, group_size=32, init="awq")  # every process, every batch
    hidden, seq_len = skeleton.config.hidden_size, 32
    for stage, share in (
        (gptq, 8),
        (learned, 8),
        (awq_learned, 16),
    ):  # 16 samples: gptq's 4 batches of 4, learned's 2 of 8
        one, two = (
            forecast_memory(skeleton, tiny_llama_dir, "float32", [stage], 16, seq_len, cpu, processes=n) for n in (1, 2)
        )
        slab = one.phases["stages"]["calibration"] - two.phases["stages"]["calibration"]
        assert slab == (16 - share) * seq_len * hidden * 2  # float16 activations
    assert "each of the 1 other launched processes" in two.describe()


GIANTS = REPO / "tests" / "data" / "giants"


def giant_forecast(tmp_path, shape: str, processes: int, capsys) -> str:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{source: {GIANTS / shape}, dtype: bfloat16}}\n"
        "data: {source: builtin:wikitext2, samples: 128, seq_len: 2048}\n"
        "stages: [{method: gptq, bits: 4, group_size: 128, ignore: [lm_head]}]\n"
        "export: {formats: [compressed-tensors]}\n"
    )
    assert main(["forecast", str(recipe), "--processes", str(processes)]) == 0
    return capsys.readouterr().out


@pytest.mark.long
def test_forecast_from_a_config_alone_counts_every_linear_of_a_giant(tmp_path, capsys):
    """Llama-3-70B's and Qwen3-235B-A22B's published configs (no weights anywhere): the packed weights of the
    largest layer, counted by hand from the configs' shapes (the MoE's 128 experts each as 3 linears)."""
    from lmpress.loader import model_skeleton as skeleton_of
    from lmpress.memory_plan import forecast_checkpoint
    from lmpress.recipe import load_recipe

    out = giant_forecast(tmp_path, "llama-3-70b", 8, capsys)
    assert "each of the 7 other launched processes" in " ".join(out.split())
    recipe = load_recipe(str(tmp_path / "recipe.yaml"), [])
    llama = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672)]
    forecast = forecast_checkpoint(recipe, 8)
    assert forecast.phases["stages"]["quantized"] == sum(packed_bytes(r, c, 4, 128) for r, c in llama)
    layer = sum(r * c for r, c in llama) + 2 * 8192  # its linears and two norms
    assert forecast.phases["stages"]["weights"] == 2 * layer * 2  # two layers in bfloat16
    qwen = [(8192, 4096), (512, 4096), (512, 4096), (4096, 8192)] + [(1536, 4096), (1536, 4096), (4096, 1536)] * 128
    recipe = load_recipe(str(tmp_path / "recipe.yaml"), [f"model.source={GIANTS / 'qwen3-235b-a22b'}"])
    forecast = forecast_checkpoint(recipe, 1)
    assert forecast.phases["stages"]["quantized"] == sum(packed_bytes(r, c, 4, 128) for r, c in qwen)
    assert sum(p.numel() for p in skeleton_of(GIANTS / "qwen3-235b-a22b", weights=False).parameters()) > 235e9


def test_learned_rotations_forecast_their_backpropagation(tiny_llama_dir):
    """rotate's learn keeps a step's activations for backpropagation: the forecast holds them when they are more
    than the calibration pass's, and they grow with the tokens of a step."""
    skeleton = model_skeleton(tiny_llama_dir)
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    rotate = stage_config("rotate")(method="rotate", learn={"activations": "int8", "batch_size": 2})
    cpu = torch.device("cpu")
    plain = forecast_memory(skeleton, tiny_llama_dir, "float32", [stage_config("rotate")(), gptq], 4, 32, cpu)
    learned = forecast_memory(skeleton, tiny_llama_dir, "float32", [rotate, gptq], 4, 32, cpu)
    longer = forecast_memory(skeleton, tiny_llama_dir, "float32", [rotate, gptq], 4, 64, cpu)
    widths = sum(
        m.in_features + m.out_features
        for n, m in skeleton.named_modules()
        if ".layers." in n and hasattr(m, "in_features")
    )
    vocab = skeleton.config.vocab_size
    assert learned.parts["rotation learning"] == 2 * 32 * 4 * (5 * widths + 6 * vocab)
    assert longer.parts["rotation learning"] == 2 * learned.parts["rotation learning"]
    assert "rotation learning" not in plain.parts and learned.ram_bytes > plain.ram_bytes


def test_a_draft_head_stage_forecasts_the_runtime_copy_its_capture_and_its_training(tiny_llama_dir):
    """The draft head runs the whole quantized target in lmpress's runtime (a copy of its packed weights and its
    embeddings in float32), keeps every captured feature, and then the larger of the capture (a batch's KV cache,
    one read's logits) and training (which grows with the batch and the drafting steps); nothing streams."""
    skeleton = model_skeleton(tiny_llama_dir)
    rtn = stage_config("rtn")(method="rtn", bits=4, group_size=32)
    head = stage_config("draft_head")(method="draft_head", prompts=16, prompt_tokens=8, new_tokens=24, held_out=2)
    more = head.model_copy(update={"prompts": 64})
    cpu = torch.device("cpu")
    alone = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn], 16, 32, cpu)
    drafted = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn, head], 16, 32, cpu)
    longer = forecast_memory(skeleton, tiny_llama_dir, "float32", [rtn, more], 64, 32, cpu)
    shape = ModelShape.of(skeleton)
    packed = drafted.phases["stages"]["quantized"]
    features = 16 * 32 * 3 * shape.hidden * 2
    config = skeleton.config
    assert (shape.layers, shape.heads) == (config.num_hidden_layers, config.num_attention_heads)
    assert shape.kv_width == config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    cache = 16 * 32 * shape.layers * 2 * shape.kv_width * 4  # float32 keys and values of 16 sequences
    assert drafted.phases["stages"]["draft head"] >= 4 * shape.vocab * shape.hidden + packed + features + cache
    assert longer.phases["stages"]["draft head"] - drafted.phases["stages"]["draft head"] == 3 * features
    for update in ({"batch_size": 64}, {"batch_size": 64, "steps": 6}):
        bigger = forecast_memory(
            skeleton, tiny_llama_dir, "float32", [rtn, head.model_copy(update=update)], 16, 32, cpu
        )
        assert bigger.phases["stages"]["draft head"] > drafted.phases["stages"]["draft head"]
        drafted = bigger
    assert "draft head" not in alone.phases["stages"] and drafted.ram_bytes > alone.ram_bytes


def test_a_distill_stage_forecasts_the_teacher_the_optimizer_and_one_micro_batch(tiny_llama_dir):
    """Distillation holds the teacher, AdamW's state of what trains (with fixed codes: the scales and norms; with
    latent weights: every weight, and a float copy of each quantized one) and one micro-batch's activations and
    logits, which grow with its tokens, halve with two micro-batches a step and shrink with checkpointing."""
    from lmpress.distill.config import STEP_ACTIVATION_COPIES, STEP_LOGIT_COPIES

    skeleton = model_skeleton(tiny_llama_dir)
    shape = ModelShape.of(skeleton)
    rtn = stage_config("rtn")(method="rtn", fp4="nvfp4")
    distill = stage_config("distill")(method="distill", train_on="calibration", batch_size=4, learn_weights=False)
    cpu = torch.device("cpu")

    def training(**update) -> int:
        stages = [rtn, distill.model_copy(update=update)]
        return forecast_memory(skeleton, tiny_llama_dir, "float32", stages, 8, 32, cpu).phases["stages"]["training"]

    weights = sum(rows * cols for _, rows, cols in shape.linears)
    norms = (2 * shape.layers + 1) * shape.hidden
    widths = sum(rows + cols for _, rows, cols in shape.linears)
    per_token = 4 * (STEP_ACTIVATION_COPIES * widths + STEP_LOGIT_COPIES * shape.vocab)
    fixed = training()
    assert fixed == int(4 * shape.parameters + 12 * (norms + weights // 16) + 4 * 32 * per_token)
    assert training(batch_size=8) - fixed == int(4 * 32 * per_token)
    assert training(batch_size=8, grad_accum=2) == fixed
    assert training(gradient_checkpointing=True) < fixed
    latent = training(learn_weights=True) - fixed
    assert latent == 4 * weights + 12 * (shape.parameters - shape.vocab * shape.hidden - norms)


def test_a_distill_stage_trains_the_student_the_stages_before_it_leave(tiny_llama_dir, tmp_path):
    """The student is the model as the earlier stages leave it: a depth pruning before it shrinks it (its teacher
    stays the model as loaded), a quantization after it is not yet there to train (draft-student.yaml was forecast
    at 5.19 GiB against 3.35 measured: 30 layers and a latent copy of every weight, for a 15-layer float student)."""
    from tests.conftest import save_tiny_model

    deep = save_tiny_model(tmp_path / "deep", "llama", num_hidden_layers=3)
    shallow = save_tiny_model(tmp_path / "shallow", "llama", num_hidden_layers=2)
    distill = stage_config("distill")(method="distill", train_on="calibration", batch_size=4)
    depth = stage_config("structured")(method="structured", layers=1)
    rtn = stage_config("rtn")(method="rtn")
    cpu = torch.device("cpu")

    def training(path: Path, *stages) -> int:
        forecast = forecast_memory(model_skeleton(path), path, "float32", list(stages), 8, 32, cpu)
        return forecast.phases["stages"]["training"]

    teachers = ModelShape.of(model_skeleton(deep)).parameters - ModelShape.of(model_skeleton(shallow)).parameters
    assert training(deep, depth, distill) == training(shallow, distill) + 4 * teachers
    assert training(deep, distill, rtn) == training(deep, distill)
    assert training(deep, rtn, distill) > training(deep, distill)  # the quantized weights' latent copies


def test_a_learning_stage_after_depth_pruning_is_planned_on_the_layers_left(tmp_path):
    """A learning stage holds what the model as the stages before it leave needs: rotations learned after a depth
    pruning backpropagate through the layers left, as they would for a model built that shallow."""
    from tests.conftest import save_tiny_model

    deep = save_tiny_model(tmp_path / "deep", "llama", num_hidden_layers=3)
    shallow = save_tiny_model(tmp_path / "shallow", "llama", num_hidden_layers=2)
    depth = stage_config("structured")(method="structured", layers=1)
    rotate = stage_config("rotate")(method="rotate", learn={"activations": "int8", "batch_size": 2})
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    cpu = torch.device("cpu")

    def learning(path: Path, *stages) -> int:
        forecast = forecast_memory(model_skeleton(path), path, "float32", list(stages), 4, 32, cpu)
        return forecast.parts["rotation learning"]

    assert learning(deep, depth, rotate, gptq) == learning(shallow, rotate, gptq) < learning(deep, rotate, gptq)


@pytest.mark.long
def test_a_moe_layers_expert_hessians_are_forecast_held_at_once_and_spread_by_expert(tmp_path, monkeypatch):
    """Qwen3-235B-A22B's 128 experts a layer: GPTQ holds each expert's 1536-wide down projection Hessian until
    the group is solved (in float32 terms, 128 x 1536² x 4 bytes), each of 8 processes 16 of them
    (calib.expert_ranks); a pass without Hessians (RTN-rounded AWQ) none. Each process holds the float stand-ins
    of its own experts alone."""
    from lmpress.calib.moe import unfuse_experts
    from lmpress.memory_plan import expert_hessian_bytes, forecast_checkpoint
    from lmpress.recipe import load_recipe

    giant_forecast_recipe = tmp_path / "recipe.yaml"
    giant_forecast_recipe.write_text(
        f"model: {{source: {GIANTS / 'qwen3-235b-a22b'}, dtype: bfloat16}}\n"
        "data: {source: builtin:wikitext2, samples: 128, seq_len: 2048}\n"
        "stages: [{method: gptq, bits: 4, group_size: 128, ignore: [lm_head]}]\n"
    )
    monkeypatch.setattr("lmpress.memory_plan.widens_to_float32", lambda dtype, device: False)  # no float32 layer
    recipe = load_recipe(str(giant_forecast_recipe), [])
    skeleton = model_skeleton(GIANTS / "qwen3-235b-a22b", weights=False)
    with torch.device("meta"):
        unfuse_experts(skeleton)  # as a run and the forecast do
    shape = ModelShape.of(skeleton)
    held = 128 * 1536**2 * 4
    assert expert_hessian_bytes(shape) == held and expert_hessian_bytes(shape, 8) == held // 8
    assert expert_hessian_bytes(shape, 3) == 43 * 1536**2 * 4  # shares differ by one expert at most
    one, eight = (forecast_checkpoint(recipe, n).phases["stages"]["calibration"] for n in (1, 8))
    slab = 128 * 2048 * 4096 * 2  # float16 activations: an eighth of them in each of 8 processes
    recorded = 16 * 2048 * 4096 * 2  # and the experts block's input on those 16 samples, in bfloat16
    assert one - eight == held - held // 8 + slab - slab // 8 - recorded
    awq = load_recipe(str(giant_forecast_recipe), ["stages.0.method=awq"])
    assert forecast_checkpoint(awq, 1).phases["stages"]["calibration"] < one - held // 2
    llama = ModelShape.of(model_skeleton(GIANTS / "llama-3-70b", weights=False))
    assert expert_hessian_bytes(llama) == 0
    # the layer's float weights mapped, beside their stand-ins: each process an eighth of the experts' (bfloat16)
    experts = 128 * 3 * 4096 * 1536
    assert shape.layer_expert_parameters == experts and llama.layer_expert_parameters == 0
    one, eight = (forecast_checkpoint(recipe, n).phases["stages"]["weights"] for n in (1, 8))
    assert one == 2 * 2 * shape.layer_parameters and one - eight == 2 * (experts - experts // 8)


def test_w8a8_layers_are_forecast_with_their_transposed_int8_weights_once_evaluated(tiny_llama_dir):
    """A W8A8 layer the evals run keeps its int8 weights transposed beside its packed codes from its first forward
    (the read-back's first window) to the end of the run: the candidate and each read-back artifact hold one byte
    per weight more than a W8 weight-only layer's; the stages' quantized layers do not."""
    skeleton = model_skeleton(tiny_llama_dir)
    cpu = torch.device("cpu")
    w8a8 = stage_config("smoothquant")(method="smoothquant", alpha=0.5, ignore=["lm_head"])
    w8 = stage_config("gptq")(method="gptq", bits=8, group_size=-1, ignore=["lm_head"])

    def forecast(stage):
        return forecast_memory(skeleton, tiny_llama_dir, "float32", [stage], 4, 32, cpu, 64, ["compressed-tensors"])

    with_int8, weight_only = forecast(w8a8), forecast(w8)
    weights = sum(rows * cols for name, rows, cols in ModelShape.of(skeleton).linears if "lm_head" not in name)
    held = [("read-back", "candidate"), ("read-back", "read-back"), ("runtime agreement", "candidate")]
    for phase, part in [*held, ("candidate eval", "read-back")]:
        assert with_int8.phases[phase][part] - weight_only.phases[phase][part] == weights, (phase, part)
    assert with_int8.phases["stages"]["quantized"] == weight_only.phases["stages"]["quantized"]


def test_sparsegpt_with_joint_quantization_is_forecast_as_the_quantized_model_it_writes(tiny_llama_dir):
    """SparseGPT with ``quantize:`` leaves packed codes, as GPTQ of the same settings does: the run after its stage
    is forecast as GPTQ's (it had been forecast holding float weights and none of their mapped pages)."""
    skeleton = model_skeleton(tiny_llama_dir)
    cpu = torch.device("cpu")
    joint = stage_config("sparsegpt")(
        method="sparsegpt", pattern="2:4", quantize={"bits": 4, "group_size": 32}, ignore=["lm_head"]
    )
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32, ignore=["lm_head"])
    pruned_only = stage_config("sparsegpt")(method="sparsegpt", pattern="2:4", ignore=["lm_head"])

    def forecast(stage):
        formats = ["compressed-tensors"]
        return forecast_memory(skeleton, tiny_llama_dir, "float32", [stage], 4, 32, cpu, 64, formats).phases

    for phase in ("read-back", "runtime agreement", "candidate eval"):
        assert forecast(joint)[phase] == forecast(gptq)[phase], phase
    assert forecast(pruned_only)["read-back"]["candidate"] > forecast(joint)["read-back"]["candidate"]


def test_a_distill_stage_naming_its_teacher_forecasts_that_teacher(tiny_llama_dir, tmp_path):
    """``teacher:`` another model: the forecast holds that model's weights, not the model as loaded."""
    from tests.conftest import save_tiny_model

    larger = save_tiny_model(tmp_path / "larger", "llama", num_hidden_layers=4)
    skeleton = model_skeleton(tiny_llama_dir)
    distill = stage_config("distill")(method="distill", train_on="calibration", batch_size=4)
    cpu = torch.device("cpu")

    def training(**update) -> int:
        stages = [distill.model_copy(update=update)]
        return forecast_memory(skeleton, tiny_llama_dir, "float32", stages, 8, 32, cpu).phases["stages"]["training"]

    extra = ModelShape.of(model_skeleton(larger)).parameters - ModelShape.of(skeleton).parameters
    assert extra > 0
    assert training(teacher=str(larger)) == training() + 4 * extra
