"""Sampling, the generate loop (batches with left padding, stops, limits) and its bad inputs."""

from __future__ import annotations

import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.runtime.generate import FINISHED, generate, generate_tokens
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, apply_repetition_penalty, mask_top_k, mask_top_p, next_token_probs
from tests.runtime.conftest import tiny_hf_model


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.from_hf(tiny_hf_model("llama"))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_matches_transformers_generate():
    hf = tiny_hf_model("qwen2", seed=4)
    ids = prompt(12)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None)[0, 12:]
    assert generate(Transformer.from_hf(hf), ids, max_new_tokens=20) == [expected.tolist()]


def test_left_padded_batch_gives_each_prompts_own_tokens(model):
    prompts = [prompt(5, 1), prompt(17, 2), prompt(11, 3)]
    together = generate(model, prompts, max_new_tokens=15)
    alone = [generate(model, p, max_new_tokens=15)[0] for p in prompts]
    assert together == alone


def test_tokens_stream_one_step_at_a_time(model):
    steps = generate_tokens(model, [prompt(4), prompt(6)], max_new_tokens=3)
    first = next(steps)
    assert first.shape == (2,) and first.dtype == torch.long
    assert len(list(steps)) == 2


def test_eos_stops_its_row_only(model):
    ids = prompt(8)
    free = generate(model, ids, max_new_tokens=12)[0]
    eos = free[4]
    rows = list(generate_tokens(model, [ids, prompt(9, 5)], max_new_tokens=12, eos_token_id=eos))
    first_row = [int(step[0]) for step in rows]
    stop = free.index(eos)
    assert first_row[: stop + 1] == free[: stop + 1]
    assert all(token == FINISHED for token in first_row[stop + 1 :])


def test_stop_string_ends_generation():
    from tests.conftest import _train_tokenizer

    tokenizer = _train_tokenizer()
    model = Transformer.from_hf(tiny_hf_model("llama", vocab_size=len(tokenizer)))
    ids = tokenizer("def main():", add_special_tokens=False)["input_ids"]
    free = generate(model, ids, max_new_tokens=20)[0]
    text = tokenizer.decode(free)
    stop = text[len(tokenizer.decode(free[:10])) - 2 :][:3]  # a string that first completes around token 10
    stopped = generate(model, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer)[0]
    assert stop in tokenizer.decode(stopped) and stop not in tokenizer.decode(stopped[:-1])
    assert stopped == free[: len(stopped)] and len(stopped) < len(free)


def test_max_new_tokens_and_context_limit(model):
    assert len(generate(model, prompt(10), max_new_tokens=7)[0]) == 7
    context = model.args.max_seq_len
    # A prompt filling the context leaves room for exactly one token (it needs no cache slot).
    assert len(generate(model, prompt(context - 3), max_new_tokens=50)[0]) == 4


def test_seeded_sampling_reproduces(model):
    sampling = SamplingConfig(temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.1)
    runs = [generate(model, prompt(6), max_new_tokens=20, sampling=sampling, seed=s) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    kept = mask_top_k(logits, 2).isfinite()
    assert kept.tolist() == [[False, True, False, True, False]]


@pytest.mark.parametrize(("p", "kept"), [(0.5, 1), (0.7, 2), (0.8, 2), (0.81, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    mask = mask_top_p(probs.log(), p).isfinite()
    order = [1, 3, 0, 2]  # most to least likely
    assert mask[0, order].tolist() == [True] * kept + [False] * (4 - kept)


def test_sampling_distribution_renormalizes_the_kept_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = next_token_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.tensor([[1.0, torch.e**-1, 0, 0]]) / (1 + torch.e**-1)
    torch.testing.assert_close(probs, expected)
    greedy = next_token_probs(logits, SamplingConfig())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, FINISHED]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


@pytest.mark.parametrize(
    "settings",
    [{"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.1}, {"temperature": -1.0}, {"top_k": -3}, {"repetition_penalty": 0}],
)
def test_bad_sampling_settings(settings):
    with pytest.raises(LmpressInputError):
        SamplingConfig(**settings)


def test_bad_generate_inputs(model):
    with pytest.raises(LmpressInputError, match="more than the model's context of 256"):
        generate(model, prompt(257), max_new_tokens=1)
    with pytest.raises(LmpressInputError, match="empty"):
        generate(model, [[1, 2], []])
    with pytest.raises(LmpressInputError, match="max_new_tokens"):
        generate(model, [1, 2], max_new_tokens=0)
    with pytest.raises(LmpressInputError, match="tokenizer"):
        generate(model, [1, 2], stop_strings=["x"])


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_decode_step_equals_the_growing_cache(family):
    """The fixed-shape step (what torch.compile / CUDA graphs capture): same tokens, padded batch and sliding window."""
    from lmpress.runtime.generate import static_decode

    model = Transformer.from_hf(tiny_hf_model(family, seed=4, sliding_window=6 if family == "mistral" else None))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4, 5]]
    expected = generate(model, prompts, max_new_tokens=16)
    assert generate(model, prompts, max_new_tokens=16, decode=static_decode()) == expected


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_forward_over_a_few_tokens_equals_the_growing_cache(family):
    """A speculative round's read (several tokens at once) through the fixed-shape step: same logits as the
    model's own forward, for a left-padded batch and past a sliding window."""
    from lmpress.runtime.generate import left_pad, static_forward

    model = Transformer.from_hf(tiny_hf_model(family, seed=4, sliding_window=6 if family == "mistral" else None))
    tokens, pad = left_pad([prompt(10, seed=1), prompt(3, seed=2)])
    step = static_forward()
    for n in (1, 2, 5):
        caches = [model.new_cache(2, 24, pad) for _ in range(2)]
        for cache in caches:
            model(tokens, cache)
        reads = [torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(n)) for _ in range(2)]
        for read in reads:  # two reads in a row: the second attends to the first's slots
            expected = model(read, caches[0]).float()
            actual = step(model, read, caches[1])
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        assert caches[1].length == caches[0].length == 10 + 2 * n


@pytest.mark.slow
def test_compiled_decode_equals_eager_for_each_model_it_serves():
    """One compiled step serving two models whose caches have the same shape (only their widths differ):
    each must run its own graph, since the step does not guard on the model's parameters."""
    from lmpress.runtime.generate import compiled_decode

    decode = compiled_decode()
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    for model in (
        Transformer.from_hf(tiny_hf_model("llama", seed=4)),
        Transformer.from_hf(tiny_hf_model("llama", seed=5, intermediate_size=192, vocab_size=300)),
    ):
        assert generate(model, prompts, max_new_tokens=12, decode=decode) == generate(model, prompts, max_new_tokens=12)


@pytest.mark.slow
def test_compiled_forward_reads_every_token_count_as_eager_at_two_cache_sizes():
    """Counts up to STATIC_TOKENS run graphs of their own and longer ones a symbolic graph; a second cache
    size recompiles them. Every read must give the eager forward's logits and leave the cache as it does."""
    from lmpress.runtime.generate import STATIC_TOKENS, compiled_forward

    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    forward = compiled_forward()
    for max_len in (40, 56):
        for n in range(1, STATIC_TOKENS + 3):
            caches = [model.new_cache(1, max_len) for _ in range(2)]
            for cache in caches:
                model(torch.tensor([prompt(9, seed=n)]), cache)
            read = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(n))
            expected = model(read, caches[0]).float()
            torch.testing.assert_close(forward(model, read, caches[1]), expected, rtol=1e-4, atol=1e-4)
            assert caches[1].length == caches[0].length == 9 + n


@pytest.mark.long
def test_the_compiled_forward_reads_tokens_of_any_layout_as_eager():
    """A direct call runs the graph dynamo built for the tokens' strides: one cache read in turn through slices of
    a wider tensor (row stride 40) and through tensors of their own (row stride 1), batch 2, gives eager's logits
    at every read."""
    from lmpress.runtime.generate import compiled_forward

    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    forward = compiled_forward()
    wide = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    caches = [model.new_cache(2, 48) for _ in range(2)]
    for cache in caches:
        model(wide[:, :8], cache)
    for i in range(8, 16):
        read = wide[:, i : i + 1] if i % 4 < 2 else wide[:, i : i + 1].clone()
        expected = model(read, caches[0]).float()
        torch.testing.assert_close(forward(model, read, caches[1]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["to the end", "closed early", "speculative"])
def test_a_generation_hands_its_memory_back_once_its_cache_is_freed(model, monkeypatch, how):
    # glibc keeps freed heap pages resident until trimmed: the trim must come after the decode loop's
    # frame (which holds the KV cache) is gone, whether the loop finished or its consumer stopped early
    import weakref

    import lmpress.memory
    from lmpress.runtime.speculative import speculative_decode

    caches, cache_alive_at_trim = [], []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **k: caches.append(weakref.ref(c := new_cache(*a, **k))) or c)
    monkeypatch.setattr(lmpress.memory, "trim_c_heap", lambda: cache_alive_at_trim.append(caches[0]() is not None))
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    if how == "speculative":
        list(speculative_decode(model, prompt, max_new_tokens=6))
    else:
        tokens = generate_tokens(model, prompt, max_new_tokens=6)
        if how == "closed early":
            next(tokens)
            tokens.close()
        else:
            list(tokens)
    assert caches and cache_alive_at_trim == [False]


def family_runtime(family: str) -> Transformer:
    from transformers import AutoModelForCausalLM

    from tests.families import randomize_norms, tiny_config

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(
        tiny_config(family, 300, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    ).eval()
    randomize_norms(hf, 3)
    return Transformer.from_hf(hf)


RUNTIME_FAMILIES = [family for family in __import__("tests.families").families.FAMILIES if family != "opt"]
SAMPLED = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2)


@pytest.mark.long
@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
def test_the_sampling_step_traces_whole_and_decodes_eagers_tokens(family):
    """Plain decoding's step (the one-token read and the choice of the next token) traces as one graph with no
    break (``fullgraph``) for every family the runtime runs, and its tokens are eager decoding's: greedy, and sampled
    with top-k, top-p and a repetition penalty from the same seed (the same draws)."""
    from lmpress.runtime.generate import compiled_step
    from lmpress.runtime.model import MOE_TYPES

    model = family_runtime(family)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    step = compiled_step(backend="eager")
    if family in MOE_TYPES:  # routing has shapes known only at run time: the step runs eagerly, said once
        with pytest.warns(UserWarning, match="runs eagerly: its mixture-of-experts layers"):
            generate(model, prompts, max_new_tokens=2, step=step)
    assert generate(model, prompts, max_new_tokens=10, step=step) == generate(model, prompts, max_new_tokens=10)
    sampled = dict(max_new_tokens=10, sampling=SAMPLED, seed=3)
    assert generate(model, prompts, step=step, **sampled) == generate(model, prompts, **sampled)


@pytest.mark.long
def test_the_compiled_sampling_step_decodes_eagers_tokens_calling_its_graph_directly(monkeypatch):
    """The same through Inductor (what ``lmpress generate --compile`` and ``lmpress bench --compile`` run): on the
    CPU each token after a generation's first runs the graph without dynamo (``direct_graph``), with eager's tokens,
    greedy and sampled, and for a second generation (another cache) too."""
    from lmpress.runtime import direct_graph
    from lmpress.runtime.generate import compiled_step

    direct_calls = []
    call = direct_graph.Binding.__call__
    monkeypatch.setattr(
        direct_graph.Binding, "__call__", lambda self, named: direct_calls.append(1) or call(self, named)
    )
    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    step = compiled_step()
    for max_new_tokens in (12, 7):
        direct_calls.clear()
        expected = generate(model, prompts, max_new_tokens=max_new_tokens)
        assert generate(model, prompts, max_new_tokens=max_new_tokens, step=step) == expected
        assert len(direct_calls) == max_new_tokens - 2  # the prefill gives the first token, dynamo the second
    sampled = dict(max_new_tokens=12, sampling=SAMPLED, seed=5)
    assert generate(model, prompts, step=step, **sampled) == generate(model, prompts, **sampled)


def test_the_exponential_race_draws_from_next_token_probs():
    """``next_token``'s sampled token (argmax of p / Exp(1) noise, on the device) is distributed as
    ``next_token_probs`` says, after temperature, top-k and top-p; a chi-square test at p = 0.001 with power
    (the untempered distribution fails it by far)."""
    from lmpress.runtime.sample import make_generator, next_token, step_noise
    from tests.runtime.test_speculative import chi_square

    chi2_critical_999 = {3: 16.266, 4: 18.467, 5: 20.515}  # by degrees of freedom

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    config = SamplingConfig(temperature=0.7, top_k=6, top_p=0.97)
    probs = next_token_probs(logits, config)[0]
    kept = probs > 0
    generator = make_generator(0)
    counts = torch.zeros(8)
    for _ in range(4000):
        counts[next_token(logits, config, step_noise(config, (1, 8), generator, torch.device("cpu")))] += 1
    assert counts[~kept].sum() == 0
    dof = int(kept.sum()) - 1
    assert chi_square(counts[kept], probs[kept]) < chi2_critical_999[dof]
    untempered = next_token_probs(logits, SamplingConfig(temperature=1.0, top_k=6, top_p=0.97))[0]
    assert chi_square(counts[kept], untempered[kept]) > 10 * chi2_critical_999[dof]


def test_a_device_decodes_ahead_of_the_host_and_stops_where_eager_does(model):
    """Read every few tokens after the first (a GPU's default, ``DEVICE_READ_EVERY``), the host sees the same tokens
    and stops: the steps run ahead of what it has read, an EOS inside a read ends the row there, and nothing after a
    stop is yielded."""
    from lmpress.runtime.generate import DEVICE_READ_EVERY, read_every_for, sampled

    assert read_every_for(torch.device("cpu")) == 1 and read_every_for(torch.device("cuda")) == DEVICE_READ_EVERY > 1
    ids = [prompt(8), prompt(9, 5)]
    free = generate(model, ids[0], max_new_tokens=20)[0]
    calls = []

    def counted(model, token, cache, sampling, noise, history):
        calls.append(1)
        return sampled()(model, token, cache, sampling, noise, history)

    steps = generate_tokens(model, ids, max_new_tokens=20, step=counted, read_every=4)
    assert next(steps).tolist()[0] == free[0] and calls == []  # the first token read as soon as it exists
    assert next(steps).tolist()[0] == free[1] and len(calls) == 3  # then three steps decoded per read
    for eos in (free[5], free[-1]):
        rows = [r.tolist() for r in generate_tokens(model, ids, max_new_tokens=20, eos_token_id=eos, read_every=4)]
        every = generate_tokens(model, ids, max_new_tokens=20, eos_token_id=eos, read_every=1)
        assert rows == [r.tolist() for r in every]
    both_stop = list(generate_tokens(model, ids[:1], max_new_tokens=20, eos_token_id=free[5], read_every=4))
    assert [int(r[0]) for r in both_stop] == free[: free.index(free[5]) + 1]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED])
def test_decoding_on_a_device_keeps_the_tokens_there_and_gives_the_cpus(model, sampling):
    """On an accelerator (the fake device: any op mixing it with a CPU tensor fails as on CUDA) the history, the
    noise and every step stay on the device, the host reading them in chunks: the tokens are the CPU's."""
    from tests.fake_device import fake_accelerator

    hf = tiny_hf_model("llama")
    ids = [prompt(8), prompt(5, 2)]
    expected = generate(Transformer.from_hf(hf), ids, max_new_tokens=20, sampling=sampling, seed=1)
    with fake_accelerator() as device:
        on_device = Transformer.from_hf(hf, device=device, kernels="cpu")
        assert generate(on_device, ids, max_new_tokens=20, sampling=sampling, seed=1) == expected
