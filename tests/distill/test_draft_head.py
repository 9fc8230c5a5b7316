"""EAGLE-3 draft head training: the training-time test computes what the drafter computes at inference, and a
head trained on the target's own continuations drafts its choices (held-out text, greedy output unchanged)."""

from __future__ import annotations

import pytest
import torch

from lmpress.distill.draft_head import (
    IGNORE,
    DraftHeadTraining,
    batches,
    capture_draft_data,
    decoding_accept_length,
    draft_hits,
    draft_vocabulary,
    held_out_scores,
    initialize_from_target,
    soft_cross_entropy,
    train_draft_head,
    training_time_outputs,
    training_time_test,
)
from lmpress.runtime.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from lmpress.runtime.generate import generate
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode
from tests.runtime.conftest import tiny_hf_model
from tests.runtime.test_eagle3 import head_for


@pytest.fixture(scope="module")
def eight_layers():
    hf = tiny_hf_model("llama", num_hidden_layers=8)
    return hf, Transformer.from_hf(hf)


@pytest.mark.parametrize(("weights", "tolerance"), [("float", 1e-4), ("8-bit", 1e-2)])
def test_training_time_test_computes_what_the_drafter_computes(eight_layers, monkeypatch, weights, tolerance):
    """Step j's output at position t in training = the drafter's j-th chained step after reading the target's
    features up to t - j, when its earlier drafts were the text's tokens: to float rounding with the head's float
    weights; with the weights as the drafter holds them on the CPU (8 bits per row, activations quantized to int8
    per row) within a few activation steps: the two attention paths sum in other orders, and an activation on a
    rounding boundary moves by a whole int8 step (1.2e-3 seen on an AMX Xeon)."""
    from lmpress.runtime import eagle3

    hf, target = eight_layers
    head = head_for(target, hf)
    if weights == "float":
        monkeypatch.setattr(eagle3, "drafting_head", lambda h: h)
    data = capture_draft_data(target, torch.randint(3, 256, (1, 10)), 8, head.config.feature_layers)
    tokens, features = data.tokens[0], data.features[0].float()
    embeds = target.tok_embeddings(tokens[None, 1:]).float()
    drafting = eagle3.drafting_head(head)
    with torch.no_grad():
        outputs = list(training_time_outputs(drafting, embeds, features[None, :-1], 3))
    for start in (0, 5, 12):  # the last position whose features the drafter has
        drafter = Eagle3Drafter(head, target, 32, SamplingConfig(temperature=0.0), torch.Generator())
        with torch.no_grad():
            out, _ = drafter._read(tokens[1 : start + 2].tolist(), drafting.fc(features[None, : start + 1]), 0)
            torch.testing.assert_close(out[0, 0], outputs[0][0, start], atol=tolerance, rtol=tolerance)
            for j in (1, 2):
                out, _ = drafter._read([int(tokens[start + 1 + j])], out, start + j)
                torch.testing.assert_close(out[0, 0], outputs[j][0, start + j], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("soft_labels", [0, 8])
def test_a_trained_head_drafts_the_targets_choices_on_held_out_prompts(soft_labels):
    """A random target over 32 tokens (its choices learnable from 48 continuations); a draft vocabulary of 24;
    learning the target's choices only, or its distribution over its 8 likeliest tokens."""
    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    prompts = torch.randint(3, 32, (56, 8), generator=torch.Generator().manual_seed(1))
    config = Eagle3Config.for_target(target, hf.config, 24)
    data = capture_draft_data(target, prompts, 32, config.feature_layers, soft_labels=soft_labels)
    train, held_out = data.split(8)
    torch.manual_seed(0)
    head = Eagle3Head(config)
    head.draft_tokens.copy_(draft_vocabulary(train.choices, 24, 32))
    initialize_from_target(head, hf)
    before, _ = held_out_scores(head, target, held_out, 3, 7)
    training = DraftHeadTraining(epochs=4, steps=3, lr=3e-3, soft_labels=soft_labels)
    losses = train_draft_head(head, target, train, training)
    after, after_rounds = held_out_scores(head, target, held_out, 3, 7)
    # the soft loss keeps the target's own entropy over its top tokens: it cannot fall as far
    assert losses[-1] < (0.5 if not soft_labels else 0.8) * losses[0], losses
    assert all(a > b + 0.15 for a, b in zip(after, before, strict=True)), (before, after)
    # one pass scores both: the training-time test's accuracies (8 held-out sequences: one batch) and the rounds
    ((embeds, features, rows, _),) = list(batches(held_out, target, head, 8, None))
    with torch.no_grad():
        assert after == pytest.approx(training_time_test(head, embeds, features, rows, 3)[1], abs=1e-6)
    assert after_rounds == decoding_accept_length(draft_hits(head, target, held_out, 3), 7)
    # and the rounds are what speculative decoding gets on those continuations (its last rounds, cut short by the
    # end, and the 8-bit drafting copy aside), not what the steps' accuracies suggest (every position a start)
    decoded = SpeculativeStats()
    for row in held_out.tokens:
        prompt, continuation = row[:8].tolist(), row[8:].tolist()
        assert (
            list(
                speculative_decode(
                    target, prompt, draft_head=head, max_new_tokens=32, k=3, adaptive=False, stats=decoded
                )
            )
            == continuation
        )
    from_accuracies = 1 + after[0] + after[0] * after[1] + after[0] * after[1] * after[2]
    miss = abs(after_rounds - decoded.tokens_per_step)  # 0.024 and 0.043 here (soft labels 0, 8)
    assert miss < 0.1 and miss < abs(from_accuracies - decoded.tokens_per_step) / 2  # those: 0.17 and 0.15

    stats = SpeculativeStats()
    for seed in range(3):
        ids = torch.randint(3, 32, (8,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        expected = generate(target, ids, max_new_tokens=32)[0]
        got = list(
            speculative_decode(target, ids, draft_head=head, max_new_tokens=32, k=3, adaptive=False, stats=stats)
        )
        assert got == expected
    assert stats.tokens_per_step > 1.5, stats  # untrained: 1.01


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_the_output_rows_stay_the_targets_unless_the_recipe_trains_them(train_lm_head):
    from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for

    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    prompts = torch.randint(3, 32, (12, 8), generator=torch.Generator().manual_seed(2))
    config = Eagle3Config.for_target(target, hf.config, 24)
    data = capture_draft_data(target, prompts, 8, config.feature_layers)
    stage = DraftHeadConfig(prompts=12, draft_vocab=24, epochs=1, held_out=4, train_lm_head=train_lm_head)
    head, summary = train_head_for(target, hf, data, stage, config)
    rows = hf.lm_head.weight[head.draft_tokens].float()
    assert torch.equal(head.lm_head.weight, rows) is not train_lm_head
    assert summary["lm_head"] == ("trained" if train_lm_head else "the target's rows, frozen")


def test_rows_the_target_could_not_give_are_learned(monkeypatch):
    from lmpress.distill import draft_head_stage
    from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for

    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    monkeypatch.setattr(draft_head_stage, "initialize_from_target", lambda head, model: False)
    config = Eagle3Config.for_target(target, hf.config, 24)
    data = capture_draft_data(target, torch.randint(3, 32, (12, 8)), 8, config.feature_layers)
    torch.manual_seed(0)
    untrained = Eagle3Head(config).lm_head.weight.clone()
    head, summary = train_head_for(target, hf, data, DraftHeadConfig(prompts=12, draft_vocab=24, held_out=4), config)
    assert summary["lm_head"] == "trained" and not torch.equal(head.lm_head.weight, untrained)


def test_the_capture_keeps_each_continuations_features_and_choices(eight_layers, monkeypatch):
    """Six prompts in one generation batch, their prompts read a few positions at a time (LOGIT_ROWS), then one token
    a step: each sequence's features, choices and likeliest tokens are what the target computes over that sequence
    alone."""
    from lmpress.distill import draft_head

    hf, target = eight_layers
    layers = Eagle3Config.for_target(target, hf.config, 64).feature_layers
    prompts = torch.randint(3, 256, (6, 6), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(draft_head, "LOGIT_ROWS", 16)  # the prompts in reads of 2 positions
    data = capture_draft_data(target, prompts, 5, layers, batch_size=8, soft_labels=4)
    assert data.tokens.shape == data.choices.shape == (6, 11) and data.features.shape == (6, 11, 3 * target.args.dim)
    for row, text in enumerate(data.tokens):
        assert text[:6].tolist() == prompts[row].tolist()
        assert text[6:].tolist() == generate(target, prompts[row].tolist(), max_new_tokens=5)[0]
        logits, features = target.forward_with_features(text[None], target.new_cache(1, 11), layers)
        # a batch of sequences sums in another order: one bfloat16 step apart at most
        torch.testing.assert_close(data.features[row].float(), features[0].float(), rtol=2**-7, atol=1e-6)
        assert data.choices[row].tolist() == logits[0].argmax(-1).tolist()
        probs = logits[0].float().softmax(-1)
        assert data.top_tokens[row, :, 0].tolist() == data.choices[row].tolist()  # the likeliest first
        torch.testing.assert_close(
            data.top_probs[row].float(), probs.gather(-1, data.top_tokens[row].long()), rtol=2**-7, atol=1e-6
        )
        assert (data.top_probs[row, :, :-1] >= data.top_probs[row, :, 1:]).all()


def test_the_capture_frees_a_batchs_cache_before_the_next_batchs_is_made(eight_layers):
    """A batch's KV cache is the capture's largest tensor (SmolLM2, 16 sequences of 256 tokens: 180 MiB): the next
    batch's is made only once it is gone, never two held at once."""
    import gc
    import weakref

    hf, target = eight_layers
    layers = Eagle3Config.for_target(target, hf.config, 64).feature_layers
    made: list[weakref.ref] = []
    new_cache = target.new_cache

    def tracked(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in made), "a batch's cache is still held when the next one is made"
        cache = new_cache(*args, **kwargs)
        made.append(weakref.ref(cache))
        return cache

    target.new_cache = tracked
    capture_draft_data(target, torch.randint(3, 256, (5, 4)), 3, layers, batch_size=2)
    assert len(made) == 3


def test_rounds_follow_each_other_as_decoding_runs_them():
    """A round drafting at s accepts step j's draft (at s + j) while every step so far hit, gives the target's token
    besides, and the next round drafts after them; rounds start at the prompt's last position and stop where fewer
    positions than steps are left."""
    t, f = True, False
    hits = [  # one sequence, 8 positions, 3 steps
        torch.tensor([[f, t, f, f, t, t, t, f]]),
        torch.tensor([[f, f, t, f, f, t, f, f]]),
        torch.tensor([[f, f, f, f, f, f, t, f]]),
    ]
    # from 1: step 0 at 1 hits, step 1 at 2 hits, step 2 at 3 misses -> 3 tokens, next at 4; from 4: step 0 at 4
    # hits, step 1 at 5 hits, step 2 at 6 hits -> 4 tokens, next at 8: no room for 3 steps
    assert decoding_accept_length([hits], first=1) == (3 + 4) / 2
    # from 0: a miss (1 token), then from 1 and 4 as above
    assert decoding_accept_length([hits], first=0) == (1 + 3 + 4) / 3
    assert decoding_accept_length([hits, hits], first=0) == (1 + 3 + 4) / 3  # batches pooled by passes


def test_draft_hits_count_a_token_among_the_heads_top_choices(eight_layers):
    """Step j's hit with top b: the target's token is among the head's b likeliest there. Top 1 is the draft (its
    rate over the positions the draft vocabulary can give is the training-time test's accuracy); top 64, the whole
    draft vocabulary, hits wherever that vocabulary holds the target's token."""
    hf, target = eight_layers
    config = Eagle3Config.for_target(target, hf.config, 64)
    data = capture_draft_data(target, torch.randint(3, 256, (4, 6)), 10, config.feature_layers)
    head = Eagle3Head(config)
    head.draft_tokens.copy_(torch.arange(64))
    (drafts,), (whole,) = list(draft_hits(head, target, data, 2)), list(draft_hits(head, target, data, 2, (64, 64)))
    embeds, features, rows, _ = next(batches(data, target, head, 8, None))
    _, accuracies = training_time_test(head, embeds, features, rows, 2)
    for j in range(2):
        scored = rows[:, j:] != IGNORE
        assert float(drafts[j][:, j:][scored].float().mean()) == pytest.approx(accuracies[j])
        assert torch.equal(whole[j][:, j:], scored)


def test_the_soft_loss_is_the_cross_entropy_to_the_targets_renormalized_distribution():
    """Against torch's cross-entropy with probability targets: the target's top tokens outside the draft vocabulary
    dropped and the rest renormalized; with one token at probability 1 it is the hard cross-entropy; positions not
    scored do not count."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 10)
    top_rows = torch.tensor([[[3, IGNORE, 7], [1, 2, 0]] * 2 + [[4, 5, 6]]] * 2)  # (2, 5, 3)
    top_probs = torch.tensor([[[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]] * 2 + [[0.4, 0.4, 0.2]]] * 2)
    scored = torch.tensor([[True, True, True, False, True], [True] * 5])
    dense = torch.zeros(2, 5, 10)
    for b, t, i in torch.cartesian_prod(torch.arange(2), torch.arange(5), torch.arange(3)).tolist():
        if top_rows[b, t, i] != IGNORE:
            dense[b, t, top_rows[b, t, i]] += top_probs[b, t, i]
    dense = dense / dense.sum(-1, keepdim=True)
    want = torch.nn.functional.cross_entropy(logits[scored], dense[scored])
    torch.testing.assert_close(soft_cross_entropy(logits, top_rows, top_probs, scored), want)
    one_hot = soft_cross_entropy(logits, top_rows[..., :1].clamp_min(0), torch.ones(2, 5, 1), scored)
    hard = torch.nn.functional.cross_entropy(logits[scored], top_rows[..., 0].clamp_min(0)[scored])
    torch.testing.assert_close(one_hot, hard)


def test_text_is_read_teacher_forced_and_a_head_learns_from_it(monkeypatch):
    """``text_draft_data`` keeps the text as it is (not the target's continuation) with the target's features and
    choices over it; a head trained on it is scored on the continuations given as held out, all text trained on."""
    from lmpress.distill import draft_head_stage
    from lmpress.distill.draft_head import text_draft_data
    from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for

    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    config = Eagle3Config.for_target(target, hf.config, 24)
    text = torch.randint(3, 32, (6, 12), generator=torch.Generator().manual_seed(4))
    data = text_draft_data(target, text, config.feature_layers)
    assert torch.equal(data.tokens, text)
    for row in range(len(text)):
        logits, features = target.forward_with_features(
            text[row : row + 1], target.new_cache(1, 12), config.feature_layers
        )
        torch.testing.assert_close(data.features[row].float(), features[0].float(), rtol=2**-7, atol=1e-6)
        assert data.choices[row].tolist() == logits[0].argmax(-1).tolist()
    held_out = capture_draft_data(target, torch.randint(3, 32, (3, 6)), 6, config.feature_layers)
    scored = []
    real = draft_head_stage.held_out_scores
    monkeypatch.setattr(draft_head_stage, "held_out_scores", lambda h, t, d, *a: scored.append(d) or real(h, t, d, *a))
    stage = DraftHeadConfig(prompts=6, draft_vocab=24, epochs=1, held_out=2)
    _, summary = train_head_for(target, hf, data, stage, config, held_out=held_out)
    assert scored == [held_out] and summary["sequences"] == 6


def test_a_resumed_stage_reuses_its_capture_unless_it_lacks_the_soft_labels_asked_for(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lmpress.distill import draft_head_stage
    from lmpress.distill.draft_head_stage import DraftHeadConfig

    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    layers = Eagle3Config.for_target(target, hf.config, 24).feature_layers
    samples = torch.randint(3, 32, (6, 8), generator=torch.Generator().manual_seed(5))
    ctx = SimpleNamespace(
        state_dir=tmp_path, resume=True, fingerprint="f", calibration=lambda: samples, bars=draft_head_stage.QUIET
    )
    captures = []
    real = draft_head_stage.capture_draft_data
    monkeypatch.setattr(
        draft_head_stage, "capture_draft_data", lambda *a, **k: captures.append(k["soft_labels"]) or real(*a, **k)
    )
    for soft_labels in (0, 0, 4, 4, 2, 0):
        config = DraftHeadConfig(prompts=6, prompt_tokens=4, new_tokens=3, held_out=2, soft_labels=soft_labels)
        data = draft_head_stage._draft_data(target, config, ctx, layers)
        assert data.tokens.shape == (6, 7)
        assert (data.top_tokens is not None and data.top_tokens.shape[-1] >= soft_labels) or soft_labels == 0
    assert captures == [0, 4]  # a capture with 4 labels serves 2 and none; one without serves none
