"""R4's online rotation of a linear's input: the transform against scipy's Hadamard matrices, the rotated layer
as the same function, its place before calibration's recorders, its survival through quantization, and its
transform_config as compressed-tensors' own transform code applies it."""

import copy

import pytest
import torch
from scipy.linalg import hadamard
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.online_rotation import (
    attach_input_rotation,
    attach_transform_config,
    blockwise_hadamard,
    check_sylvester,
    input_rotation_of,
    keep_rotation_first,
    rotate_weight_input,
    transform_config,
    transform_tensors,
)
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn


def block_matrix(n: int, block: int) -> torch.Tensor:
    """blockdiag(H_b / sqrt(b), ...) from scipy's Sylvester construction (an independent reference)."""
    h = torch.tensor(hadamard(block), dtype=torch.float64) / block**0.5
    return torch.block_diag(*[h] * (n // block))


@pytest.mark.parametrize("n,block", [(96, 32), (192, 64), (12, 2), (256, 256)])
def test_blockwise_hadamard_is_x_times_the_block_diagonal_matrix(n, block):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    torch.testing.assert_close(blockwise_hadamard(x, block), x @ block_matrix(n, block), rtol=0, atol=1e-12)


def test_a_half_input_is_turned_in_float32_and_returned_in_its_dtype():
    x = torch.randn(4, 64).bfloat16()
    out = blockwise_hadamard(x, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (x.double() @ block_matrix(64, 16)).float().bfloat16().float())


def rotated_linear(seed: int = 0, block: int = 32) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(96, 40)
    rotated = copy.deepcopy(plain)
    with torch.no_grad():
        rotated.weight.copy_(rotate_weight_input(rotated.weight, block))
    attach_input_rotation(rotated, block)
    return plain, rotated


def test_the_rotated_linear_computes_what_the_plain_one_does():
    plain, rotated = rotated_linear()
    x = torch.randn(7, 96)
    torch.testing.assert_close(rotated(x), plain(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rotated.weight, plain.weight)
    assert rotated.state_dict().keys() == plain.state_dict().keys()  # the rotation holds no tensors


def test_a_recorder_prepended_later_still_records_the_rotated_input():
    _, rotated = rotated_linear()
    seen = []
    rotated.register_forward_pre_hook(lambda m, args: seen.append(args[0]), prepend=True)
    keep_rotation_first(rotated)
    x = torch.randn(2, 96)
    rotated(x)
    torch.testing.assert_close(seen[0], (x.double() @ block_matrix(96, 32)).float())


def test_a_quantized_layer_put_in_its_place_keeps_the_rotation():
    _, rotated = rotated_linear()
    model = nn.Sequential(rotated)
    qweight = quantize_weight_rtn(rotated.weight.detach(), QuantScheme(8, 32, True))
    packed = apply_quantized_weight(model, "0", qweight)
    assert input_rotation_of(packed).block == 32
    x = torch.randn(3, 96)
    expected = blockwise_hadamard(x, 32) @ packed.dequantized_weight(torch.float32).T + rotated.bias
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_blocks_that_are_not_powers_of_two_or_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        attach_input_rotation(nn.Linear(96, 8), 12)
    with pytest.raises(ValueError, match="do not divide 96 channels .* 32"):
        attach_input_rotation(nn.Linear(96, 8), 64)


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def r4(model: nn.Module, block: int) -> None:
    for layer in model.model.layers:
        down = layer.mlp.down_proj
        with torch.no_grad():
            down.weight.copy_(rotate_weight_input(down.weight, block))
        attach_input_rotation(down, block)


def test_compressed_tensors_applies_our_transform_config_as_the_same_rotation():
    """compressed-tensors' own transform code, given the transform_config lmpress writes, fuses the same weights
    and runs the same function."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    ours, theirs = tiny_llama(), tiny_llama()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = ours(ids).logits
    r4(ours, 32)
    config = transform_config(ours)
    apply_transform_config(theirs, TransformConfig.model_validate(config))
    for mine, other in zip(ours.model.layers, theirs.model.layers, strict=True):
        torch.testing.assert_close(mine.mlp.down_proj.weight, other.mlp.down_proj.weight, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(ids).logits, before, rtol=1e-5, atol=1e-5)
    tensors = transform_tensors(ours, torch.bfloat16)
    assert sorted(tensors) == [f"model.layers.{i}.mlp.down_proj.R4_input.weight" for i in range(2)]
    assert torch.equal(tensors["model.layers.0.mlp.down_proj.R4_input.weight"].double(), torch.tensor(hadamard(32.0)))


def test_a_transform_config_attaches_the_rotations_it_names():
    source = tiny_llama()
    r4(source, 32)
    loaded = tiny_llama()
    keys = attach_transform_config(loaded, transform_config(source), "ckpt")
    assert keys == set(transform_tensors(source, torch.float32))
    assert [input_rotation_of(layer.mlp.down_proj).block for layer in loaded.model.layers] == [32, 32]
    assert input_rotation_of(loaded.model.layers[0].mlp.up_proj) is None


@pytest.mark.parametrize(
    "scheme,message",
    [
        ({"type": "random-hadamard", "head_dim": 32}, "type 'random-hadamard'"),
        ({"type": "hadamard", "head_dim": 32, "randomize": True}, "randomized"),
        ({"type": "hadamard", "head_dim": None}, "head_dim None"),
        ({"type": "hadamard", "head_dim": 32, "location": "output"}, "location 'output'"),
        ({"type": "hadamard", "head_dim": 32, "targets": ["re:.*nothing$"]}, "match no module"),
        ({"type": "hadamard", "head_dim": 64}, "do not divide 96"),
    ],
)
def test_transforms_lmpress_cannot_run_are_refused_in_one_line(scheme, message):
    scheme = dict(scheme)
    args = {"targets": scheme.pop("targets", ["re:.*down_proj$"]), "location": scheme.pop("location", "input")}
    config = {"config_groups": {"R4": {**scheme, "apply": [args]}}}
    with pytest.raises(LmpressInputError, match=message) as error:
        attach_transform_config(tiny_llama(), config, "ckpt")
    assert "\n" not in str(error.value)


def test_a_stored_matrix_that_is_not_sylvesters_is_refused():
    check_sylvester("k", torch.tensor(hadamard(16), dtype=torch.bfloat16), "ckpt")
    with pytest.raises(LmpressInputError, match="not the \\+-1 Sylvester"):
        check_sylvester("k", torch.tensor(hadamard(16)).flip(0).float(), "ckpt")
    with pytest.raises(LmpressInputError, match="shape \\(12, 12\\)"):
        check_sylvester("k", torch.ones(12, 12), "ckpt")
