"""The runtime's FP8 W8A8 layers (lmpress/runtime/kernels/fp8.py) against the layer they are built from."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("bias", [False, True])
def test_simulated_fp8_layer_computes_what_the_fp8_layer_does(strategy, bias):
    from lmpress.runtime.kernels.fp8 import Fp8SimulatedLinear
    from lmpress.weights.float8 import Fp8Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 40, bias=bias)
    layer = Fp8Linear.from_linear(dense, strategy)
    simulated = Fp8SimulatedLinear(layer)
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(simulated(x), layer(x), rtol=0, atol=0)
    assert simulated.state_dict().keys() == layer.state_dict().keys()
    assert simulated.weight.data_ptr() == layer.weight.data_ptr()  # the codes shared, not copied
    simulated.to(torch.bfloat16)  # the runtime's dtype: the E4M3 codes and their float32 values stay as they are
    assert simulated.weight.dtype == layer.weight.dtype and simulated.values.dtype == torch.float32
