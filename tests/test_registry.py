"""Registries: names map to modules imported on first use, so listing them imports no method."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmpress.registry import (
    EVAL_CONFIGS,
    EVAL_HANDLERS,
    EVAL_MODULES,
    FORMAT_MODULES,
    FORMATS,
    STAGE_CONFIGS,
    STAGE_HANDLERS,
    STAGE_MODULES,
    ExportFormat,
    eval_config,
    export_format,
    exporter,
    readable_methods,
    reading_format,
    register_format,
    register_stage,
    stage_config,
)


def _imported_after(code: str) -> set[str]:
    """The lmpress/torch modules a fresh interpreter holds after running ``code``."""
    probe = (
        f"import sys\n{code}\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('lmpress', 'torch', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_help_imports_no_torch_and_no_method():
    modules = _imported_after("from lmpress.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in modules
    assert not modules & (set(STAGE_MODULES.values()) | set(FORMAT_MODULES.values()))


def test_unknown_method_lists_every_method_without_importing_one():
    code = (
        "from lmpress.recipe import parse_recipe\n"
        "from lmpress.errors import LmpressInputError\n"
        "try:\n    parse_recipe({'model': 'x', 'stages': [{'method': 'sparsgpt'}]})\n"
        "except LmpressInputError as e:\n    print(e)\n"
    )
    probe = code + "import sys\nprint('MODULES', *[m for m in sys.modules if m.startswith('lmpress.')])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    message, modules = out.split("MODULES")
    assert "did you mean 'sparsegpt'" in message
    for name in STAGE_MODULES:
        assert name in message
    assert not set(modules.split()) & set(STAGE_MODULES.values())


def test_a_recipe_imports_only_the_methods_it_names():
    modules = _imported_after(
        "from lmpress.recipe import parse_recipe\nparse_recipe({'model': 'x', 'stages': [{'method': 'gptq'}]})"
    )
    assert "lmpress.quantize.gptq" in modules
    assert not modules & {"lmpress.quantize.awq", "lmpress.prune.sparsegpt", "lmpress.prune.wanda"}


@pytest.mark.parametrize("name", sorted(STAGE_MODULES))
def test_every_stage_name_resolves_to_its_module(name):
    config = stage_config(name)
    assert STAGE_CONFIGS[name] is config
    assert STAGE_HANDLERS[config].__module__ == STAGE_MODULES[name]  # one registration gave both
    if config.calibrates_layerwise:  # the memory forecast reads it
        assert "batch_size" in config.model_fields


def test_every_eval_format_and_reader_name_resolves():
    for name in EVAL_MODULES:
        assert eval_config(name) is EVAL_CONFIGS[name]
        assert EVAL_HANDLERS[EVAL_CONFIGS[name]].__module__ == EVAL_MODULES[name]
    for fmt in FORMAT_MODULES:
        assert export_format(fmt) is FORMATS[fmt]
        assert exporter(fmt).__module__ == FORMAT_MODULES[fmt]
    assert readable_methods() == ["awq", "compressed-tensors", "gptq"]
    assert reading_format("bitsandbytes") is None and reading_format("no-such-format") is None
    assert export_format("gguf").artifact_file == "model.gguf"
    with pytest.raises(KeyError):
        stage_config("no-such-method")
    with pytest.raises(KeyError):
        export_format("no-such-format")


def test_a_name_registered_twice_is_refused():
    with pytest.raises(RuntimeError, match="export format 'gguf' is registered twice"):
        register_format(ExportFormat(name="gguf", write=lambda model, tokenizer, out: None))
    with pytest.raises(RuntimeError, match="stage method 'rtn' is registered twice"):
        register_stage("rtn", type("OtherRTN", (), {}))(lambda model, config, ctx: {})


def test_methods_do_not_import_each_other():
    modules = _imported_after("import lmpress.quantize.awq, lmpress.prune.sparsegpt, lmpress.prune.wanda")
    assert "lmpress.quantize.gptq" not in modules
    assert "lmpress.quantize.gptq_quantize" not in modules
