from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from lmpress.calib.pages import drop_file_pages


def _resident_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))


def test_pages_of_a_mapped_checkpoint_are_dropped_and_read_back_from_the_file(tmp_path):
    weight = torch.randn(2048, 1024)  # 8 MiB
    save_file({"w": weight}, tmp_path / "model.safetensors")
    mapped = load_file(tmp_path / "model.safetensors")["w"]  # a private file mapping, as transformers loads it
    assert torch.equal(mapped, weight)  # every page resident now
    before = _resident_file_kb()
    assert drop_file_pages(mapped)
    assert before - _resident_file_kb() > 6 * 1024
    assert torch.equal(mapped, weight)  # faulted back in from the file, unchanged


def test_anonymous_memory_is_left_alone():
    weight = torch.randn(2048, 1024)
    copy = weight.clone()
    assert not drop_file_pages(weight)
    assert torch.equal(weight, copy)
