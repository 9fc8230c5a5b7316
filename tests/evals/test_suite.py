"""The baseline cache: keyed by everything that changes the numbers."""

from __future__ import annotations

import json

import pytest
import yaml

from lmpress.cli import main
from lmpress.evals.suite import baseline_identity

pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.mark.long
def test_a_bfloat16_run_does_not_reuse_the_float32_baseline(tiny_llama_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"source": str(tiny_llama_dir)},
                "stages": [{"method": "rtn", "bits": 8, "group_size": 32}],
                "eval": {"perplexity": {"seq_len": 128, "windows": 2, "kld": {}}},
            }
        )
    )
    ppl = {}
    for dtype in ("float32", "bfloat16", "float32"):
        out = tmp_path / f"run-{dtype}"
        assert (
            main(["run", str(recipe), "--out", str(out), "--quiet", "--overwrite", f"--set=model.dtype={dtype}"]) == 0
        )
        report = json.loads((out / "report.json").read_text())
        ppl.setdefault(dtype, []).append(report["baseline"]["metrics"]["ppl"])
    assert ppl["bfloat16"][0] != ppl["float32"][0]  # a reused float32 baseline would be equal to the digit
    assert ppl["float32"][0] == ppl["float32"][1]
    stores = list((tmp_path / "cache" / "baseline").iterdir())
    assert len(stores) == 2  # one per dtype; the second float32 run reused its own


def test_identity_names_dtype_device_kernels_and_versions(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    identity = baseline_identity("abc", model)
    assert identity["model"] == "abc" and identity["dtype"] == "torch.float32" and identity["device"] == "cpu"
    assert identity["torch"] == torch.__version__ and identity["attention"]
    assert baseline_identity("abc", model.to(torch.bfloat16))["dtype"] == "torch.bfloat16"
