"""The layer-wise engine: capture, true-sequential passes, next-layer inputs, resume, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

from lmpress.anatomy import decoder_layers
from lmpress.calib.engine import capture_first_layer_inputs, run_calibration
from lmpress.calib.hooks import SharedInput
from lmpress.calib.session import LayerSession
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.errors import LmpressInputError
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig, GPTQMethod, run_gptq
from lmpress.registry import StageContext
from tests.conftest import save_tiny_model


def calibration_for(tokenizer, n: int = 8, seq_len: int = 32) -> torch.Tensor:
    return calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), n, seq_len, seed=0)


def context(tmp_path, calibration, resume=False, fingerprint="f1") -> StageContext:
    return StageContext(
        calibration=lambda: calibration, state_dir=tmp_path / "state", resume=resume, fingerprint=fingerprint
    )


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("deep-llama"), "llama", num_hidden_layers=4)


def test_capture_keeps_hidden_states_compact_and_the_layer_kwargs(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer, n=6)
    captured = capture_first_layer_inputs(loaded.model, calibration.split(4), device=torch.device("cpu"))
    assert [h.shape for h in captured.hidden] == [(4, 32, 128), (2, 32, 128)]
    assert all(h.dtype == torch.float16 for h in captured.hidden)
    cos, sin = captured.kwargs[0]["position_embeddings"]
    assert cos.shape[-2] == 32
    expected = loaded.model.model.embed_tokens(calibration[:4]).half()
    assert torch.equal(captured.hidden[0], expected)


def test_next_layer_inputs_are_the_quantized_model_activations(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    calibration = calibration_for(loaded.tokenizer)
    seen = {}

    class Recording(GPTQMethod):
        def prepare_layer(self, session):
            seen[session.index] = torch.cat(list(session.inputs.hidden)).float()

    config = GPTQConfig(bits=4, group_size=32)
    run_calibration(model, [Recording(config)], config.scheme_for, context(tmp_path, calibration), batch_size=4)
    actual = {}
    hook = decoder_layers(model)[1].register_forward_pre_hook(lambda m, a: actual.setdefault(1, a[0]))
    with torch.no_grad():
        model(calibration, use_cache=False)
    hook.remove()
    torch.testing.assert_close(seen[1], actual[1], atol=2e-3, rtol=2e-3)


def test_each_linear_is_computed_once_per_pass_that_needs_it(tiny_llama_dir, tmp_path, monkeypatch):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    calibration = calibration_for(loaded.tokenizer)  # 8 samples, batches of 4: 2 batches
    layer = decoder_layers(model)[0]
    names = {"q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"}
    computed = dict.fromkeys(names, 0)
    linear_forward = torch.nn.Linear.forward

    def counting_forward(module, x):  # a linear computing its output (not a replayed or skipped one)
        for name, m in layer.named_modules():
            if m is module and name.rpartition(".")[2] in names:
                computed[name.rpartition(".")[2]] += 1
        return linear_forward(module, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting_forward)
    kernel = model.config._attn_implementation
    attention_forward = AttentionInterface._global_mapping[kernel]

    def counting_attention(module, *args, **kwargs):  # the attention kernel, computing its result
        computed["attention"] += module is layer.self_attn
        return attention_forward(module, *args, **kwargs)

    computed["attention"] = 0
    monkeypatch.setitem(AttentionInterface._global_mapping, kernel, counting_attention)
    computed["activation"] = 0  # the MLP's activation, on whatever gate_proj returned

    def count_activation(module, args, output):
        computed["activation"] += 1

    layer.mlp.act_fn.register_forward_hook(count_activation)
    run_gptq(model, GPTQConfig(bits=4, group_size=32, batch_size=4), context(tmp_path, calibration))
    # Per batch: the q/k/v pass stops at v's input and skips q/k; the o pass computes q/k/v, recording o's
    # input; the gate/up pass computes o on that input (skipping q/k/v and the attention kernel) and records
    # the attention block's output; the down pass replays it and computes gate/up, recording down's input;
    # the output pass replays that input and computes down.
    # Besides: the first batch of a pass shows that gate/up read one tensor and that the attention block and
    # the MLP return o_proj's and down_proj's outputs; later batches of the gate/up pass then end at gate's
    # input, and the MLP of the output pass is down_proj alone. So the activation runs in the down pass (each
    # batch) and, on the skipped gate's zeros, in the first batch of the gate/up and output passes.
    assert computed == {
        "q_proj": 1 * 2, "v_proj": 1 * 2, "o_proj": 1 * 2, "gate_proj": 1 * 2, "down_proj": 1 * 2, "attention": 1 * 2,
        "activation": 1 * 2 + 2,
    }  # fmt: skip
    assert model.config._attn_implementation == kernel


@pytest.mark.parametrize("family_dir", ["tiny_llama_dir", "tiny_opt_dir"])
def test_replayed_blocks_give_the_outputs_of_a_full_recomputation(family_dir, request, tmp_path, monkeypatch):
    loaded = load_model(str(request.getfixturevalue(family_dir)))
    model = loaded.model
    calibration = calibration_for(loaded.tokenizer)
    kept = {}
    outputs = LayerSession.outputs

    def keep_outputs(session):
        result = outputs(session)
        kept[session.index] = [h.clone() for h in result.hidden]  # the next layer writes its outputs over these
        return result

    monkeypatch.setattr(LayerSession, "outputs", keep_outputs)
    run_gptq(model, GPTQConfig(bits=4, group_size=32, batch_size=4), context(tmp_path, calibration))
    inputs = capture_first_layer_inputs(model, calibration.split(4), torch.device("cpu"))
    layer = decoder_layers(model)[0]
    for hidden, kwargs, got in zip(inputs.hidden, inputs.kwargs, kept[0], strict=True):
        want = layer(hidden.float(), **kwargs)
        want = want[0] if isinstance(want, tuple) else want
        # The replayed attention output was stored in float16: agreement to float16 rounding.
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


ACT_ORDER = {"bits": 4, "group_size": 32, "act_order": True, "batch_size": 4}
# down_proj (256 input columns) with k-quant scales: the state must carry the flag
KQUANT = {
    **ACT_ORDER,
    "static_groups": True,
    "k_quant_scales": True,
    "overrides": {".*(q|k|v|o|gate|up)_proj": {"k_quant_scales": False}},
}


def _quantize_all(model_dir, tmp_path, calibration, settings=ACT_ORDER, **kwargs):
    model = load_model(str(model_dir)).model
    summary = run_gptq(model, GPTQConfig(**settings), context(tmp_path, calibration, **kwargs))
    return model, summary


@pytest.mark.parametrize("settings", [ACT_ORDER, KQUANT], ids=["act-order", "k-quant"])
def test_resume_after_a_crash_gives_the_identical_model(deep_llama_dir, tmp_path, settings):
    calibration = calibration_for(load_model(str(deep_llama_dir)).tokenizer)
    reference, _ = _quantize_all(deep_llama_dir, tmp_path / "ref", calibration, settings)

    crashing = load_model(str(deep_llama_dir)).model

    def crash(*_):
        raise RuntimeError("killed")

    decoder_layers(crashing)[2].register_forward_pre_hook(crash)
    with pytest.raises(RuntimeError, match="killed"):
        run_gptq(crashing, GPTQConfig(**settings), context(tmp_path, calibration))
    assert (tmp_path / "state" / "layer_00001.safetensors").exists()

    resumed, summary = _quantize_all(deep_llama_dir, tmp_path, calibration, settings, resume=True)
    assert summary["resumed_at_layer"] == 2
    want, got = reference.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    schemes = {name: m.scheme for name, m in resumed.named_modules() if hasattr(m, "scheme")}
    assert schemes == {name: m.scheme for name, m in reference.named_modules() if hasattr(m, "scheme")}
    assert schemes["model.layers.0.mlp.down_proj"].k_quant_scales == ("k_quant_scales" in settings)


def mapped_from(tensor: torch.Tensor) -> str | None:
    """The file whose private mapping holds ``tensor``'s bytes (``/proc/self/maps``), or None (anonymous memory)."""
    start = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high and len(fields) >= 6 and fields[5].startswith("/") and fields[1].endswith("p"):
                return fields[5]
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_finished_layers_packed_weights_are_read_from_their_state_files(deep_llama_dir, tmp_path):
    """Every finished layer's QuantizedLinear buffers live in a mapping of that layer's state file, not in RAM, so
    a whole model's packed weights do not pile up while its layers stream; they hold what the pass computed."""
    from lmpress.weights.qlinear import QuantizedLinear

    calibration = calibration_for(load_model(str(deep_llama_dir)).tokenizer)
    model, summary = _quantize_all(deep_llama_dir, tmp_path, calibration)
    layers = decoder_layers(model)
    mapped = 0
    for index, layer in enumerate(layers):
        state_file = str((tmp_path / "state" / f"layer_{index:05d}.safetensors").resolve())
        for name, module in layer.named_modules():
            if isinstance(module, QuantizedLinear):
                for buffer in ("qweight", "scales", "zeros"):
                    assert mapped_from(getattr(module, buffer)) == state_file, (index, name, buffer)
                mapped += 1
    assert mapped == summary["quantized_linears"] == 7 * len(layers)
    # the mapped model is the one the pass computed: a resume from the same state rebuilds it identically
    resumed, _ = _quantize_all(deep_llama_dir, tmp_path, calibration, resume=True)
    want, got = model.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = calibration[:2]
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_resume_refuses_state_from_another_run(tiny_llama_dir, tmp_path):
    calibration = calibration_for(load_model(str(tiny_llama_dir)).tokenizer)
    _quantize_all(tiny_llama_dir, tmp_path, calibration)
    with pytest.raises(LmpressInputError, match="fingerprint mismatch"):
        _quantize_all(tiny_llama_dir, tmp_path, calibration, resume=True, fingerprint="other")


def test_non_finite_activations_name_the_layer(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    decoder_layers(loaded.model)[1].post_attention_layernorm.weight.data[0] = float("inf")
    with pytest.raises(LmpressInputError, match=r"model\.layers\.1\.mlp\.gate_proj \(decoder layer 1\)"):
        run_gptq(loaded.model, GPTQConfig(bits=4, group_size=32), context(tmp_path, calibration))

    fresh = load_model(str(tiny_llama_dir)).model
    fresh.model.embed_tokens.weight.data[:] = float("nan")
    with pytest.raises(LmpressInputError, match="NaN .* input of decoder layer 0"):
        run_gptq(fresh, GPTQConfig(bits=4, group_size=32), context(tmp_path, calibration))


def test_group_size_a_layer_cannot_take_is_refused_before_work(tmp_path):
    model_dir = save_tiny_model(tmp_path / "odd", "llama", intermediate_size=192)
    loaded = load_model(str(model_dir))
    with pytest.raises(LmpressInputError, match=r"down_proj \(192\).*\[-1, 32, 64\]"):
        run_gptq(loaded.model, GPTQConfig(bits=4, group_size=128), context(tmp_path, calibration_for(loaded.tokenizer)))


def test_an_architecture_the_engine_cannot_walk_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(LmpressInputError, match="'gpt2' is not supported"):
        run_gptq(model, GPTQConfig(bits=4, group_size=32), context(tmp_path, torch.zeros(2, 8, dtype=torch.long)))


def test_calibration_longer_than_the_context_is_refused(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    too_long = torch.zeros(2, 600, dtype=torch.long)  # the tiny model's context is 512
    with pytest.raises(LmpressInputError, match="longer than the model's context"):
        run_gptq(loaded.model, GPTQConfig(bits=4, group_size=32), context(tmp_path, too_long))


def test_a_shared_input_is_one_unmodified_tensor_read_by_every_watched_module():
    x = torch.randn(2, 3)
    shared = SharedInput(3)
    for _ in range(3):
        shared.observe(x, (x,), {})
    assert shared.complete()

    modified = SharedInput(2)
    modified.observe(x, (x,), {})
    x.mul_(2)  # an in-place change between two readers: they did not read the same values
    modified.observe(x, (x,), {})
    assert not modified.complete()

    other = SharedInput(2)
    other.observe(x, (x,), {})
    other.observe(x.clone(), (x.clone(),), {})
    assert not other.complete()

    missing = SharedInput(3)  # a watched module that never ran in the first batch
    missing.observe(x, (x,), {})
    missing.observe(x, (x,), {})
    assert not missing.complete()

    with_kwargs = SharedInput(2)
    for _ in range(2):
        with_kwargs.observe(x, (), {"hidden_states": x, "position_ids": None})
    assert not with_kwargs.complete()


def test_activations_spilled_to_files_give_the_same_model(tiny_llama_dir, tmp_path, monkeypatch):
    from lmpress.calib.activations import Spill

    calibration = calibration_for(load_model(str(tiny_llama_dir)).tokenizer)
    reference, _ = _quantize_all(tiny_llama_dir, tmp_path / "ram", calibration)
    spills = []
    monkeypatch.setattr(Spill, "slab", lambda self, shape, slab=Spill.slab: spills.append(shape) or slab(self, shape))
    model = load_model(str(tiny_llama_dir)).model
    ctx = StageContext(
        calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="f1",
        activations_ram_bytes=0, spill_dir=tmp_path / "spill",
    )  # fmt: skip
    run_gptq(model, GPTQConfig(**ACT_ORDER), ctx)
    assert spills and not list((tmp_path / "spill").iterdir())  # every slab in a file, each unlinked once mapped
    want, got = reference.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
