"""A calibration pass's resumable state: finished layers and the next layer's inputs.

After each layer the engine writes what its methods made of the layer, whatever
kind of change each declared (quantized weights, as packed codes; every other
parameter and buffer, which holds rewritten and pruned float weights and folded
scales) and the next layer's inputs to the stage's state directory
(safetensors, each file written atomically, ``progress.json`` last), so an
interrupted run resumes from the last finished layer and ends bit-identical. The
state carries a fingerprint of the model, calibration data and stage config; a
resume against a different one is refused.

A finished layer's ``QuantizedLinear`` and ``Fp4Linear`` buffers (packed codes, scales, zero points;
FP4's block and global scales) are then read from its state file as a private file mapping
(:meth:`LayerState.map_layer`): they leave RAM, and a later reader (an export, an eval) faults them in
from the file, so a whole model's packed weights do not pile up in the process while its layers stream.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmpress.calib.activations import LayerInputs
from lmpress.checkpoint_files import MappedSafetensors
from lmpress.errors import LmpressInputError
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.float8 import Fp8Weight
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight
from lmpress.weights.pack import ct_unpack_weight
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

if TYPE_CHECKING:
    from lmpress.calib.session import LayerSession

# 2: quantized linears as QuantizedLinear's packed buffers ("k." keys), mapped back; 3: the fingerprint no longer
# holds the number of processes (a pass resumes with another number: calib.resume)
STATE_VERSION = 3
PACKED = (QuantizedLinear, Fp4Linear)  # saved as their own buffers and mapped back from the state file


class LayerState:
    """Finished layers and the next layer's inputs in a stage's state directory (safetensors, atomic)."""

    def __init__(self, directory: Path, fingerprint: str, processes: int = 1) -> None:
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.processes = processes  # launched processes sharing the calibration (each saves its share's inputs)
        self.progress_path = self.dir / "progress.json"

    def progress(self) -> dict | None:
        """What ``progress.json`` says (None when there is no state); refuses a foreign state."""
        if not self.progress_path.exists():
            return None
        progress = json.loads(self.progress_path.read_text())
        if progress.get("version") != STATE_VERSION:
            raise LmpressInputError(
                f"cannot resume from {self.dir}: it was written by another lmpress version (state version "
                f"{progress.get('version')}, this one reads {STATE_VERSION}); run without --resume to start over"
            )
        if progress.get("fingerprint") != self.fingerprint:
            raise LmpressInputError(
                f"cannot resume from {self.dir}: it was written for a different model, calibration data "
                "or stage config (fingerprint mismatch); run without --resume to start over"
            )
        return progress

    def done_layers(self) -> int:
        """How many layers a previous run finished (0 when there is no state); refuses a foreign state, and one
        saved by another number of processes (``calib.resume`` reads those from every process's state)."""
        progress = self.progress()
        if progress is None:
            return 0
        if progress.get("processes", 1) != self.processes:
            raise LmpressInputError(
                f"cannot resume from {self.dir}: it was calibrated across {progress.get('processes', 1)} launched "
                f"process(es), and this run has {self.processes}; run without --resume to start over"
            )
        return int(progress["done_layers"])

    def seconds_spent(self) -> float:
        """The stage's seconds up to its last finished layer, over every run that wrote this state (0 if unknown)."""
        if not self.progress_path.exists():
            return 0.0
        return float(json.loads(self.progress_path.read_text()).get("seconds", 0.0))

    def clear(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():
            if p.is_file() and (p.suffix == ".safetensors" or p.name == "progress.json"):
                p.unlink()

    def save_layer(
        self,
        session: LayerSession,
        next_inputs: LayerInputs,
        carried: dict[str, torch.Tensor] | None = None,
        seconds: float = 0.0,
    ) -> None:
        """Write finished layer ``session.index``, the next layer's inputs and the methods' ``carried`` tensors;
        ``seconds``: the stage's time so far, over every run (a resumed run's report adds the earlier runs')."""
        tensors, meta = {}, {}
        for name, q in session.quantized.items():
            module = session.layer.get_submodule(name)
            if isinstance(module, PACKED):  # its own packed buffers, which map_layer points back at
                for buffer, value in module.named_buffers(recurse=False):
                    if value is not None:
                        tensors[f"k.{name}.{buffer}"] = value
            else:
                tensors[f"q.{name}.qweight"] = q.qweight
                tensors[f"q.{name}.scales"] = q.scales
                if not isinstance(q, Fp8Weight):  # an E4M3 weight has no zero point
                    tensors[f"q.{name}.zeros"] = q.zeros
                if q.g_idx is not None:
                    tensors[f"q.{name}.g_idx"] = q.g_idx
            scheme = q.scheme
            meta[name] = json.dumps(
                [scheme.bits, scheme.group_size, scheme.symmetric, scheme.activations, scheme.k_quant_scales]
                + ([scheme.fp4] if scheme.fp4 else [])
            )
        for name, bias in session.biases.items():
            tensors[f"b.{name}"] = bias
        owned = tuple(f"{n}." for n in session.quantized)
        for name, p in list(session.layer.named_parameters()) + list(session.layer.named_buffers()):
            if not name.startswith(owned):
                tensors[f"p.{name}"] = p.detach().cpu()
        self._write(f"layer_{session.index:05d}.safetensors", tensors, meta)
        inputs = {f"h.{i}": h.contiguous() for i, h in enumerate(next_inputs.hidden)}
        inputs.update({f"m.{name}": t.contiguous() for name, t in (carried or {}).items()})
        self._write(f"inputs_{session.index + 1:05d}.safetensors", inputs, {})
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "version": STATE_VERSION,
                    "fingerprint": self.fingerprint,
                    "done_layers": session.index + 1,
                    "processes": self.processes,
                    "seconds": round(seconds, 2),
                }
            )
        )
        os.replace(tmp, self.progress_path)
        # launched processes keep the inputs of their last two finished layers: one may have saved a layer more
        # than another when the launch stopped, and the resume starts every process at the other's
        stale = session.index - (self.processes > 1)
        (self.dir / f"inputs_{stale:05d}.safetensors").unlink(missing_ok=True)

    def _write(self, filename: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        path = self.dir / filename
        tmp = path.with_name(f".{filename}.tmp")
        save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)

    def restore_layer(self, index: int, layer: nn.Module) -> int:
        """Put finished layer ``index`` back into ``layer``; returns how many linears it quantized."""
        from safetensors import safe_open

        path = self.dir / f"layer_{index:05d}.safetensors"
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
        for key, value in tensors.items():
            kind, _, name = key.partition(".")
            if kind == "p":
                _set_tensor(layer, name, value)
            elif kind == "b":
                layer.get_submodule(name).bias.data.copy_(value)
        for name, scheme in meta.items():
            scheme = QuantScheme(*json.loads(scheme))
            if scheme.activations == "fp8":
                fp8 = Fp8Weight(tensors[f"q.{name}.qweight"], tensors[f"q.{name}.scales"], "channel")
                apply_quantized_weight(layer, name, fp8)
                continue
            if scheme.fp4 is not None:
                apply_quantized_weight(layer, name, _fp4_weight(tensors, name, layer.get_submodule(name), scheme))
                continue
            if f"k.{name}.qweight" in tensors:
                codes = ct_unpack_weight(
                    tensors[f"k.{name}.qweight"], scheme.bits, layer.get_submodule(name).in_features
                )
                qweight = QuantizedWeight(
                    qweight=codes,
                    scales=tensors[f"k.{name}.scales"],
                    zeros=tensors[f"k.{name}.zeros"].float(),
                    scheme=scheme,
                    g_idx=tensors.get(f"k.{name}.g_idx"),
                )
            else:
                qweight = QuantizedWeight(
                    qweight=tensors[f"q.{name}.qweight"],
                    scales=tensors[f"q.{name}.scales"],
                    zeros=tensors[f"q.{name}.zeros"],
                    scheme=scheme,
                    g_idx=tensors.get(f"q.{name}.g_idx"),
                )
            apply_quantized_weight(layer, name, qweight)
        del tensors
        self.map_layer(index, layer)
        return len(meta)

    def map_layer(self, index: int, layer: nn.Module) -> int:
        """Point finished layer ``index``'s ``QuantizedLinear`` and ``Fp4Linear`` buffers at their copies in its
        state file, read as a private file mapping (pages come from the file when read and can be dropped); returns
        how many it mapped. The in-memory buffers they replace are freed. The views are made without reading the
        file (safetensors' own reader touches the pages around each tensor it opens: a MoE layer's hundreds of
        small buffers came out resident, the whole file, layer after layer)."""
        mapped = 0
        state = MappedSafetensors([self.dir / f"layer_{index:05d}.safetensors"])
        for key in state.keys():
            if not key.startswith("k."):
                continue
            name, _, buffer = key.removeprefix("k.").rpartition(".")
            module = layer.get_submodule(name)
            current = module._buffers.get(buffer) if isinstance(module, PACKED) else None
            if current is None or current.device.type != "cpu" or not state.readable(key):
                continue
            value = state.tensor(key)
            if value.shape != current.shape or value.dtype != current.dtype:
                continue
            module._buffers[buffer] = value
            if not isinstance(module, Fp4Linear):
                module._kernel_cache = None
            mapped += 1
        return mapped


def _fp4_weight(tensors: dict[str, torch.Tensor], name: str, linear: nn.Linear, scheme: QuantScheme) -> Fp4Weight:
    """The ``Fp4Weight`` whose ``Fp4Linear`` buffers layer ``name``'s state holds, read back through the module
    itself (its E4M3 / E8M0 scales decoded as it decodes them)."""
    module = Fp4Linear(linear.in_features, linear.out_features, scheme)
    for buffer, value in module.named_buffers(recurse=False):
        if value is not None:
            value.copy_(tensors[f"k.{name}.{buffer}"])
    return module.unpack()


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    getattr(owner, attr).data.copy_(value)
