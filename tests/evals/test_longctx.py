import copy
import re

import pytest
import torch

import lmpress
from lmpress.errors import LmpressInputError
from lmpress.evals import longctx
from lmpress.evals.longctx import (
    PasskeyConfig,
    PositionNLLConfig,
    answered_key,
    greedy_decode,
    length_label,
    passkey_prompt,
    passkey_trials,
    run_passkey,
    run_position_nll,
)
from lmpress.metrics import token_nll
from lmpress.runtime.generate import generate_tokens
from lmpress.runtime.model import Transformer
from tests.evals.conftest import make_ctx

SMALL = PasskeyConfig(lengths=[256, 384, 512], depths=[0, 0.5, 1], trials=2, max_new_tokens=4)


def test_prompt_fits_and_hides_the_key_at_its_depth(tiny):
    _, tokenizer = tiny
    for length in SMALL.lengths:
        positions = []
        for depth in SMALL.depths:
            ids = passkey_prompt(tokenizer, length, depth, 48151, answer_room=4)
            assert len(ids) == length - 4
            text = tokenizer.decode(ids)
            assert text.count("48151") == 2 and text.endswith("The pass key is")
            positions.append(text.index("48151"))
            if depth == 0:
                assert text.startswith(longctx.INTRO + longctx.NEEDLE.format(key=48151))
            if depth == 1:
                assert text.endswith(longctx.NEEDLE.format(key=48151) + longctx.QUESTION)
        assert positions == sorted(positions) and len(set(positions)) == 3


def test_same_seed_same_keys_other_seed_other_keys():
    keys = [k for *_, k in passkey_trials(SMALL)]
    assert keys == [k for *_, k in passkey_trials(SMALL.model_copy())]
    assert keys != [k for *_, k in passkey_trials(SMALL.model_copy(update={"seed": 1}))]
    assert len(keys) == 3 * 3 * 2 and all(10000 <= k <= 99999 for k in keys)


def test_answered_key():
    assert answered_key(" 48151. Remember") == 48151
    assert answered_key(" 4815 1") == 4815
    assert answered_key(" unknown") is None


def test_greedy_decode_runs_on_the_runtime_and_matches_hf_generate(tiny, monkeypatch):
    model, tokenizer = tiny
    prompt = passkey_prompt(tokenizer, 256, 0.5, 12345, answer_room=6)
    runtime_calls = []
    monkeypatch.setattr(longctx, "generate_tokens", lambda *a, **k: runtime_calls.append(1) or generate_tokens(*a, **k))
    ours = greedy_decode(model, prompt, 6, eos_id=None)
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, len(prompt) :]
    assert ours == reference.tolist() and runtime_calls == [1]


def test_runtime_view_shares_the_models_layers(tiny):
    from lmpress.weights.qlinear import QuantizedLinear

    model, _ = tiny
    runtime = Transformer.sharing(model)
    assert runtime.layers[0].attention.wqkv.parts[0] is model.model.layers[0].self_attn.q_proj
    quantized = copy.deepcopy(model)
    lmpress.quantize_model(quantized, method="rtn", bits=4, group_size=32)
    view = Transformer.sharing(quantized)
    mlp = quantized.model.layers[1].mlp
    assert isinstance(mlp.down_proj, QuantizedLinear) and view.layers[1].feed_forward.w2.parts[0] is mlp.down_proj
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(view(ids, view.new_cache(1, 20)), quantized(ids).logits, atol=1e-4, rtol=1e-4)


def test_passkey_scores_exact_matches_into_the_grid(tiny, docs_text, tmp_path, monkeypatch):
    """A stand-in decoder that answers right only at depth 0 and 0.5 of the shortest length."""
    model, tokenizer = tiny

    def fake_decode(model, prompt, max_new_tokens, eos_id, runtime=None):
        text = tokenizer.decode(prompt)
        key = re.search(r"pass key is (\d+)", text).group(1)
        depth = text.index(key) / len(text)
        right = len(prompt) < 256 and depth < 0.7
        return tokenizer(f" {key if right else '11111'}.", add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(longctx, "greedy_decode", fake_decode)
    result = run_passkey(model, tokenizer, SMALL, make_ctx(docs_text, tokenizer, "candidate", tmp_path))
    assert result.metrics["passkey_accuracy_256"] == pytest.approx(2 / 3)
    assert result.metrics["passkey_accuracy_384"] == result.metrics["passkey_accuracy_512"] == 0
    assert result.metrics["passkey_accuracy"] == pytest.approx(4 / 18)
    assert result.details["passkey_grid"]["accuracy"] == [[1.0, 0, 0], [1.0, 0, 0], [0, 0, 0]]
    assert set(result.metrics) == set(SMALL.metric_names())
    assert result.protocol["seed"] == 0 and result.protocol["lengths"] == [256, 384, 512]


class ScriptedAnswer(torch.nn.Module):
    """The tiny model with its greedy choice overridden: it reads the pass key from the prompt and spells
    ``" {answer(key)}."`` one token per step, then EOS.

    Its forward runs the real model (prefill, then one token at a time on the KV cache) and only replaces the
    logits, so ``run_passkey`` goes through the real prompt, ``greedy_decode``, decoding, matching and averaging.
    """

    def __init__(self, model, tokenizer, answer) -> None:
        super().__init__()
        self.model, self.config, self.tokenizer, self.answer = model, model.config, tokenizer, answer
        self.script: list[int] = []
        self.emitted: int | None = None

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        out = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)
        if past_key_values is None:  # a new prompt
            key = int(re.search(r"pass key is (\d+)", self.tokenizer.decode(input_ids[0])).group(1))
            self.script = self.tokenizer(f" {self.answer(key)}.", add_special_tokens=False)["input_ids"]
            self.script.append(self.tokenizer.eos_token_id)
        else:  # the decoder must feed back the token it was given
            assert input_ids.tolist() == [[self.emitted]]
        self.emitted = self.script.pop(0)
        out.logits = torch.full_like(out.logits, -1e4)
        out.logits[:, -1, self.emitted] = 0
        return out


PASSKEY_GRID = PasskeyConfig(lengths=[256, 384], depths=[0, 0.5, 1], trials=2, max_new_tokens=8)


def low_key(key: int) -> bool:
    return key < 50000


@pytest.mark.parametrize(
    "answer, right",
    [
        (lambda key: key, lambda key: True),
        (lambda key: key + 1, lambda key: False),
        (lambda key: key // 10, lambda key: False),  # the key less its last digit
        (lambda key: key if low_key(key) else key + 1, low_key),
    ],
    ids=["copies", "off-by-one", "truncated", "low-keys-only"],
)
def test_passkey_accuracy_through_the_real_decoder_on_known_answers(tiny, docs_text, tmp_path, answer, right):
    model, tokenizer = tiny
    scripted = ScriptedAnswer(model, tokenizer, answer)
    result = run_passkey(scripted, tokenizer, PASSKEY_GRID, make_ctx(docs_text, tokenizer, "candidate", tmp_path))

    # What each prompt's answer should score, from the keys alone.
    trials = passkey_trials(PASSKEY_GRID)
    expected = {(n, d, t): right(key) for n, d, t, key in trials}
    samples = result.details["passkey_samples"]
    assert [(s["length"], s["depth"], s["trial"], s["key"]) for s in samples] == trials
    for s in samples:
        assert s["answer"].startswith(f" {answer(s['key'])}.")
        assert s["prompt_tokens"] == s["length"] - PASSKEY_GRID.max_new_tokens
        assert s["correct"] is expected[s["length"], s["depth"], s["trial"]]
    mean = lambda cells: sum(cells) / len(cells)
    assert result.metrics["passkey_accuracy"] == mean(list(expected.values()))
    for n in PASSKEY_GRID.lengths:
        label = f"passkey_accuracy_{length_label(n)}"
        assert result.metrics[label] == mean([ok for (length, _, _), ok in expected.items() if length == n])
    assert result.details["passkey_grid"]["accuracy"] == [
        [mean([expected[n, d, t] for t in range(PASSKEY_GRID.trials)]) for n in PASSKEY_GRID.lengths]
        for d in PASSKEY_GRID.depths
    ]


def test_passkey_known_answers_cover_a_mixed_outcome():
    """With PASSKEY_GRID's keys, the low-keys-only case above scores differently per length and in some cell
    between 0 and 1, so it checks each average over its own prompts, not just all-or-none."""
    right = {(n, d, t): low_key(key) for n, d, t, key in passkey_trials(PASSKEY_GRID)}
    per_length = {sum(ok for (n, _, _), ok in right.items() if n == length) for length in PASSKEY_GRID.lengths}
    assert len(per_length) == len(PASSKEY_GRID.lengths) and 0 < sum(right.values()) < len(right)
    cells = [
        [right[n, d, t] for t in range(PASSKEY_GRID.trials)] for n in PASSKEY_GRID.lengths for d in PASSKEY_GRID.depths
    ]
    assert any(0 < sum(cell) < len(cell) for cell in cells)


def test_passkey_longer_than_context_is_refused(tiny, docs_text, tmp_path):
    model, tokenizer = tiny
    config = PasskeyConfig(lengths=[256, 1024])
    with pytest.raises(LmpressInputError, match=r"\[1024\] exceed the model's context of 512"):
        run_passkey(model, tokenizer, config, make_ctx(docs_text, tokenizer, "baseline", tmp_path))


def test_nll_by_position_matches_direct_computation(tiny, docs_text, tmp_path):
    model, tokenizer = tiny
    config = PositionNLLConfig(seq_len=512, documents=2, edges=[0, 64, 256, 1024])
    assert config.metric_names() == ["nll_pos_0_64", "nll_pos_64_256", "nll_pos_256_512"]
    ctx = make_ctx(docs_text, tokenizer, "baseline", tmp_path)
    result = run_position_nll(model, tokenizer, config, ctx)
    docs = ctx.ids()[:1024].view(2, 512)
    with torch.no_grad():
        nll = token_nll(model(docs).logits, docs)  # nll[:, t] predicts the token at position t + 1
    for (a, b), name in zip(config.buckets(), config.metric_names(), strict=True):
        expected = nll[:, max(a, 1) - 1 : b - 1].mean().item()
        assert result.metrics[name] == pytest.approx(expected, rel=1e-5)
    assert [row["bucket"] for row in result.details["nll_by_position"]] == ["0-64", "64-256", "256-512"]
    assert result.protocol["seq_len"] == 512 and result.protocol["windows"] == 2


def test_nll_by_position_longer_than_context_is_refused(tiny):
    model, _ = tiny
    with pytest.raises(LmpressInputError, match="exceeds the model's context of 512"):
        PositionNLLConfig(seq_len=1024).check(model)


def test_bad_configs():
    with pytest.raises(ValueError, match="between 0 and 1"):
        PasskeyConfig(depths=[0.5, 1.5])
    with pytest.raises(ValueError, match="start at 0"):
        PositionNLLConfig(edges=[512, 1024])
    assert PositionNLLConfig(seq_len=8192).metric_names()[-1] == "nll_pos_4k_8k"
