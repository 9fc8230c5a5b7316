"""EAGLE-3 draft heads in speculative decoding: greedy output identical to plain decoding, the target's
distribution kept under sampling, heads that cannot draft for a target refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.runtime.eagle3 import (
    HEAD_LINEARS,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    compiled_head_step,
    default_feature_layers,
    drafting_head,
    eager_head_step,
)
from lmpress.runtime.generate import generate, model_forward, static_forward
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode
from tests.runtime.conftest import tiny_hf_model
from tests.runtime.test_model import sqnr_db
from tests.runtime.test_speculative import assert_first_two_tokens_follow_the_target, prompt


def head_for(target: Transformer, hf, draft_vocab: int | None = None, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, hf.config, draft_vocab or target.args.vocab_size))
    with torch.no_grad():
        for p in head.parameters():  # wider than the default init: drafts that differ from position to position
            if p.dim() == 2:
                p.normal_(0, 0.08)
        if draft_vocab:
            head.draft_tokens.copy_(torch.randperm(target.args.vocab_size)[:draft_vocab].sort().values)
    return head.eval()


@pytest.fixture(scope="module")
def eight_layers():
    hf = tiny_hf_model("llama", num_hidden_layers=8)
    return hf, Transformer.from_hf(hf)


@pytest.mark.parametrize(("k", "adaptive", "draft_vocab"), [(3, False, None), (2, True, 64)])
def test_greedy_output_identical_to_plain_decoding_with_a_draft_head(eight_layers, k, adaptive, draft_vocab):
    hf, target = eight_layers
    head = head_for(target, hf, draft_vocab)
    stats = SpeculativeStats()
    for seed in range(3):
        ids = prompt(seed=seed)
        expected = generate(target, ids, max_new_tokens=40)[0]
        got = list(
            speculative_decode(target, ids, draft_head=head, max_new_tokens=40, k=k, adaptive=adaptive, stats=stats)
        )
        assert got == expected
    assert stats.drafted > 0  # the head drafted (a random one: rarely accepted; tests/distill trains one)


def test_the_drafter_on_the_cpu_runs_the_head_in_8_bits_close_to_its_float_weights(eight_layers):
    """A float32 head reads half a W4 SmolLM2 step's bytes at each draft: the CPU drafter holds its linears with
    8-bit weights per row, in the runtime's int8 kernels, and the head it was given stays float. Its scores over
    the draft vocabulary keep an SQNR above 30 dB against the float head's (36 dB on this random head)."""
    hf, target = eight_layers
    head = head_for(target, hf)
    drafter = Eagle3Drafter(head, target, 32, SamplingConfig(temperature=0.0), torch.Generator())
    for name in HEAD_LINEARS:
        assert type(getattr(drafter.head, name)) is not torch.nn.Linear, name
        assert type(getattr(head, name)) is torch.nn.Linear, name
    features = torch.randn(1, 6, head.fc.in_features)
    embeds = target.tok_embeddings(torch.tensor([prompt(seed=5)[:6]])).float()
    with torch.no_grad():
        scores = [h.logits(h.finish(*_attend(h, embeds, h.fc(features)))) for h in (head, drafter.head)]
    assert sqnr_db(scores[0], scores[1]) > 30


def test_the_drafting_copy_is_built_once_for_a_heads_weights_and_anew_when_they_change(eight_layers):
    hf, target = eight_layers
    head = head_for(target, hf)
    first = drafting_head(head)
    assert drafting_head(head) is first
    with torch.no_grad():
        head.lm_head.weight.mul_(-1)  # an in-place update, as an optimizer's step makes
    second = drafting_head(head)
    assert second is not first
    x = torch.randn(1, 1, head.config.hidden_size)
    with torch.no_grad():
        assert sqnr_db(head.logits(x), second.logits(x)) > 30


def _attend(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, residual = head.qkv(embeds, hidden, torch.arange(embeds.shape[1]))
    attended = torch.nn.functional.scaled_dot_product_attention(q, head.repeat_kv(k), head.repeat_kv(v), is_causal=True)
    return attended, residual


def test_verification_with_features_steps_through_a_static_forward(eight_layers):
    """The verifying reads return the head's features through the static (compilable) step as through the
    model's own forward: the same drafts are accepted, the output is plain decoding's."""
    hf, target = eight_layers
    head = head_for(target, hf)
    ids = prompt(seed=4)
    runs = []
    for forward in (model_forward, static_forward()):
        stats = SpeculativeStats()
        tokens = list(
            speculative_decode(
                target, ids, draft_head=head, max_new_tokens=24, forward=forward, stats=stats, k=3, adaptive=False
            )
        )
        runs.append((tokens, stats))
    assert runs[0] == runs[1]
    assert runs[0][0] == generate(target, ids, max_new_tokens=24)[0]
    cache_a, cache_b = target.new_cache(1, 32), target.new_cache(1, 32)
    layers = head.config.feature_layers
    want = model_forward(target, torch.tensor([ids]), cache_a, layers)
    got = static_forward()(target, torch.tensor([ids[:3]]), cache_b, layers)
    torch.testing.assert_close(got[1], want[1][:, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0][:, :3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("weights", "tolerance"), [("float", 1e-4), ("8-bit", 1e-2)])
def test_the_compiled_head_step_reads_what_the_op_by_op_step_reads(eight_layers, monkeypatch, weights, tolerance):
    """The compiled step reads the whole cache with later slots masked, the op-by-op one the filled slots: a round's
    first step over several positions, chain steps of one, and a second round's first step give the same outputs
    and scores (to float rounding with float weights; with the drafter's 8-bit weights within a few activation
    steps: an activation on a rounding boundary moves by a whole int8 step), and both write the same cache."""
    from lmpress.runtime import eagle3

    hf, target = eight_layers
    head = head_for(target, hf, 64)
    if weights == "float":
        monkeypatch.setattr(eagle3, "drafting_head", lambda h: h)
    tokens = prompt(seed=6)[:12]
    drafters = [
        Eagle3Drafter(head, target, 40, SamplingConfig(temperature=0.0), torch.Generator(), step)
        for step in (eager_head_step, compiled_head_step())
    ]
    features = torch.randn(1, 12, head.fc.in_features)
    reads = [(tokens[:5], 0), (tokens[5:6], 5), (tokens[6:7], 6), (tokens[7:10], 7), (tokens[10:11], 10)]
    with torch.no_grad():
        for part, start in reads:
            hidden = drafters[0].head.fc(features[:, start : start + len(part)])
            (out_a, scores_a), (out_b, scores_b) = (d._read(part, hidden, start) for d in drafters)
            torch.testing.assert_close(out_b, out_a, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(scores_b, scores_a, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(drafters[1].k[:, :, :11], drafters[0].k[:, :, :11], atol=tolerance, rtol=tolerance)
    assert not drafters[1].k[:, :, 11:].any()


def test_greedy_output_identical_to_plain_decoding_with_a_compiled_head_step(eight_layers):
    hf, target = eight_layers
    head = head_for(target, hf, 64)
    step = compiled_head_step()
    stats = SpeculativeStats()
    for seed in range(2):
        ids = prompt(seed=seed)
        got = speculative_decode(target, ids, draft_head=head, max_new_tokens=32, k=3, head_step=step, stats=stats)
        assert list(got) == generate(target, ids, max_new_tokens=32)[0]
    assert stats.drafted > 0


@pytest.mark.long
def test_sampling_with_a_draft_head_follows_the_target_distribution():
    """With a head whose proposals differ from the target's."""
    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=4)
    target = Transformer.from_hf(hf)
    assert_first_two_tokens_follow_the_target(hf, target, 1200, draft_head=head_for(target, hf))


def test_heads_that_cannot_draft_for_a_target_are_refused(eight_layers):
    hf, target = eight_layers
    other_hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=128)
    other = Transformer.from_hf(other_hf)
    head = head_for(other, other_hf)
    with pytest.raises(LmpressInputError, match="128 tokens"):
        list(speculative_decode(target, prompt(), draft_head=head, max_new_tokens=4))
    with pytest.raises(LmpressInputError, match="three distinct layers"):
        default_feature_layers(4)
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2: vLLM's default for a 30-layer target
    with pytest.raises(LmpressInputError, match="draft vocabulary of 300"):
        Eagle3Config.for_target(target, hf.config, 300)
    gemma_like = Transformer.from_hf(tiny_hf_model("llama", num_hidden_layers=8))
    gemma_like.args = dataclasses.replace(gemma_like.args, embed_scale=11.3)
    with pytest.raises(LmpressInputError, match="Gemma"):
        Eagle3Config.for_target(gemma_like, hf.config, 64)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_target_on_an_accelerator_drafts_with_its_head_on_the_cpu(temperature):
    """On a GPU target the drafter reads the target's features and embeddings back to the CPU, where its head
    and cache live; verification compares the target's logits there too. Under the placement test device (any
    op mixing devices fails as on CUDA) the tokens are those of the same run on the CPU."""
    from tests.fake_device import fake_accelerator

    hf = tiny_hf_model("llama", num_hidden_layers=8)
    on_cpu = Transformer.from_hf(hf)
    head = head_for(on_cpu, hf)
    ids = prompt(seed=2)
    sampling = SamplingConfig(temperature=temperature)
    decode = dict(draft_head=head, max_new_tokens=24, k=3, adaptive=False, sampling=sampling, seed=1)
    expected = list(speculative_decode(on_cpu, ids, **decode))
    with fake_accelerator() as device:
        on_device = Transformer.from_hf(hf, device=device, kernels="cpu")
        assert on_device.device == device
        stats = SpeculativeStats()
        assert list(speculative_decode(on_device, ids, stats=stats, **decode)) == expected
    assert stats.drafted > 0
