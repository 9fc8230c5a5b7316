"""A quantized KV cache end to end on tiny random models: FP8 scales calibrated as a min/max observer would, the
evaluator's attention over the cache as the runtime holds it (the same logits, eager, static and compiled), the
recipe's ``kv_cache:`` section through ``lmpress run``, and its bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from lmpress.cli import main
from lmpress.quantize.kv_attention import calibrate_kv_scales, kv_quantized
from lmpress.runtime.generate import compiled_forward, generate, model_forward, static_forward
from lmpress.runtime.model import Transformer
from lmpress.weights.kv_quant import KVQuant, KVScheme, fake_quantize_kv
from tests.runtime.conftest import tiny_hf_model

SCHEMES = [
    KVScheme("int8", "token"),
    KVScheme("int4", "token"),
    KVScheme("int4", "channel"),
    KVScheme("fp8", "tensor"),
    KVScheme("fp8", "head"),
]


def ids(n: int = 40, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def post_rope_kv(model, tokens: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys (after RoPE) and values, from transformers' own cache: an independent record."""
    out = model(tokens, use_cache=True)
    cache = out.past_key_values
    return {i: (layer.keys, layer.values) for i, layer in enumerate(cache.layers)}


def evaluator_steps(hf, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """transformers' logits for ``tokens`` after the first ``prompt``, read one at a time over its own cache."""
    out = hf(tokens[:, :prompt], use_cache=True)
    steps, cache = [], out.past_key_values
    for i in range(prompt, tokens.shape[1]):
        out = hf(tokens[:, i : i + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1])
        cache = out.past_key_values
    return torch.stack(steps, 1)


@pytest.mark.parametrize("scales", ["tensor", "head"])
def test_fp8_scales_are_the_calibration_sets_largest_key_and_value_over_448(scales):
    model = tiny_hf_model("llama")
    samples = ids(32, batch=5)
    kv = calibrate_kv_scales(model, samples, KVScheme("fp8", scales), batch_size=2)
    with torch.no_grad():
        seen = post_rope_kv(model, samples)
    for layer, (keys, values) in seen.items():
        for got, x in [(kv.k_scales[layer], keys), (kv.v_scales[layer], values)]:
            amax = x.abs().amax((0, 2, 3))
            want = (amax.amax().reshape(1) if scales == "tensor" else amax) / 448
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_int8_needs_no_calibration():
    kv = calibrate_kv_scales(tiny_hf_model("llama"), ids(), KVScheme("int8", "token"))
    assert kv.k_scales is None and kv.v_scales is None


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.scales}")
def test_the_evaluator_and_the_runtime_read_the_same_quantized_cache(scheme):
    """The evaluator (transformers under kv_quantized) and the runtime's prefill over a quantized cache give
    the same logits; its one-token steps (eager and the static step) read what the evaluator's own one-token
    steps read (grouped keys: a group of 32 fills at the step of token 31). INT4 runs in float64: its 16 levels turn
    a last-bit difference between two float32 projections into a whole code step (on a Zen 4 EPYC, one value's code
    at token 39 flipped between transformers' v_proj and the runtime's fused q/k/v product: 0.0056 in the logits),
    where no float64 input sits that close to a boundary; the cache op (int8, FP8) is float32's, tested in float32."""
    hf = tiny_hf_model("llama").to(torch.float64 if scheme.dtype == "int4" else torch.float32)
    tokens = ids()
    kv = calibrate_kv_scales(hf, tokens, scheme)
    with torch.no_grad():
        float_logits = hf(tokens).logits
        with kv_quantized(hf, kv):
            evaluator = hf(tokens).logits.float()  # the runtime's logits are float32 whatever its weights
            so_far = evaluator_steps(hf, tokens, 28).float()
            runtime = Transformer.sharing(hf)
    assert runtime.kv_quant is kv
    assert float((evaluator - float_logits).abs().max()) > 1e-4  # the cache is quantized, visibly
    prefill = model_forward(runtime, tokens, runtime.new_cache(2, 64))
    torch.testing.assert_close(prefill, evaluator, rtol=0, atol=1e-5)
    for forward in (model_forward, static_forward()):
        cache = runtime.new_cache(2, 64)
        model_forward(runtime, tokens[:, :28], cache)
        steps = torch.cat([forward(runtime, tokens[:, i : i + 1], cache) for i in range(28, 40)], dim=1)
        torch.testing.assert_close(steps, so_far, rtol=0, atol=1e-3)


def test_rotating_queries_and_keys_changes_no_score():
    """KVQuant.rotate turns queries and keys by one orthogonal matrix: with a float cache the logits stay."""
    from lmpress.quantize.kv_attention import rotate_queries_and_keys

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 32, generator=g), torch.randn(2, 4, 9, 32, generator=g)
    rq, rk = rotate_queries_and_keys(q, k)
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=0, atol=1e-5)
    assert float((rk - k).abs().max()) > 0.1


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.scales}")
def test_a_rotated_cache_reads_the_same_in_the_evaluator_and_the_runtime(scheme):
    hf = tiny_hf_model("llama")
    tokens = ids()
    kv = calibrate_kv_scales(hf, tokens, scheme, rotate=True)
    assert kv.rotate
    with torch.no_grad(), kv_quantized(hf, kv):
        evaluator = hf(tokens).logits
        runtime = Transformer.sharing(hf)
        so_far = evaluator_steps(hf, tokens, 30)
    prefill = model_forward(runtime, tokens, runtime.new_cache(2, 64))
    torch.testing.assert_close(prefill, evaluator, rtol=0, atol=1e-5)
    cache = runtime.new_cache(2, 64)
    model_forward(runtime, tokens[:, :30], cache)
    steps = torch.cat([static_forward()(runtime, tokens[:, i : i + 1], cache) for i in range(30, 40)], dim=1)
    torch.testing.assert_close(steps, so_far, rtol=0, atol=1e-3)
    if scheme.static:  # the scales are the rotated keys' (values are not rotated)
        plain = calibrate_kv_scales(hf, tokens, scheme)
        assert not torch.equal(kv.k_scales[0], plain.k_scales[0])
        torch.testing.assert_close(kv.v_scales[0], plain.v_scales[0])


def test_the_runtime_cache_stores_codes_and_says_its_bytes_per_token():
    runtime = Transformer.from_hf(tiny_hf_model("llama"))
    float_cache = runtime.new_cache(1, 64)
    runtime.kv_quant = KVQuant(KVScheme("int8", "token"))
    cache = runtime.new_cache(1, 64)
    assert {t.dtype for t in cache.k + cache.v} == {torch.int8}
    head_dim = runtime.args.head_dim
    assert cache.bytes_per_token / float_cache.bytes_per_token == pytest.approx((head_dim + 4) / (4 * head_dim))
    model_forward(runtime, ids(10, batch=1), cache)
    keys = cache.k[0][:, :, :10]
    assert keys.abs().amax(-1).eq(127).all()  # every written token's largest entry at ±127


@pytest.mark.long
@pytest.mark.parametrize(
    "kv",
    [
        KVQuant(KVScheme("fp8", "tensor"), [torch.tensor([0.05])] * 2, [torch.tensor([0.02])] * 2),
        KVQuant(KVScheme("int4", "channel")),  # a group fills at token 31
    ],
    ids=["fp8", "int4-channel"],
)
def test_the_compiled_step_reads_the_quantized_cache_as_the_eager_one(kv):
    """Inductor's arithmetic differs from eager's in the last bits, which can move a 4-bit code across a rounding
    boundary (one step, then carried to later tokens): a few codes in a hundred may differ, and the logits by that.
    A wrong read (a group's float keys missing, codes read for the unfinished group) moves them by far more."""
    four_bit = kv.scheme.dtype == "int4"
    hf = tiny_hf_model("llama")
    runtime = Transformer.sharing(hf)
    runtime.kv_quant = kv
    tokens = ids(36, batch=1)
    eager_cache, compiled_cache = runtime.new_cache(1, 48), runtime.new_cache(1, 48)
    model_forward(runtime, tokens[:, :28], eager_cache)
    model_forward(runtime, tokens[:, :28], compiled_cache)
    step = compiled_forward()
    for i in range(28, 36):
        eager = model_forward(runtime, tokens[:, i : i + 1], eager_cache)
        compiled = step(runtime, tokens[:, i : i + 1], compiled_cache)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0.05 if four_bit else 1e-4)
    for layer in range(2):
        same = compiled_cache.k[layer].view(torch.uint8)[:, :, :32] == eager_cache.k[layer].view(torch.uint8)[:, :, :32]
        assert float(same.float().mean()) >= (0.98 if four_bit else 1.0)


def test_greedy_decoding_on_a_quantized_cache_follows_the_evaluators_argmax():
    hf = tiny_hf_model("llama")
    kv = KVQuant(KVScheme("int8", "token"))
    prompt = ids(16, batch=1)[0].tolist()
    with torch.no_grad(), kv_quantized(hf, kv):
        runtime = Transformer.sharing(hf)
        tokens = generate(runtime, prompt, max_new_tokens=6)[0]
        full = torch.tensor([prompt + tokens])
        expected = hf(full).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert tokens == expected


def test_the_quantized_attention_quantizes_keys_after_rope():
    """What the evaluator's kernel receives is post-RoPE (transformers' cache holds the same): quantizing those
    by hand and running the float kernel gives the kernel's result (one layer: its inputs are the float model's)."""
    hf = tiny_hf_model("llama", num_hidden_layers=1)
    tokens = ids(20, batch=1)
    scheme = KVScheme("int8", "token")
    seen = {}
    with torch.no_grad():
        record = post_rope_kv(hf, tokens)
        with kv_quantized(hf, KVQuant(scheme)):
            for layer, (keys, values) in record.items():
                seen[layer] = fake_quantize_kv(keys, scheme), fake_quantize_kv(values, scheme)
            got = hf(tokens).logits

    def kernel_with_recorded_kv(module, query, key, value, *args, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        k, v = seen[module.layer_idx]
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, k, v, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register("test_recorded_kv", kernel_with_recorded_kv)
    before = hf.config._attn_implementation
    hf.config._attn_implementation = "test_recorded_kv"
    try:
        with torch.no_grad():
            want = hf(tokens).logits
    finally:
        hf.config._attn_implementation = before
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# lmpress run with kv_cache: ------------------------------------------------------------------------------------


def kv_recipe(tmp_path, model_dir, kv_cache, **changes) -> str:
    recipe: dict = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "rtn", "bits": 8, "group_size": 32}],
        "export": {"formats": ["hf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2}},
        "gates": ["ppl_ratio <= 1.05"],
        "kv_cache": kv_cache,
        **changes,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.usefixtures("private_cache")
def test_a_recipe_with_an_fp8_kv_cache_scores_and_reports_it(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["run", kv_recipe(tmp_path, tiny_llama_dir, {"dtype": "fp8"}), "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    kv = report["kv_cache"]
    assert kv["scheme"] == "FP8 KV, static per tensor, calibrated"
    assert kv["ratio_to_bf16"] == pytest.approx(0.5)
    assert report["runtime_agreement"]["passed"], report["runtime_agreement"]
    base, cand = report["baseline"]["metrics"]["ppl"], report["candidate"]["metrics"]["ppl"]
    assert cand != base  # the candidate's cache was quantized (weights at 8 bits move it too)
    assert "kv_cache" in report["recipe"]


@pytest.mark.long
@pytest.mark.usefixtures("private_cache")
def test_a_run_scores_its_weights_on_a_float_cache_beside_its_quantized_one(tiny_llama_dir, tmp_path):
    """With ``kv_cache:`` the perplexity, passkey and position evals run once more on the candidate with a float
    cache: the numbers of the same recipe run without ``kv_cache:``, shown and plotted beside the quantized cache's."""
    long_context = {
        "text": "builtin:python-docs",
        "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2},
        "ppl_by_position": {"seq_len": 512, "documents": 1, "edges": [0, 128, 256, 512]},
        "passkey": {"lengths": [256, 512], "depths": [0.0, 1.0]},
    }
    runs = {}
    for name, kv_cache in (("int4", {"dtype": "int4", "scales": "token"}), ("float", None)):
        (tmp_path / name).mkdir()
        recipe = kv_recipe(tmp_path / name, tiny_llama_dir, kv_cache, eval=long_context)
        assert main(["run", recipe, "--out", str(tmp_path / name / "run"), "--quiet"]) in (0, 1)
        runs[name] = json.loads((tmp_path / name / "run" / "report.json").read_text())
    quantized, floats = runs["int4"], runs["float"]
    assert "candidate_float_cache" not in floats
    side = quantized["candidate_float_cache"]["metrics"]
    numbers = lambda metrics: {k: v for k, v in metrics.items() if not k.endswith("_per_s")}  # noqa: E731 - not speed
    assert numbers(side) == numbers(floats["candidate"]["metrics"])  # the same weights, read back, on a float cache
    assert side["ppl"] != quantized["candidate"]["metrics"]["ppl"]  # the INT4 cache moves it
    assert set(side) == set(quantized["candidate"]["metrics"])  # every eval here is one a cache moves
    text = (tmp_path / "int4" / "run" / "report.md").read_text()
    assert "weights, float cache | weights + INT4 KV, per token and head" in text
    assert "![NLL by position bucket](nll_by_position.png)" in text
    assert "candidate eval, float cache" in quantized["phases"]
    assert "candidate eval, float cache" in quantized["memory_forecast_phases_mb"]


@pytest.mark.parametrize(
    ("kv_cache", "message"),
    [
        ({"dtype": "int2"}, "kv_cache.dtype: 'int2' is not one of 'fp8', 'int8', 'int4'"),
        ({"dtype": "int8", "scales": "tensor"}, "kv_cache: an int8 KV cache takes scales token, not 'tensor'"),
        ({"dtype": "fp8", "group": 4}, "kv_cache.group: unknown key"),
        (
            {"dtype": "fp8", "rotate": True, "EXPORT": ["compressed-tensors"]},
            "kv_cache.rotate: a compressed-tensors export would hand vLLM rotated-key scales",
        ),
    ],
)
def test_a_bad_kv_cache_section_exits_2_with_one_line(tiny_llama_dir, tmp_path, capsys, kv_cache, message):
    kv_cache = dict(kv_cache)
    export = {"formats": kv_cache.pop("EXPORT", ["hf"])}
    recipe = kv_recipe(tmp_path, tiny_llama_dir, kv_cache, export=export)
    assert main(["run", recipe, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.usefixtures("private_cache")
def test_generate_with_a_quantized_cache_from_the_command_line(tiny_llama_dir, capsys):
    """``lmpress generate --kv-cache int8`` decodes on the quantized cache: greedy tokens are the evaluator's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = ["generate", str(tiny_llama_dir), "--prompt", "def main():", "--max-new-tokens", "6"]
    assert main([*args, "--kv-cache", "int8"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    prompt = tokenizer("def main():", add_special_tokens=False)["input_ids"]
    with torch.no_grad(), kv_quantized(hf, KVQuant(KVScheme("int8", "token"))):
        expected = generate(Transformer.sharing(hf), prompt, max_new_tokens=6)[0]
    assert text == tokenizer.decode(expected)
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: one line naming the choices
        main([*args, "--kv-cache", "int2"])
    assert refused.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err


def test_speculative_decoding_on_a_quantized_cache_gives_plain_greedy_tokens():
    """Verification reads and rolls back the same quantized cache: greedy speculative tokens equal greedy ones."""
    from lmpress.runtime.speculative import speculative_decode

    target = Transformer.from_hf(tiny_hf_model("llama"))
    draft = Transformer.from_hf(tiny_hf_model("llama", seed=1))
    target.kv_quant = KVQuant(KVScheme("int4", "token"), rotate=True)
    prompt = ids(12, batch=1)[0].tolist()
    plain = generate(target, prompt, max_new_tokens=20)[0]
    assert list(speculative_decode(target, prompt, draft=draft, max_new_tokens=20)) == plain


def test_a_quantized_cache_lives_on_the_models_device():
    """Codes, scales and the rotation are made where the model is (meta here stands for a GPU: a tensor left on
    the CPU would show as a mismatch)."""
    runtime = Transformer.from_hf(tiny_hf_model("llama")).to("meta")
    for kv in (
        KVQuant(KVScheme("int8", "token"), rotate=True),
        KVQuant(KVScheme("fp8", "head"), [torch.ones(2)] * 2, [torch.ones(2)] * 2),
        KVQuant(KVScheme("int4", "channel")),
    ):
        runtime.kv_quant = kv
        cache = runtime.new_cache(1, 8)
        tensors = cache.k + cache.v + cache.k_scales + cache.v_scales + cache.k_recent + [cache.pad]
        tensors += [] if cache.rotation is None else [cache.rotation]
        assert {t.device.type for t in tensors} == {"meta"}
