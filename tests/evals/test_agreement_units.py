"""The agreement check's unit for lmpress's runtime follows the activations the runtime was built with."""

from __future__ import annotations

import pytest

import lmpress
from lmpress.evals.agreement import BFLOAT16_UNIT, INT8_ACTIVATION_UNIT, execution_unit
from lmpress.runtime.kernels import cpu_int
from lmpress.runtime.kernels.cpu_int import W4A8Linear
from lmpress.runtime.model import Transformer
from tests.runtime.conftest import tiny_hf_model


@pytest.mark.parametrize(("activations", "unit"), [("int8", INT8_ACTIVATION_UNIT), ("bf16", BFLOAT16_UNIT)])
def test_runtime_unit_is_that_of_the_kernels_the_runtime_builds(activations, unit):
    if not cpu_int.available():
        pytest.skip("lmpress's C++ kernels do not build here")
    hf = tiny_hf_model("llama", seed=2)
    lmpress.quantize_model(hf, method="rtn", bits=4, group_size=64)
    runtime = Transformer.from_hf(hf, cpu_activations=activations)
    int8_kernels = any(isinstance(m, W4A8Linear) for m in runtime.modules())
    assert int8_kernels == (activations == "int8")
    assert execution_unit(hf, runtime=True, cpu_activations=activations) == unit
    assert execution_unit(hf, runtime=False, cpu_activations=activations) < BFLOAT16_UNIT  # the evaluator: float32
