"""Online Hadamard rotation of a linear layer's input: QuaRot's R4 (Ashkboos et al. 2024, arXiv:2404.00456,
section 4; SpinQuant's R4), the rotation 4-bit activations need before ``down_proj``; with the rotate stage's
``input_block``, the same rotation in FP4-sized blocks on every decoder linear's input (the block rotations of
Egiazarian et al. 2025, arXiv:2509.23202, "MR-GPTQ").

``down_proj``'s input is ``act(gate) * up``, a product no weight can absorb a rotation through, so the rotation
is split: the input is turned at run time, ``x -> x V``, and its inverse is fused into the weight, ``W -> W V``
(``V`` orthogonal and symmetric, so ``(x V)(W V)^T = x V V^T W^T = x W^T``). ``V`` is block-diagonal: a
Sylvester Hadamard matrix of a power-of-two order ``b`` divided by ``sqrt(b)`` on each block of ``b`` input
channels (``blockwise_hadamard``: ``log2 b`` butterfly stages, no matmul). The activation outliers of one channel
are spread over its block, so the per-block activation scales of FP4 see no outlier.

The rotation lives on the linear as compressed-tensors keeps it (its ``transform`` factory): a submodule
``R4_input`` (no tensors in lmpress's model) and a forward pre-hook that runs before every other pre-hook, so
calibration records, and activation quantization sees, the input the weight multiplies. A quantized layer put in
the linear's place keeps it (``carry_input_rotation``). The compressed-tensors export writes the
``transform_config`` vLLM reads (type ``hadamard``, ``head_dim`` = the block, online ``input`` and fused
``weight_input``) and each layer's ``R4_input.weight``, the unnormalized +-1 matrix vLLM loads and divides by
``sqrt(b)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.registry import register_export_check
from lmpress.weights.hadamard import hadamard_matrix, hadamard_transform

TRANSFORM = "R4"  # the transform's name in compressed-tensors' transform_config (llm-compressor's SpinQuant name)
INPUT_ROTATION = f"{TRANSFORM}_input"  # its submodule on the linear: compressed-tensors' f"{name}_{location}"
# Formats that hold a rotated input: compressed-tensors names it (transform_config); hf writes the weight unrotated.
ROTATION_FORMATS = ("compressed-tensors", "hf")


def largest_power_of_two_block(n: int) -> int:
    """The largest power of two dividing ``n`` (the default block of ``n`` channels)."""
    return n & -n


def block_refusal(n: int, block: int) -> str | None:
    """Why blocks of ``block`` cannot rotate ``n`` channels, or None."""
    if block < 2 or block & (block - 1):
        return f"a Hadamard block is a power of two of at least 2, not {block}"
    if n % block:
        return f"blocks of {block} do not divide {n} channels (the largest power of two that does: {n & -n})"
    return None


def blockwise_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x V`` over the last dimension: each block of ``block`` entries times ``H_block / sqrt(block)``, computed
    in float32 at least and returned in ``x``'s dtype."""
    dtype = x.dtype
    work = x if dtype in (torch.float32, torch.float64) else x.float()
    lead, n = work.shape[:-1], work.shape[-1]
    turned = hadamard_transform(work.reshape(*lead, n // block, block), block)
    return turned.reshape(*lead, n).to(dtype)


class InputRotation(nn.Module):
    """``x -> x V`` (``blockwise_hadamard``), the online half of R4; holds no tensors."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blockwise_hadamard(x, self.block)

    def extra_repr(self) -> str:
        return f"block={self.block}"


def _rotate_input(module: nn.Module, args: tuple) -> tuple:
    return (getattr(module, INPUT_ROTATION)(args[0]), *args[1:])


def input_rotation_of(module: nn.Module) -> InputRotation | None:
    rotation = getattr(module, INPUT_ROTATION, None)
    return rotation if isinstance(rotation, InputRotation) else None


def attach_input_rotation(linear: nn.Module, block: int) -> None:
    """Turn ``linear``'s input by ``V`` at every call, before its other pre-hooks (its weight is not touched)."""
    if input_rotation_of(linear) is not None:
        raise ValueError(f"{type(linear).__name__} already rotates its input")
    refusal = block_refusal(int(linear.in_features), block)
    if refusal:
        raise ValueError(refusal)
    linear.register_module(INPUT_ROTATION, InputRotation(block))
    linear.register_forward_pre_hook(_rotate_input, prepend=True)


def keep_rotation_first(module: nn.Module) -> None:
    """Move the input rotation's pre-hook back in front of pre-hooks prepended after it (a recorder of the
    linear's input must record the rotated input)."""
    hooks = module._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if hook is _rotate_input:
            hooks.move_to_end(key, last=False)


def carry_input_rotation(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (a module put in ``old``'s place) ``old``'s input rotation, if any."""
    rotation = input_rotation_of(old)
    if rotation is not None and input_rotation_of(new) is None:
        attach_input_rotation(new, rotation.block)


def rotate_weight_input(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``W V``: the fused half of R4. ``V`` is its own inverse (symmetric and orthogonal), so the same call turns
    a rotated weight back (``W V V = W``)."""
    return blockwise_hadamard(weight, block)


def rotated_inputs(model: nn.Module) -> Iterator[tuple[str, int]]:
    """(module name, block) of every module of ``model`` that rotates its input."""
    for name, module in model.named_modules():
        rotation = input_rotation_of(module)
        if rotation is not None:
            yield name, rotation.block


@register_export_check
def refuse_unheld_rotations(model: nn.Module, fmt: str) -> None:
    """LmpressInputError when ``model`` rotates a layer's input and format ``fmt`` cannot say so."""
    if fmt in ROTATION_FORMATS:
        return
    name = next((name for name, _ in rotated_inputs(model)), None)
    if name is not None:
        raise LmpressInputError(
            f"export {fmt}: {name} rotates its input at run time (rotate: rotate_down_proj), which {fmt} cannot "
            f"express; export {' or '.join(ROTATION_FORMATS)}, or rotate without rotate_down_proj"
        )


# compressed-tensors' transform_config ---------------------------------------------------------------


def transform_config(model: nn.Module) -> dict[str, Any] | None:
    """compressed-tensors' ``transform_config`` of ``model``'s input rotations (one scheme per block size), or
    None when it has none."""
    by_block: dict[int, list[str]] = {}
    for name, block in rotated_inputs(model):
        by_block.setdefault(block, []).append(name)
    if not by_block:
        return None
    groups = {}
    for i, (block, names) in enumerate(sorted(by_block.items())):
        groups[TRANSFORM if i == 0 else f"{TRANSFORM}_{i}"] = {
            "type": "hadamard",
            "apply": [
                {"targets": names, "location": "input", "inverse": False, "ignore": []},
                {"targets": names, "location": "weight_input", "inverse": True, "ignore": []},
            ],
            "randomize": False,
            "requires_grad": False,
            "head_dim": block,
            "precision": "torch.float32",
        }
    return {"config_groups": groups}


def describe_transform_config(config: dict[str, Any] | None) -> str | None:
    """One line for ``lmpress inspect``: which inputs a checkpoint's transform_config turns at run time."""
    parts = []
    for scheme_name, scheme in ((config or {}).get("config_groups") or {}).items():
        online = [a for a in scheme.get("apply") or [] if a.get("location") != "weight_input"]
        targets = [t for a in online for t in a.get("targets") or []]
        kinds = sorted({t.rpartition(".")[2] for t in targets})
        parts.append(
            f"{scheme_name}: {scheme.get('type')} blocks of {scheme.get('head_dim')} on the input of "
            f"{len(targets)} layer(s) ({', '.join(kinds)})"
        )
    return "; ".join(parts) or None


def transform_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each rotated layer's ``<layer>.<scheme>_input.weight``: the unnormalized +-1 Sylvester matrix of its block,
    as vLLM loads it."""
    config = transform_config(model) or {"config_groups": {}}
    tensors = {}
    for scheme_name, scheme in config["config_groups"].items():
        matrix = sylvester_signs(scheme["head_dim"]).to(dtype)
        for name in scheme["apply"][0]["targets"]:
            tensors[f"{name}.{scheme_name}_input.weight"] = matrix.clone()  # safetensors stores no shared storage
    return tensors


def sylvester_signs(block: int) -> torch.Tensor:
    """The unnormalized +-1 Sylvester Hadamard matrix of power-of-two order ``block`` (float64), as a
    transform_config's stored ``<scheme>_input.weight`` holds it."""
    return (hadamard_matrix(block) * block**0.5).round()


def _matches(name: str, kind: str, target: str) -> bool:
    """compressed-tensors' target rule: ``re:`` a regular expression over the module name, else the name or the
    module's class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, kind)


def rotation_plan(
    config: dict[str, Any] | None, modules: Iterable[tuple[str, str]], where: str
) -> dict[str, tuple[str, int]]:
    """``{module name: (scheme name, block)}`` of the online input rotations a checkpoint's ``transform_config``
    names among ``modules`` (``(name, class name)`` pairs); its fused ``weight_input`` halves are already in the
    weights. LmpressInputError for a transform lmpress cannot run (``where`` names the checkpoint)."""
    modules = list(modules)
    plan: dict[str, tuple[str, int]] = {}
    for scheme_name, scheme in ((config or {}).get("config_groups") or {}).items():
        kind, block = scheme.get("type"), scheme.get("head_dim")
        if kind != "hadamard" or scheme.get("randomize") or not isinstance(block, int):
            raise LmpressInputError(
                f"{where}: transform_config {scheme_name}: type {kind!r}"
                f"{' randomized' if scheme.get('randomize') else ''} with head_dim {block!r}; lmpress runs "
                "deterministic hadamard transforms in power-of-two blocks (head_dim set)"
            )
        for args in scheme.get("apply") or []:
            location = args.get("location")
            if location == "weight_input":
                continue
            if location != "input":
                raise LmpressInputError(
                    f"{where}: transform_config {scheme_name}: location {location!r}; lmpress runs input rotations "
                    "(weight_input fused into the weights)"
                )
            targets, ignore = list(args.get("targets") or []), list(args.get("ignore") or [])
            found = [
                name
                for name, cls in modules
                if any(_matches(name, cls, t) for t in targets) and not any(_matches(name, cls, t) for t in ignore)
            ]
            if not found:
                raise LmpressInputError(f"{where}: transform_config {scheme_name}: {targets} match no module")
            plan.update({name: (scheme_name, block) for name in found})
    return plan


def attach_planned_rotation(module: nn.Module, name: str, plan: dict[str, tuple[str, int]], where: str) -> str | None:
    """Attach the rotation ``plan`` names for module ``name``; returns the key of its transform tensor, or None."""
    if name not in plan:
        return None
    scheme_name, block = plan[name]
    try:
        attach_input_rotation(module, block)
    except (ValueError, AttributeError) as e:
        raise LmpressInputError(f"{where}: transform_config {scheme_name} on {name}: {e}") from e
    return f"{name}.{scheme_name}_input.weight"


def attach_transform_config(model: nn.Module, config: dict[str, Any] | None, where: str) -> set[str]:
    """Attach the online input rotations ``config`` (a checkpoint's ``transform_config``) names to ``model``'s
    modules; returns the keys of the transform tensors the checkpoint holds for them."""
    modules = dict(model.named_modules())
    plan = rotation_plan(config, ((n, type(m).__name__) for n, m in modules.items()), where)
    return {attach_planned_rotation(modules[name], name, plan, where) for name in plan}


def check_sylvester(key: str, matrix: torch.Tensor, where: str) -> None:
    """LmpressInputError unless ``matrix`` is the unnormalized Sylvester Hadamard matrix its transform runs."""
    block = matrix.shape[0] if matrix.dim() == 2 else 0
    expected = sylvester_signs(block) if block and not block & (block - 1) else None
    if expected is None or matrix.shape != expected.shape or not torch.equal(matrix.double(), expected):
        raise LmpressInputError(
            f"{where}: {key} (shape {tuple(matrix.shape)}) is not the +-1 Sylvester Hadamard matrix its "
            "transform_config names"
        )
