"""Distillation losses against direct formulas on small vocabularies."""

import math

import pytest
import torch

from lmpress.distill.losses import SparseTeacher, hidden_state_loss, logit_divergence
from lmpress.distill.teacher import top_k_logprobs


def reference(student: torch.Tensor, teacher: torch.Tensor, kind: str, t: float) -> torch.Tensor:
    """Per-position divergence written out from the definitions, averaged, times T²."""
    p_s = torch.softmax(student.double() / t, -1)
    p_t = torch.softmax(teacher.double() / t, -1)
    if kind == "forward_kl":
        d = (p_t * (p_t.log() - p_s.log())).sum(-1)
    elif kind == "reverse_kl":
        d = (p_s * (p_s.log() - p_t.log())).sum(-1)
    else:
        m = (p_s + p_t) / 2
        d = 0.5 * (p_t * (p_t.log() - m.log())).sum(-1) + 0.5 * (p_s * (p_s.log() - m.log())).sum(-1)
    return d.mean() * t * t


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergences_match_their_definitions_in_any_chunking(kind, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 37, 50) * 3, torch.randn(2, 37, 50) * 3
    expected = reference(student, teacher, kind, temperature)
    for chunk in (1, 7, 1024):
        got = logit_divergence(student, teacher, kind, temperature, chunk=chunk)
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_chunked_gradient_equals_the_unchunked_one(kind):
    torch.manual_seed(1)
    teacher = torch.randn(1, 20, 30)
    grads = []
    for chunk in (3, 1000):
        student = (torch.randn(1, 20, 30, generator=torch.Generator().manual_seed(2))).requires_grad_()
        logit_divergence(student, teacher, kind, chunk=chunk).backward()
        grads.append(student.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    # forward KL's gradient at T = 1 is (p_s - p_t) / positions
    if kind == "forward_kl":
        student = torch.randn(1, 20, 30, generator=torch.Generator().manual_seed(2))
        expected = (torch.softmax(student, -1) - torch.softmax(teacher, -1)) / 20
        assert torch.allclose(grads[0], expected, atol=1e-6)


def test_divergence_is_zero_on_itself_and_jsd_is_bounded_by_ln2():
    logits = torch.randn(3, 5, 11)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert logit_divergence(logits, logits, kind).item() == pytest.approx(0.0, abs=1e-6)
    far = torch.full((1, 4, 11), -1e4)
    far[..., 0] = 1e4
    near = torch.full((1, 4, 11), -1e4)
    near[..., 1] = 1e4
    assert logit_divergence(far, near, "jsd").item() == pytest.approx(math.log(2), rel=1e-5)


def test_mask_drops_positions():
    torch.manual_seed(3)
    s, t = torch.randn(1, 6, 9), torch.randn(1, 6, 9)
    mask = torch.tensor([[True, True, False, True, False, False]])
    got = logit_divergence(s, t, "forward_kl", mask=mask)
    assert got.item() == pytest.approx(reference(s[mask][None], t[mask][None], "forward_kl", 1.0).item(), rel=1e-5)


def test_a_full_top_k_cache_gives_the_exact_forward_kl_and_a_partial_one_renormalizes():
    torch.manual_seed(4)
    s, t = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    full = top_k_logprobs(t, 16)
    assert logit_divergence(s, full).item() == pytest.approx(reference(s, t, "forward_kl", 1.0).item(), rel=1e-5)
    # with k < vocab: KL(p_t restricted to its top k, renormalized || p_s), only over those k tokens
    sparse = top_k_logprobs(t, 4)
    p_t = torch.softmax(sparse.logprobs.double(), -1)
    log_s = torch.log_softmax(s.double(), -1).gather(-1, sparse.indices)
    expected = (p_t * (p_t.log() - log_s)).sum(-1).mean()
    assert logit_divergence(s, sparse).item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match="forward_kl only"):
        logit_divergence(s, SparseTeacher(sparse.logprobs, sparse.indices), "jsd")


def test_hidden_state_losses():
    a = torch.randn(2, 5, 8)
    assert hidden_state_loss(a, a, "mse").item() == 0
    assert hidden_state_loss(a, 2 * a, "cosine").item() == pytest.approx(0.0, abs=1e-6)
    assert hidden_state_loss(a, -a, "cosine").item() == pytest.approx(2.0, abs=1e-6)
    assert hidden_state_loss(a, a + 1, "mse").item() == pytest.approx(1.0)
