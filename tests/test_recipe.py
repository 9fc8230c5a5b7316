from pathlib import Path

import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.quantize.rtn import RTNConfig
from lmpress.recipe import apply_override, load_recipe, parse_recipe

BASE = {
    "model": "some/model",
    "stages": [{"method": "rtn", "bits": 4, "group_size": 64}],
    "eval": {"perplexity": {"seq_len": 256, "windows": 2}},
    "gates": ["ppl_ratio <= 1.05"],
}


def error_of(raw) -> str:
    with pytest.raises(LmpressInputError) as info:
        parse_recipe(raw, origin="r.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_valid_recipe_has_typed_stages_evals_and_gates():
    recipe = parse_recipe(BASE)
    assert recipe.model.source == "some/model" and recipe.model.dtype == "float32"
    assert isinstance(recipe.stages[0], RTNConfig) and recipe.stages[0].group_size == 64
    assert recipe.stages[0].ignore == ["lm_head"]
    assert recipe.eval.evals["perplexity"].seq_len == 256
    assert str(recipe.gates[0]) == "ppl_ratio <= 1.05"
    assert recipe.as_dict()["stages"][0]["bits"] == 4


def test_bits_5_names_the_path_and_the_choices():
    raw = {**BASE, "stages": [{"method": "rtn"}, {"method": "rtn", "bits": 5}]}
    assert error_of(raw) == "r.yaml: stages[1].bits: 5 is not one of 2, 3, 4, 8"


def test_unknown_key_is_an_error_with_a_suggestion():
    message = error_of({**BASE, "stages": [{"method": "rtn", "bitz": 4}]})
    assert message.startswith("r.yaml: stages[0].bitz: unknown key (did you mean 'bits'?)")
    assert "group_size" in message
    assert "data.sampels" in error_of({**BASE, "data": {"sampels": 3}})
    assert error_of({**BASE, "extra_section": 1}).startswith("r.yaml: extra_section: unknown key")


def test_unknown_method_lists_known_methods():
    message = error_of({**BASE, "stages": [{"method": "gptx"}]})
    assert "stages[0].method: unknown method 'gptx'" in message and "rtn" in message


def test_unknown_eval_and_bad_gate_metric():
    assert "eval.perplexitty: unknown eval (did you mean 'perplexity'?)" in error_of(
        {**BASE, "eval": {"perplexitty": {}}}
    )
    message = error_of({**BASE, "gates": ["kld_mean <= 0.1"]})
    assert "gates[0]: metric 'kld_mean' is not computed" in message and "ppl_ratio" in message
    assert "is not a gate" in error_of({**BASE, "gates": ["ppl is small"]})


def test_impossible_values():
    assert "data.samples" in error_of({**BASE, "data": {"samples": 0}})
    assert "eval.perplexity: stride 16 is longer" in error_of(
        {**BASE, "eval": {"perplexity": {"seq_len": 8, "stride": 16}}}
    )
    assert "export.formats" in error_of({**BASE, "export": {"formats": ["tflite"]}})
    assert "ignore" in error_of({**BASE, "stages": [{"method": "rtn", "ignore": ["("]}]})


def test_malformed_yaml_says_where(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\nstages:\n  - method: rtn\n   bits: 4\n")
    with pytest.raises(LmpressInputError, match=r"bad.yaml: malformed YAML at line 4"):
        load_recipe(path)
    with pytest.raises(LmpressInputError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_a_key_given_twice_is_an_error_not_a_silent_override(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("model: {source: a}\nstages:\n  - {method: rtn, bits: 4, bits: 8}\n")
    with pytest.raises(LmpressInputError, match=r"malformed YAML at line 3, column 28: key .bits. appears twice"):
        load_recipe(path)
    path.write_text("model: {source: a}\nstages:\n  - &w4 {method: rtn, bits: 4}\n  - {<<: *w4, bits: 8}\n")
    assert [stage.bits for stage in load_recipe(path).stages] == [4, 8]  # a merge key's values may be overridden


def test_set_overrides(tmp_path):
    raw = {"model": "a/b", "stages": [{"method": "rtn", "bits": 4}]}
    assert apply_override(raw, "stages[0].bits=8")["stages"][0]["bits"] == 8
    assert apply_override(raw, "stages.0.symmetric=false")["stages"][0]["symmetric"] is False
    assert apply_override(raw, "data.seed=3")["data"] == {"seed": 3}
    with pytest.raises(LmpressInputError, match="does not exist"):
        apply_override(raw, "stages[3].bits=8")
    with pytest.raises(LmpressInputError, match="expected key.path=value"):
        apply_override(raw, "nonsense")
    path = tmp_path / "r.yaml"
    path.write_text("model: a/b\nstages: [{method: rtn}]\n")
    assert load_recipe(path, ["stages[0].group_size=-1"]).stages[0].group_size == -1
    # the short form `model: SOURCE` still takes a model key
    recipe = load_recipe(path, ["model.dtype=bfloat16"])
    assert recipe.model.source == "a/b" and recipe.model.dtype == "bfloat16"
    assert load_recipe(path, ["model=c/d"]).model.source == "c/d"


def test_set_with_malformed_yaml_value_names_the_override():
    raw = {"model": "a/b", "stages": [{"method": "rtn"}]}
    with pytest.raises(LmpressInputError, match=r"--set 'stages\[0\].bits=\[': the value '\[' is not valid YAML"):
        apply_override(raw, "stages[0].bits=[")
    with pytest.raises(LmpressInputError, match="expected key.path=value"):
        apply_override(raw, "...=3")


def test_method_that_is_not_a_name():
    message = error_of({**BASE, "stages": [{"method": ["rtn"]}]})
    assert message.startswith("r.yaml: stages[0].method: expected one method name, got ['rtn']")
    assert "rtn" in error_of({**BASE, "stages": [{"method": {"name": "rtn"}}]})


def test_binary_recipe_names_the_byte(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"model: a/b\n\x89PNG\x00\xff")
    with pytest.raises(LmpressInputError, match=r"r.yaml: not UTF-8 text \(byte 0x89 at offset 11\)"):
        load_recipe(path)
    with pytest.raises(LmpressInputError, match="is not a file"):
        load_recipe(tmp_path)


def test_model_device_defaults_to_cpu_and_is_set_by_set(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: a/b\nstages: [{method: gptq}]\n")
    assert load_recipe(path).model.device == "cpu"
    assert load_recipe(path, ["model.device=cuda"]).model.device == "cuda"
    assert load_recipe(path, ["model.device=auto"]).model.device == "auto"
    with pytest.raises(LmpressInputError, match=r"model.device: 'tpu' is not one of"):
        load_recipe(path, ["model.device=tpu"])


def test_compute_device_resolves_auto_and_refuses_cuda_without_a_gpu(monkeypatch):
    from lmpress.placement import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu", "model.device") == torch.device("cpu")
    assert resolve_device("auto", "model.device") == torch.device("cpu")
    with pytest.raises(LmpressInputError, match=r"^model.device: cuda, but no CUDA GPU .* set model.device: cpu"):
        resolve_device("cuda", "model.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto", "model.device") == torch.device("cuda", 0)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")), ids=str)
def test_every_shipped_recipe_loads_gates_and_never_calibrates_on_the_eval_text(path):
    recipe = load_recipe(path, ["model.device=cpu"])
    assert recipe.stages and recipe.gates, f"{path.name}: a shipped recipe runs stages and gates them"
    if recipe.data is not None and recipe.eval is not None and recipe.eval.text:
        assert "wiki.test" not in recipe.data.source, f"{path.name} calibrates on the eval text"


def test_a_spill_directory_needs_a_ram_budget_and_neither_enters_the_calibration_fingerprint():
    message = error_of({**BASE, "data": {"spill_dir": "/scratch"}})
    assert message.startswith("r.yaml: data") and "data.spill_dir needs data.activations_ram_gb" in message
    spilled = parse_recipe({**BASE, "data": {"activations_ram_gb": 2, "spill_dir": "/scratch"}}, "r.yaml").data
    assert spilled.calibration_settings() == parse_recipe(BASE, "r.yaml").data.calibration_settings()
