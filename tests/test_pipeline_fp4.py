"""An FP4 recipe end to end through ``lmpress run`` on a tiny random Llama: rtn NVFP4 with the MSE scale search,
exported as compressed-tensors (nvfp4-pack-quantized) and hf, every export read back and checked, the runtime
checked against the evaluator, and the gates scoring the compressed-tensors export read back from disk."""

from __future__ import annotations

import json

import pytest
import yaml

from lmpress.cli import main
from lmpress.export.manifest import verify_manifest

pytestmark = pytest.mark.usefixtures("private_cache")


def test_rtn_nvfp4_recipe_exports_compressed_tensors_and_hf_and_gates_the_read_back(tiny_llama_dir, tmp_path):
    recipe = {
        "model": str(tiny_llama_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "rtn", "fp4": "nvfp4", "mse": True}],
        "export": {"formats": ["compressed-tensors", "hf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2}},
        "gates": ["ppl_ratio <= 1.2"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["measured_on"]["candidate"].startswith("compressed-tensors/")
    checks = {c["format"]: c for c in report["export_checks"]}
    assert checks["compressed-tensors"]["passed"] and checks["compressed-tensors"]["weights_match"]
    assert "NVFP4, scales as E4M3" in checks["compressed-tensors"]["weights"]
    assert checks["hf"]["passed"] and "dense, dequantized" in checks["hf"]["weights"]
    assert checks["hf"]["window_ppl"] == checks["compressed-tensors"]["window_ppl"]  # the same weights, in float
    agreement = report["runtime_agreement"]
    assert agreement["passed"] and agreement["top1_agreement"] == 1.0
    assert verify_manifest(out) == []
    config = json.loads((out / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    # quantized, not broken: NVFP4 moves a random model's perplexity a little (either way)
    ratio = report["candidate"]["metrics"]["ppl"] / report["baseline"]["metrics"]["ppl"]
    assert ratio != 1.0 and 0.9 < ratio < 1.2
