"""Speculative decoding: greedy identity with plain decoding, the target's distribution under sampling, bad drafts."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import lmpress
from lmpress.errors import LmpressInputError
from lmpress.runtime.generate import generate
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, next_token_probs
from lmpress.runtime.speculative import (
    PromptLookupDrafter,
    SpeculativeStats,
    speculative_decode,
    verify,
    verify_greedy,
)
from tests.runtime.conftest import tiny_hf_model

# Chi-square critical values at p = 0.001 (a correct sampler fails with probability 1/1000 per seed).
CHI2_CRITICAL_999 = {5: 20.515, 15: 37.697}


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model("llama", seed=0)


@pytest.fixture(scope="module")
def target(target_hf) -> Transformer:
    return Transformer.from_hf(target_hf)


def prompt(n: int = 16, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def w4_copy(hf) -> Transformer:
    quantized = copy.deepcopy(hf)
    lmpress.quantize_model(quantized, method="rtn", bits=4, group_size=32)
    return Transformer.from_hf(quantized)


@pytest.mark.parametrize("draft_kind", ["other-init", "w4-copy", "prompt-lookup"])
def test_greedy_output_identical_to_plain_decoding(target, target_hf, draft_kind):
    draft = {
        "other-init": lambda: Transformer.from_hf(tiny_hf_model("llama", seed=9)),
        "w4-copy": lambda: w4_copy(target_hf),
    }
    draft_model = draft[draft_kind]() if draft_kind in draft else None
    for seed in range(3):
        ids = prompt(seed=seed)
        if draft_kind == "prompt-lookup":
            ids = ids + ids[:8]  # a repeat gives the n-gram lookup something to find
        expected = generate(target, ids, max_new_tokens=48)[0]
        stats = SpeculativeStats()
        actual = list(speculative_decode(target, ids, draft=draft_model, max_new_tokens=48, stats=stats))
        assert actual == expected
        assert stats.target_steps < 48 or draft_kind == "other-init"
        assert stats.tokens_per_step == (len(actual) - 1) / stats.target_steps


def test_draft_and_verification_step_through_a_static_forward(target, target_hf):
    from lmpress.runtime.generate import static_forward

    draft, step, steps = w4_copy(target_hf), static_forward(), []

    def counted_step(model, tokens, cache):
        steps.append((model is draft, tokens.shape[1]))
        return step(model, tokens, cache)

    ids = prompt(seed=4)
    eager, static = SpeculativeStats(), SpeculativeStats()
    expected = list(speculative_decode(target, ids, draft=draft, max_new_tokens=48, stats=eager, adaptive=False))
    actual = list(
        speculative_decode(
            target, ids, draft=draft, max_new_tokens=48, stats=static, adaptive=False, forward=counted_step
        )
    )
    assert actual == expected == generate(target, ids, max_new_tokens=48)[0]
    assert (static.drafted, static.accepted) == (eager.drafted, eager.accepted)
    draft_reads = {n for is_draft, n in steps if is_draft}
    assert 1 in draft_reads and max(draft_reads) <= 2  # the draft's steps went through it, the prompt did not
    verified = [n for is_draft, n in steps if not is_draft]  # the target's: k=4 drafts + 1, fewer near the end
    assert len(verified) == static.target_steps and max(verified) == 5


def test_acceptance_reflects_draft_quality(target, target_hf):
    drafts = {"w4": w4_copy(target_hf), "unrelated": Transformer.from_hf(tiny_hf_model("llama", seed=9))}
    stats = {name: SpeculativeStats() for name in drafts}
    for name, draft in drafts.items():
        # fixed k: a draft as large as the target costs what its drafts win, and adaptive rounds stop drafting
        list(speculative_decode(target, prompt(), draft=draft, max_new_tokens=48, stats=stats[name], adaptive=False))
    # Random tiny weights have near-tied logits, so even a W4 copy flips some argmaxes.
    assert stats["w4"].acceptance_rate > 0.3 and stats["w4"].tokens_per_step > 1.5
    assert stats["unrelated"].acceptance_rate < 0.2 and stats["unrelated"].tokens_per_step < 1.3


def test_greedy_identity_with_eos_and_repetition_penalty(target):
    ids = prompt(seed=4)
    sampling = SamplingConfig(repetition_penalty=1.3)
    free = generate(target, ids, max_new_tokens=30, sampling=sampling)[0]
    eos = free[20]
    expected = generate(target, ids, max_new_tokens=30, sampling=sampling, eos_token_id=eos)[0]
    draft = Transformer.from_hf(tiny_hf_model("llama", seed=2))
    for drafter in ({"draft": draft}, {"prompt_lookup": PromptLookupDrafter(2)}):
        actual = list(
            speculative_decode(target, ids, max_new_tokens=30, sampling=sampling, eos_token_id=eos, **drafter)
        )
        assert actual == expected


def test_context_limit_matches_plain_decoding(target):
    ids = prompt(250)
    expected = generate(target, ids, max_new_tokens=40)[0]
    assert len(expected) == 7
    assert list(speculative_decode(target, ids, draft=target, max_new_tokens=40)) == expected


def test_k_adapts_to_acceptance_and_cost():
    from lmpress.runtime.speculative import AdaptiveK

    def settle(acceptance: float, seconds_per_token: float) -> int:
        """k after 30 rounds at this acceptance, verifying n tokens in 1 + seconds_per_token * (n - 1)."""
        k = AdaptiveK(4, 8, adaptive=True)
        for _ in range(30):
            drafted = k.k
            k.update(drafted, round(acceptance * drafted), 1 + seconds_per_token * drafted)
        return k.k

    assert settle(1.0, 0.05) == 8  # every draft taken, verifying is nearly free (a GPU): the longest rounds
    assert settle(0.5, 0.05) < settle(0.9, 0.05)  # fewer drafts taken: shorter rounds
    assert settle(0.9, 1.0) < settle(0.9, 0.05)  # each verified token costs a full step (a slow CPU): shorter
    assert settle(0.0, 0.05) in (0, 1)  # none taken: plain rounds, or the one that tries drafting again
    fixed = AdaptiveK(3, 8, adaptive=False)
    fixed.update(3, 3, 1.0)
    assert fixed.k == 3


def test_rounds_stop_drafting_where_no_draft_pays_and_try_again_now_and_then():
    """A draft that is never taken, or one whose steps cost more than its accepted tokens win, makes rounds read
    one token alone (k = 0, a plain step); one round in PROBE_ROUNDS + 1 drafts again. Drafts that pay are kept."""
    from lmpress.runtime.speculative import AdaptiveK

    def ks(acceptance: float, draft_seconds: float, rounds: int = 60) -> list[int]:
        k, chosen = AdaptiveK(3, 8, adaptive=True), []
        for _ in range(rounds):
            drafted = k.k
            k.update(drafted, round(acceptance * drafted), 1 + 0.2 * drafted, draft_seconds * drafted)
            chosen.append(k.k)
        return chosen

    never = ks(0.0, 0.05)[20:]
    assert never.count(0) == len(never) - never.count(1) and never.count(1) == len(never) // 9
    costly = ks(0.3, 0.4)[20:]  # a draft step 40% of a target step at 30% acceptance: slower than plain
    assert costly.count(0) >= len(costly) * 8 // 9
    assert 0 not in ks(0.9, 0.05)  # drafts that pay: never a plain round


def test_k_estimates_the_per_token_acceptance_of_rounds_that_stop_at_the_first_rejection():
    from lmpress.runtime.speculative import AdaptiveK

    generator = torch.Generator().manual_seed(0)
    for rate in (0.3, 0.75, 0.9):
        k, estimates = AdaptiveK(4, 8, adaptive=True), []
        for _ in range(400):
            drafted = max(k.k, 1)  # the estimate's test: every round drafts, whether or not drafting pays
            taken = torch.rand(drafted, generator=generator) < rate
            accepted = int(taken.long().cumprod(0).sum())  # drafts taken before the first rejection
            k.update(drafted, accepted, 1.0 + 0.1 * drafted, 0.2 * drafted)
            estimates.append(k.acceptance)
        assert abs(sum(estimates[100:]) / 300 - rate) < 0.05, rate


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_verify_emits_target_distributed_tokens():
    """Leviathan et al. 2023, Theorem 3.5: the first emitted token is distributed as the target's p, whatever q is."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.1, 0.2, 0.15, 0.1], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    q = torch.tensor([[0.3, 0.05, 0.3, 0.05, 0.2, 0.1]])
    first, drafted = torch.zeros(6), torch.zeros(6)
    for _ in range(6000):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        first[verify(p, [draft], q, gen)[0]] += 1
        drafted[draft] += 1
    assert chi_square(first, p[0]) < CHI2_CRITICAL_999[5]
    # The test has power: the drafts themselves (q-distributed) fail it by far.
    assert chi_square(drafted, p[0]) > 10 * CHI2_CRITICAL_999[5]


def test_verify_with_a_deterministic_draft_emits_target_distributed_tokens():
    """A draft with no distribution (prompt lookup, greedy drafts) is a one-hot q: the law still holds."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.1, 0.2, 0.15, 0.1], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    first = torch.zeros(6)
    for _ in range(6000):
        first[verify(p, [3], None, gen)[0]] += 1
    assert chi_square(first, p[0]) < CHI2_CRITICAL_999[5]


def test_greedy_verification_is_verify_on_one_hot_distributions():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        best = torch.randint(0, 4, (k + 1,), generator=gen).tolist()
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        one_hot = torch.nn.functional.one_hot(torch.tensor(best), 4).float()
        drafted = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), 4).float() if k else None
        expected = verify_greedy(best, drafts)
        assert verify(one_hot, drafts, drafted, gen) == expected == verify(one_hot, drafts, None, gen)


def assert_first_two_tokens_follow_the_target(target_hf, target: Transformer, runs: int, **drafting) -> None:
    """End to end on a 4-token vocabulary: the joint law of the first two sampled tokens (the second comes out of
    a draft-and-verify round) is the target's, over ``runs`` seeds, drafting as ``drafting`` says."""
    sampling = SamplingConfig(temperature=1.0)
    ids = [1, 3, 0, 2]
    with torch.no_grad():
        p1 = next_token_probs(target_hf(torch.tensor([ids])).logits[:, -1], sampling)[0]
        p2 = next_token_probs(target_hf(torch.tensor([ids + [t] for t in range(4)])).logits[:, -1], sampling)
    joint = (p1[:, None] * p2).flatten()
    counts = torch.zeros(16)
    for seed in range(runs):
        tokens = speculative_decode(target, ids, max_new_tokens=4, sampling=sampling, seed=seed, k=2, **drafting)
        a, b = itertools.islice(tokens, 2)
        counts[a * 4 + b] += 1
    assert chi_square(counts, joint) < CHI2_CRITICAL_999[15]


@pytest.mark.long
def test_speculative_sampling_follows_target_distribution():
    """Against a draft model with a different distribution."""
    target_hf, draft_hf = tiny_hf_model("llama", seed=0, vocab_size=4), tiny_hf_model("llama", seed=1, vocab_size=4)
    target, draft = Transformer.from_hf(target_hf), Transformer.from_hf(draft_hf)
    assert_first_two_tokens_follow_the_target(target_hf, target, 1500, draft=draft)


@pytest.mark.parametrize("head", ["float", "int8"])
def test_a_draft_cut_to_part_of_the_vocabulary_drafts_only_from_it_and_changes_no_output(target, target_hf, head):
    from lmpress.runtime.kernels.cpu import kernel_name
    from lmpress.runtime.speculative import ModelDrafter, frequent_tokens, restrict_vocabulary

    quantized = copy.deepcopy(target_hf)
    head_scheme = {"ignore": [], "overrides": {"lm_head": {"bits": 8, "group_size": -1}}} if head == "int8" else {}
    lmpress.quantize_model(quantized, method="rtn", bits=4, group_size=32, **head_scheme)
    draft = Transformer.from_hf(quantized)
    assert kernel_name(draft.output) == ("int8" if head == "int8" else "dense")
    ids = prompt(seed=5)
    expected = generate(target, ids, max_new_tokens=40)[0]
    with torch.no_grad():
        whole = draft(torch.tensor([ids]), draft.new_cache(1, 32))
    # the prompt's and the answer's tokens but the answer's third: the round that needs it must reject
    tokens = frequent_tokens(torch.tensor(ids + expected), 48, 256)
    tokens = tokens[tokens != expected[2]]
    restrict_vocabulary(draft, tokens)
    with torch.no_grad():
        cut = draft(torch.tensor([ids]), draft.new_cache(1, 32))
    torch.testing.assert_close(cut, whole[..., tokens], rtol=1e-5, atol=1e-5)

    drafts, _ = ModelDrafter(draft, 64, SamplingConfig(), torch.Generator()).propose(ids, 8)
    assert len(drafts) == 8 and set(drafts) <= set(tokens.tolist())
    stats = SpeculativeStats()
    drafted = speculative_decode(target, ids, draft=draft, max_new_tokens=40, stats=stats, adaptive=False)
    assert list(drafted) == expected
    assert stats.accepted > 0
    sampling = SamplingConfig(temperature=0.8)  # drafts drawn from the cut vocabulary, verified over all of it
    assert len(list(speculative_decode(target, ids, draft=draft, max_new_tokens=40, sampling=sampling, seed=3))) == 40


def test_frequent_tokens_and_bad_draft_vocabularies(target_hf):
    from lmpress.runtime.speculative import frequent_tokens, restrict_vocabulary

    ids = torch.tensor([5, 7, 7, 9, 9, 9, 3])
    assert frequent_tokens(ids, 2, 16).tolist() == [7, 9]
    assert frequent_tokens(ids, 3, 16).tolist() == [3, 7, 9]  # 3 and 5 tie; the lower id wins
    assert frequent_tokens(ids, 5, 16).tolist() == [0, 3, 5, 7, 9]  # then unseen ids, lowest first
    with pytest.raises(LmpressInputError, match="1 to 16"):
        frequent_tokens(ids, 17, 16)
    draft = Transformer.from_hf(target_hf)
    with pytest.raises(LmpressInputError, match=r"token ids in \[0, 256\)"):
        restrict_vocabulary(draft, torch.tensor([1, 256]))
    w4_head = copy.deepcopy(target_hf)
    lmpress.quantize_model(w4_head, method="rtn", bits=4, group_size=32, ignore=[])
    with pytest.raises(LmpressInputError, match="only an int8 or float output layer.*this one is int4"):
        restrict_vocabulary(Transformer.from_hf(w4_head), torch.tensor([1, 2]))


def test_draft_with_another_vocabulary_is_input_error(target):
    other = Transformer.from_hf(tiny_hf_model("llama", vocab_size=300))
    with pytest.raises(LmpressInputError, match="vocabulary"):
        next(speculative_decode(target, prompt(), draft=other))


def test_tokenizers_must_match(target):
    from lmpress.runtime.speculative import check_same_vocabulary
    from tests.conftest import _train_tokenizer

    tok = _train_tokenizer()
    other = _train_tokenizer(300)
    check_same_vocabulary(target, target, tok, tok)
    with pytest.raises(LmpressInputError, match="tokenizer differs"):
        check_same_vocabulary(target, target, tok, other)


def test_bad_speculative_inputs(target):
    with pytest.raises(LmpressInputError, match="one prompt"):
        next(speculative_decode(target, [[1, 2], [3, 4]]))
    with pytest.raises(LmpressInputError, match="context"):
        next(speculative_decode(target, prompt(300)))
    with pytest.raises(LmpressInputError, match="k <= k_max"):
        next(speculative_decode(target, prompt(), k=9, k_max=8))
    with pytest.raises(LmpressInputError, match="top_p"):
        next(speculative_decode(target, prompt(), sampling=SamplingConfig(top_p=2.0)))
