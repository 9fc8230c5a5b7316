"""lmpress.metrics: the per-token measures every eval and check scores with."""

from __future__ import annotations

import math

import pytest
import torch

from lmpress.metrics import mean_token_nll, token_nll


@pytest.mark.parametrize("chunk", [1, 7, 49, 50, 1024])
def test_the_chunked_mean_nll_is_the_whole_windows(chunk):
    """Chunks of the log-softmax (one at a time) give the mean of every next-token NLL, whatever the chunk and
    however it meets the window's end (50 scored positions)."""
    g = torch.Generator().manual_seed(0)
    logits, window = torch.randn(1, 51, 300, generator=g) * 4, torch.randint(0, 300, (1, 51), generator=g)
    want = token_nll(logits.double(), window).mean().item()  # float64 throughout: an independent reference
    assert mean_token_nll(logits, window, chunk) == pytest.approx(want, rel=1e-6)
    assert math.isfinite(mean_token_nll(logits.bfloat16(), window, chunk))  # half-precision logits widen per chunk
