from __future__ import annotations

import torch

from lmpress.calib.activations import FLOAT16_LIMIT, BatchStore


def _batches(rows=(4, 4, 2), width=8, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, 3, width, generator=g) for r in rows]


def test_batches_share_one_float16_slab_and_read_back_to_float16_rounding():
    batches = _batches()
    store = BatchStore([b.shape[0] for b in batches])
    for i in (2, 0, 1):  # any order
        store[i] = batches[i]
    assert len(store) == 3
    for got, want in zip(store, batches, strict=True):
        assert got.dtype == torch.float16 and got.shape == want.shape
        assert torch.equal(got, want.half())
    storages = {store[i].untyped_storage().data_ptr() for i in range(3)}
    assert len(storages) == 1  # one allocation for every batch
    assert store[0].untyped_storage().nbytes() == 10 * 3 * 8 * 2


def test_overwriting_a_batch_keeps_the_others():
    batches = _batches()
    store = BatchStore.of(batches)
    new = torch.full((4, 3, 8), 0.5)
    store[1] = new
    assert torch.equal(store[1], new.half())
    assert torch.equal(store[0], batches[0].half()) and torch.equal(store[2], batches[2].half())


def test_a_batch_beyond_float16_range_is_kept_apart_in_float32():
    batches = _batches()
    batches[1][0, 0, 0] = 4 * FLOAT16_LIMIT
    store = BatchStore.of(batches)
    assert store[1].dtype == torch.float32 and torch.equal(store[1], batches[1])
    assert store[1].untyped_storage().data_ptr() != store[0].untyped_storage().data_ptr()
    assert torch.equal(store[0], batches[0].half())


def test_nested_values_keep_their_structure_and_odd_tensors_are_kept_as_they_are():
    batches = _batches(rows=(2, 2))
    ids = torch.arange(6).reshape(2, 3)
    store = BatchStore([2, 2])
    store[0] = (batches[0], None, {"ids": ids})
    store[1] = (batches[1][:, :2], None, {"ids": ids})  # another shape than the slab holds
    first, none, extra = store[0]
    assert none is None and torch.equal(extra["ids"], ids) and extra["ids"].dtype == torch.int64
    assert torch.equal(first, batches[0].half())
    assert torch.equal(store[1][0], batches[1][:, :2].half())


def test_stored_values_are_copies():
    batch = torch.randn(2, 3, 8)
    store = BatchStore([2])
    store[0] = batch
    before = store[0].clone()
    batch.mul_(3)
    assert torch.equal(store[0], before)


def mapped_files() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line.split(maxsplit=5)[5].strip() for line in maps if len(line.split()) >= 6]


def test_slabs_beyond_the_budget_live_in_unlinked_files_and_read_back_the_same(tmp_path):
    import gc

    from lmpress.calib.activations import Spill

    spill = Spill(tmp_path, ram_bytes=2 * 3 * 8 * 2)  # room for one (2, 3, 8) float16 slab
    batches = [torch.randn(1, 3, 8) for _ in range(2)]
    kept = BatchStore([1, 1], spill)  # its slab: 2 x 3 x 8 float16 = the budget
    spilled = BatchStore([1, 1], spill)
    for store in (kept, spilled):
        for i, x in enumerate(batches):
            store[i] = x
    assert spill.held == 96 and spill.spilled == 96
    files = [f for f in mapped_files() if f.startswith(str(tmp_path))]
    assert len(files) == 1 and files[0].endswith("(deleted)") and not list(tmp_path.iterdir())
    for i, x in enumerate(batches):
        assert torch.equal(spilled[i], x.half()) and torch.equal(kept[i], x.half())
    del kept, spilled, store
    gc.collect()
    assert spill.held == 0 and spill.spilled == 0
    assert not [f for f in mapped_files() if f.startswith(str(tmp_path))]


def test_a_spill_directory_without_room_is_refused_before_any_work(tmp_path):
    import pytest

    from lmpress.calib.activations import Spill
    from lmpress.errors import LmpressInputError

    Spill(tmp_path, ram_bytes=1 << 40).check_room(1 << 40)  # all of it in RAM: no room needed
    with pytest.raises(LmpressInputError, match=r"data.spill_dir .* GiB free and the calibration activations"):
        Spill(tmp_path, ram_bytes=0).check_room(1 << 60)
