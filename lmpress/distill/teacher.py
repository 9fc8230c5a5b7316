"""The teacher's side of a training step: its logits (and hidden states) for a batch of windows,
computed on the fly or read from a cache on disk.

The cache keeps each window's top-k log-probabilities (float16) and token ids (int32) in
two memory-mapped arrays of shape ``(windows, seq_len, k)``, filled the first time a
window is seen, so later epochs (and a resumed run) skip the teacher's forward. Full
logits would not fit: 250k tokens x 49,152 vocabulary x 2 bytes is ~25 GB; at
``k = 64`` the same tokens take ~100 MB. The cache belongs to one teacher, text and
seq_len (its ``key``); a cache written for another is rebuilt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmpress.distill.losses import SparseTeacher


@dataclass
class TeacherOutputs:
    logits: torch.Tensor | SparseTeacher
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer index -> its output


@torch.no_grad()
def teacher_forward(teacher: nn.Module, ids: torch.Tensor, hidden_layers: set[int]) -> TeacherOutputs:
    """Full logits, and the outputs of decoder layers ``hidden_layers`` (``hidden_states[i + 1]``)."""
    out = teacher(ids, use_cache=False, output_hidden_states=bool(hidden_layers))
    hidden = {i: out.hidden_states[i + 1] for i in hidden_layers} if hidden_layers else {}
    return TeacherOutputs(out.logits, hidden)


def top_k_logprobs(logits: torch.Tensor, k: int) -> SparseTeacher:
    values, indices = torch.topk(logits.float(), k, dim=-1)
    logprobs = values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return SparseTeacher(logprobs, indices)


class TeacherCache:
    """Top-k teacher log-probabilities of every training window, on disk."""

    def __init__(self, directory: Path, n_windows: int, seq_len: int, k: int, key: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.k = directory, k
        meta_path = directory / "cache.json"
        meta = {"key": key, "windows": n_windows, "seq_len": seq_len, "k": k}
        fresh = not meta_path.exists() or json.loads(meta_path.read_text()) != meta
        mode = "w+" if fresh else "r+"
        shape = (n_windows, seq_len, k)
        self.logprobs = np.lib.format.open_memmap(directory / "logprobs.npy", mode, np.float16, shape)
        self.indices = np.lib.format.open_memmap(directory / "indices.npy", mode, np.int32, shape)
        self.filled = np.zeros(n_windows, bool) if fresh else np.load(directory / "filled.npy")
        if fresh:
            np.save(directory / "filled.npy", self.filled)
            meta_path.write_text(json.dumps(meta))

    def get(
        self, teacher: nn.Module, windows: torch.Tensor, rows: torch.Tensor, device: torch.device
    ) -> TeacherOutputs:
        """The cached targets of windows ``rows`` (their token ids ``windows[rows]``), computing the missing ones."""
        missing = [int(r) for r in rows if not self.filled[int(r)]]
        if missing:
            index = torch.tensor(missing)
            sparse = top_k_logprobs(teacher_forward(teacher, windows[index].to(device), set()).logits, self.k)
            self.logprobs[missing] = sparse.logprobs.to(torch.float16).cpu().numpy()
            self.indices[missing] = sparse.indices.to(torch.int32).cpu().numpy()
            self.logprobs.flush()
            self.indices.flush()
            self.filled[missing] = True
            np.save(self.directory / "filled.npy", self.filled)
        picked = rows.numpy()
        logprobs = torch.from_numpy(self.logprobs[picked]).float().to(device)
        return TeacherOutputs(SparseTeacher(logprobs, torch.from_numpy(self.indices[picked]).long().to(device)))
