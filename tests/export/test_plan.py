"""Export plans a format cannot hold are refused before the model is loaded, each (format, scheme) pair."""

from __future__ import annotations

import pytest
import yaml

from lmpress.cli import main
from lmpress.errors import LmpressInputError
from lmpress.export.formats import check_recipe_exports
from lmpress.recipe import parse_recipe

MISSING_MODEL = "/nonexistent/model-dir"

# (stage, format) -> the refusal's words, or None when the format holds the scheme.
GPTQ_ACT_ORDER = {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}
PAIRS = [
    (GPTQ_ACT_ORDER, "awq", "act-order (g_idx), which AWQ GEMM cannot hold"),
    (GPTQ_ACT_ORDER, "compressed-tensors", "act-order (g_idx), which compressed-tensors no longer stores"),
    (GPTQ_ACT_ORDER, "gptq", None),
    (GPTQ_ACT_ORDER, "hf", None),
    ({**GPTQ_ACT_ORDER, "static_groups": True}, "awq", None),
    ({**GPTQ_ACT_ORDER, "static_groups": True}, "compressed-tensors", None),
    ({**GPTQ_ACT_ORDER, "group_size": -1}, "compressed-tensors", None),  # one group: g_idx says nothing
    ({"method": "awq", "bits": 4, "group_size": 64, "rounding": "gptq", "act_order": True}, "awq", "act-order"),
    ({"method": "rtn", "bits": 2, "group_size": 32}, "awq", "2-bit weights; AWQ GEMM holds 4-bit weights only"),
    ({"method": "rtn", "bits": 3, "group_size": 32}, "awq", "3-bit weights; AWQ GEMM holds 4-bit weights only"),
    ({"method": "rtn", "bits": 8, "group_size": 32}, "awq", "8-bit weights; AWQ GEMM holds 4-bit weights only"),
    ({"method": "rtn", "bits": 4, "group_size": -1}, "awq", "per-channel scales (group_size -1)"),
    ({"method": "rtn", "bits": 4, "group_size": 32, "overrides": {".*down_proj": {"bits": 8}}}, "awq", "overrides"),
    *[({"method": "rtn", "bits": b, "group_size": 32}, f, None) for b in (2, 3, 4, 8) for f in ("gptq", "hf")],
    *[({"method": "rtn", "bits": b, "group_size": 32}, "compressed-tensors", None) for b in (2, 3, 4, 8)],
    *[({"method": "rtn", "bits": 4, "group_size": g}, f, None) for g in (-1, 32, 64, 128) for f in ("gptq", "hf")],
    *[({"method": "rtn", "bits": 4, "group_size": g}, "compressed-tensors", None) for g in (-1, 32, 64, 128)],
    *[({"method": "rtn", "bits": 4, "group_size": g}, "awq", None) for g in (32, 64, 128)],
]


def recipe_file(tmp_path, stage: dict, formats: list[str], model: str = MISSING_MODEL) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": model, "stages": [stage], "export": {"formats": formats}}))
    return str(path)


@pytest.mark.parametrize("stage,fmt,refusal", PAIRS, ids=lambda v: str(v) if not isinstance(v, dict) else None)
def test_each_scheme_and_format_pair(stage, fmt, refusal, tmp_path, capsys):
    formats = list(dict.fromkeys(["hf", fmt]))  # the refused format second: its index is part of the message
    recipe = parse_recipe({"model": MISSING_MODEL, "stages": [stage], "export": {"formats": formats}})
    if refusal is None:
        check_recipe_exports(recipe.stages, recipe.export.formats)
        return
    with pytest.raises(LmpressInputError, match=f"export.formats\\[1\\] {fmt}: stages\\[0\\]") as err:
        check_recipe_exports(recipe.stages, recipe.export.formats)
    assert refusal in str(err.value)
    # Through the CLI the refusal comes first: the model path does not even exist.
    out = tmp_path / "out"
    assert main(["run", recipe_file(tmp_path, stage, formats), "--out", str(out), "--quiet"]) == 2
    message = capsys.readouterr().err
    assert refusal in " ".join(message.split()) and "does not exist" not in message
    assert not out.exists()


def test_model_dependent_refusals_come_before_the_weights_load(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """A quantized lm_head in AWQ needs the module names, not the weights: checked on a skeleton."""
    import lmpress.pipeline

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded before the plan was checked")

    monkeypatch.setattr(lmpress.pipeline, "load_model", never)
    stage = {"method": "rtn", "bits": 4, "group_size": 32, "ignore": []}
    code = main(["run", recipe_file(tmp_path, stage, ["awq"], str(tiny_llama_dir)), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "lm_head is quantized, but AWQ quantizes decoder layers only" in capsys.readouterr().err
