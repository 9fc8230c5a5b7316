"""The support matrix: every architecture family x every calibrated method x every export format x the runtime.

Each cell is run on a tiny random model of the family (``tests/families.py``) and is either ``pass`` (it ran and
its result was checked against an independent reference) or ``refused`` (lmpress said no in one line before any
work: the model's weights unchanged, nothing written). Anything else fails the test. When every family's row has
run, the module writes the matrix into ``docs/architectures.md`` between its markers, so the page can only show
what this run measured.

What each cell checks:
- method: the stage runs through the layer-wise engine; every linear it targets (each expert's of an MoE) is
  quantized (or pruned to its sparsity) and the model's logits stay finite and near the float model's.
- export (lmpress): the artifact read back by ``lmpress.load_model`` holds the candidate's codes and scales and
  scores the candidate's perplexity on a window (``export.verify.check_export``, the pipeline's own check).
- export (consumer): compressed-tensors' own decompressor gives the candidate's weights; ONNX Runtime's logits
  match the candidate's; the GGUF file's tensors dequantized by the ``gguf`` package match the candidate's and
  llama.cpp's logits on the file match the candidate's (relative RMS 2e-2: llama.cpp rounds activations to Q8_0).
- runtime: lmpress's runtime logits on the GPTQ W4 model against transformers' on the same dequantized weights:
  the model's own layers (exact numerics, 1e-4) and the CPU kernels (relative RMS 2e-2), prefill and decode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmpress.errors import LmpressInputError
from tests.conftest import REPO, _train_tokenizer
from tests.families import FAMILIES, save_family_model

METHODS: dict[str, dict] = {
    "rtn": {"bits": 4, "group_size": 32},
    "gptq": {"bits": 4, "group_size": 32},
    "awq": {"bits": 4, "group_size": 32, "grid": 4, "clip_grid": 4},
    "smoothquant": {},
    "learned": {"bits": 4, "group_size": 32, "iterations": 4},
    "sparsegpt": {"sparsity": 0.5},
    "wanda": {"sparsity": 0.5},
}
# format -> the method (and settings) whose result it ships
FORMATS: dict[str, str] = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "gptq", "gguf": "rtn", "onnx": "gptq"}
DATA = {"samples": 4, "seq_len": 32}
DOC = REPO / "docs" / "architectures.md"
BEGIN, END = "<!-- matrix:begin (written by tests/test_architectures.py) -->", "<!-- matrix:end -->"

RESULTS: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def write_matrix():
    yield
    if set(RESULTS) == set(FAMILIES):
        write_doc(RESULTS)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def refusal(message: str) -> str:
    line = str(message).strip().splitlines()[0]
    assert "\n" not in str(message).strip(), message  # one line
    return f"refused: {line}"


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


def load(path: Path):
    from lmpress.loader import load_model

    return load_model(str(path), fingerprint=False)


def run_method(path: Path, method: str):
    """(cell, model or None): the method run on a fresh copy of the family's model, checked."""
    from lmpress.api import quantize_model
    from lmpress.weights.qlinear import QuantizedLinear

    loaded = load(path)
    model = loaded.model
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before_logits = model(ids).logits
    before = weights_of(model)
    try:
        summary = quantize_model(model, loaded.tokenizer, method, data=DATA, **METHODS[method])
    except LmpressInputError as e:
        assert unchanged(model, before), f"{method} refused after changing the model: {e}"
        return refusal(str(e)), None
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    # changed, not destroyed: W4 moves these random tiny models' logits by ~0.1-0.4 (relative RMS), 50% pruning ~0.3-0.9
    assert 0 < relative_rms(logits, before_logits) < (1.5 if method in ("sparsegpt", "wanda") else 0.6), method
    linears = {n: m for n, m in model.model.named_modules() if n.startswith("layers.") and hasattr(m, "in_features")}
    experts = [n for n in linears if ".experts." in n]
    if model.config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"):
        config = model.config
        moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)  # DeepSeek's dense first
        assert summary["moe_blocks_unfused"] == moe_layers
        n_experts = next(
            getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(config, k)
        )
        assert len(experts) == 3 * n_experts * moe_layers  # every expert calibrated
    if method in ("sparsegpt", "wanda"):
        for name, m in linears.items():
            if name.endswith(("gate", "shared_expert_gate")):
                continue
            zeros = (m.weight == 0).float().mean().item()
            assert zeros >= 0.49, (method, name, zeros)
    else:  # every linear of the decoder layers quantized (an MoE's one-output shared-expert gate may stay float)
        float_left = [n for n, m in linears.items() if not isinstance(m, QuantizedLinear)]
        assert all(n.endswith("shared_expert_gate") for n in float_left), (method, float_left)
    return "pass", loaded


def ct_consumer(out: Path, candidate) -> str:
    try:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        return "not installed"
    import json

    from safetensors.torch import load_file

    from lmpress.export.formats import quantized_layers

    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(file))
    layers = quantized_layers(candidate)
    for name, module in layers.items():
        groups = [g for g in qc.config_groups.values() if "Linear" in g.targets or name in g.targets]
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight_")}
        weight = PackedQuantizationCompressor.decompress(local, groups[0])["weight"]
        assert torch.equal(weight, module.dequantized_weight()), name
    return "pass"


def onnx_consumer(out: Path, candidate) -> str:
    pytest.importorskip("onnxruntime")
    from lmpress.export.onnx import FILE_NAME, onnx_session, run_decoder

    ids = np.random.default_rng(0).integers(0, 300, (1, 20)).astype(np.int64)
    logits, _ = run_decoder(onnx_session(out / FILE_NAME), ids)
    with torch.no_grad():
        want = candidate(torch.from_numpy(ids)).logits.float()
    assert relative_rms(torch.from_numpy(logits), want) < 1e-5
    return "pass"


def gguf_consumer(out: Path, candidate) -> str:
    """The GGUF file's tensors dequantized by the ``gguf`` package are the candidate's; llama.cpp (where installed)
    runs the file to the candidate's logits within its Q8_0 activation rounding."""
    import importlib.util

    import gguf
    from gguf.quants import dequantize

    from lmpress.export.formats import quantized_layers
    from lmpress.export.gguf import ARCHITECTURES, PERMUTED_ROPE, gguf_tensor_name

    arch = ARCHITECTURES[candidate.config.model_type]
    reader = gguf.GGUFReader(out / "model.gguf")
    tensors = {t.name: t for t in reader.tensors}
    for name, module in quantized_layers(candidate).items():
        t = tensors[f"{gguf_tensor_name(name, arch)}.weight"]
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(module.out_features, -1)
        want = module.dequantized_weight(torch.float32)
        if arch in PERMUTED_ROPE and name.endswith(("q_proj", "k_proj")):  # llama.cpp's rope order: rows as sets
            weight, want = weight.sort(0).values, want.sort(0).values
        torch.testing.assert_close(weight, want, atol=2e-3, rtol=1e-3)
    if importlib.util.find_spec("llama_cpp") is None:
        return "pass (gguf reader)"
    from tests.export.test_gguf_llama_cpp import llama_cpp_logits

    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = candidate(torch.tensor([ids])).logits[0].float()
    got = torch.from_numpy(llama_cpp_logits(out / "model.gguf", ids))
    assert relative_rms(got, want) < 0.02, relative_rms(got, want)  # Q8_0 activations: ~0.5-1% RMS
    return "pass (llama.cpp)"


CONSUMERS = {"compressed-tensors": ct_consumer, "onnx": onnx_consumer, "gguf": gguf_consumer}


def run_export(path: Path, fmt: str, tmp: Path, candidates: dict) -> tuple[str, str]:
    """(lmpress read-back cell, consumer cell) for ``fmt`` on the family at ``path``."""
    from lmpress.export.formats import check_export_plan
    from lmpress.export.verify import check_export, window_ppl
    from lmpress.loader import model_skeleton
    from lmpress.recipe import _validate
    from lmpress.registry import exporter, stage_config

    method = FORMATS[fmt]
    config = _validate(stage_config(method), {"method": method, **METHODS[method]}, "test", ())
    skeleton = model_skeleton(path)
    try:  # what the pipeline checks before any work (check_plan)
        check_export_plan(fmt, skeleton, config.targets(skeleton))
    except LmpressInputError as e:
        return refusal(str(e)), "refused"
    loaded = candidates.get(method)
    if loaded is None:
        return "refused: the method refused", "refused"
    out = tmp / fmt
    out.mkdir()
    try:
        exporter(fmt)(loaded.model, loaded.tokenizer, out)
    except LmpressInputError as e:  # refused at write time: must have written nothing
        assert not any(out.iterdir()), f"export {fmt} refused after writing: {e}"
        return refusal(str(e)), "refused"
    window = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(1))
    artifact = load(out)
    check = check_export(fmt, loaded.model, artifact.model, window, window_ppl(loaded.model, window))
    assert check.passed, check.as_dict()
    consumer = CONSUMERS.get(fmt)
    return "pass", consumer(out, loaded.model) if consumer else "no consumer installed"


def run_runtime(loaded) -> str:
    from lmpress.runtime.model import Transformer

    model = loaded.model
    try:
        runtimes = [(Transformer.from_hf(model, kernels=k), tol) for k, tol in (("reference", 1e-4), ("cpu", 2e-2))]
    except LmpressInputError as e:
        return refusal(str(e))
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        for runtime, tol in runtimes:
            whole = runtime(ids, runtime.new_cache(2, 64))
            cache = runtime.new_cache(2, 64)
            steps = torch.cat(
                [runtime(ids[:, :30], cache)] + [runtime(ids[:, i : i + 1], cache) for i in range(30, 40)], 1
            )
            assert relative_rms(whole, want) < tol, (runtime.kernels, relative_rms(whole, want))
            assert relative_rms(steps, want) < tol, (runtime.kernels, relative_rms(steps, want))
    return "pass"


@pytest.mark.slow  # about a minute a family on 2 idle cores (several on a shared machine): run with --runslow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_row(family, tokenizer, tmp_path):
    path = save_family_model(tmp_path / family, family, tokenizer)
    row: dict[str, str] = {}
    try:
        load(path)
    except LmpressInputError as e:  # the family itself: refused on loading, before any stage
        cell = refusal(str(e).replace(str(path), "MODEL_DIR"))
        assert family in cell
        RESULTS[family] = {"all": cell}
        return
    candidates = {}
    for method in METHODS:
        row[method], loaded = run_method(path, method)
        if loaded is not None:
            candidates[method] = loaded
    for fmt in FORMATS:
        row[f"{fmt} lmpress"], row[f"{fmt} consumer"] = run_export(path, fmt, tmp_path, candidates)
    row["runtime"] = run_runtime(candidates["gptq"]) if "gptq" in candidates else "refused: the method refused"
    RESULTS[family] = row


def short(cell: str) -> str:
    return "pass" if cell.startswith("pass") else "refused" if cell.startswith("refused") else cell


def table(results: dict[str, dict[str, str]], columns: list[str], header: list[str]) -> list[str]:
    lines = ["| family | " + " | ".join(header) + " |", "| --- |" + " --- |" * len(columns)]
    for family, row in results.items():
        cells = ["refused"] * len(columns) if "all" in row else [short(row[c]) for c in columns]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return lines


def write_doc(results: dict[str, dict[str, str]]) -> None:
    exports = [f"{f} {w}" for f in FORMATS for w in ("lmpress", "consumer")]
    reasons: dict[str, list[str]] = {}
    for family, row in results.items():
        for column, cell in row.items():
            if cell.startswith("refused: ") and cell != "refused: the method refused":
                where = family if column == "all" else f"{family} / {column}"
                reasons.setdefault(cell.removeprefix("refused: "), []).append(where)
    end_to_end = [
        f for f, row in results.items() if "all" not in row and all(row[m] == "pass" for m in METHODS)
        and row["runtime"] == "pass" and any(row[f"{f_} lmpress"] == "pass" for f_ in FORMATS)
    ]  # fmt: skip
    lines = ["Calibrated methods (tiny random model of each family, every linear of every layer and expert):", ""]
    lines += table(results, list(METHODS), list(METHODS))
    lines += ["", "Exports (read back by lmpress / loaded by the consumer) and the runtime's logits:", ""]
    lines += table(results, exports + ["runtime"], exports + ["runtime"])
    exported = [
        f for f, row in results.items() if "all" not in row and f not in end_to_end
        and all(row[m] == "pass" for m in METHODS) and any(row[f"{f_} lmpress"] == "pass" for f_ in FORMATS)
    ]  # fmt: skip
    lines += ["", f"End to end (every method, an export read back, runtime logits): {', '.join(end_to_end)}."]
    if exported:
        lines += ["", f"Every method and an export read back, the runtime refusing: {', '.join(exported)}."]
    lines += ["", "Each refusal, as lmpress prints it (one line, exit code 2, before any work):", ""]
    lines += [f"- {reason} ({'; '.join(where)})" for reason, where in reasons.items()]
    text = DOC.read_text() if DOC.exists() else f"# Architectures\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)
