"""``lmpress bench``: what it reports for a model, checked against the checkpoint and against plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from lmpress.cli import main
from lmpress.runtime.model import Transformer
from lmpress.runtime.throughput import (
    BenchSettings,
    benchmark,
    copy_bandwidth_gbs,
    interleaved_generation_times,
    kv_cache_bytes,
)
from tests.runtime.conftest import tiny_hf_model


def test_bench_cli_reports_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "bench.json"
    argv = ["bench", str(tiny_llama_dir), "--prompt-tokens", "16", "--new-tokens", "6", "--repeats", "1"]
    assert main([*argv, "--prompt-lookup", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode" in printed and "kernel of attention.wqkv" in printed
    result = json.loads(out.read_text())
    assert result["kernels"]["layers.1.feed_forward.w2"] == "dense" and len(result["kernels"]) == 2 * 4 + 1
    plain, spec = result["plain"], result["speculative"]
    assert plain["prompt_tokens"] == 16 and plain["new_tokens"] == 6
    assert plain["decode_tok_s"] > 0 and plain["prefill_tok_s"] > 0 and plain["peak_memory_mb"] > 0
    # Bytes per token from the checkpoint: every float32 parameter once (the embedding is tied to the head)
    # plus keys and values of 2 layers x 2 KV heads x 32 dims at the mean length 16 + 6 / 2.
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert config.tie_word_embeddings
    kv = 2 * 2 * 2 * 32 * (16 + 3) * 4
    assert plain["bytes_per_token"] == 4 * sum(p.numel() for p in hf.parameters()) + kv
    assert plain["bandwidth_pct"] == pytest.approx(100 * plain["decode_gb_s"] / plain["bandwidth_gb_s"])
    assert spec["identical_to_plain"] and spec["drafter"] == "prompt lookup"
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["tokens_per_target_step"] >= 1


def test_speculative_bench_with_a_draft_model():
    model = Transformer.from_hf(tiny_hf_model("llama", seed=1))
    draft = Transformer.from_hf(tiny_hf_model("llama", seed=1), dtype=torch.bfloat16)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    result = benchmark(model, prompt, BenchSettings(new_tokens=8, repeats=1), draft=draft)
    spec = result["speculative"]
    assert spec["drafter"] == "draft model" and spec["identical_to_plain"]
    assert spec["acceptance_rate"] > 0.5  # a bf16 copy agrees with its fp32 target on most greedy tokens
    assert spec["speedup"] == pytest.approx(spec["decode_tok_s"] / spec["plain_decode_tok_s"])
    assert spec["plain_row_decode_tok_s"] == result["plain"]["decode_tok_s"] and spec["whole_run_speedup"] > 0


def test_interleaved_generation_times_alternate_the_runs_within_each_repeat():
    calls = []
    runs = {name: (lambda n, name=name: calls.append((name, n))) for name in ("plain", "speculative")}
    times = interleaved_generation_times(runs, new_tokens=5, repeats=2, device=torch.device("cpu"))
    warm_up = [("plain", 5), ("speculative", 5)]
    repeat = [("plain", 1), ("plain", 5), ("speculative", 1), ("speculative", 5)]
    assert calls == warm_up + 2 * repeat
    assert set(times) == {"plain", "speculative"} and all(0 <= one and 0 <= many for one, many in times.values())


def test_kv_cache_bytes_and_copy_bandwidth():
    model = Transformer.from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    cache = model.new_cache(1, 10)
    assert kv_cache_bytes(model, 10) == cache.nbytes
    assert copy_bandwidth_gbs("cpu", megabytes=8, repeats=2) > 0.1


@pytest.mark.parametrize("kv_cache", ["int8", "fp8"])
def test_a_quantized_kv_cache_counts_its_codes_and_scales(kv_cache):
    """What ``lmpress bench --kv-cache`` reports per token is what the runtime's cache allocates."""
    from lmpress.cli import kv_quant_flag
    from lmpress.runtime.throughput import render_rows

    model = Transformer.from_hf(tiny_hf_model("llama"))
    float_bytes = kv_cache_bytes(model, 16)
    model.kv_quant = kv_quant_flag(kv_cache)
    cache = model.new_cache(1, 16)
    static = sum(t.nbytes for t in cache.k_scales + cache.v_scales) if kv_cache == "fp8" else 0
    assert kv_cache_bytes(model, 16) == cache.nbytes - static
    head_dim = model.args.head_dim  # float32 -> one byte per entry, and int8's float32 scale per token and head
    assert kv_cache_bytes(model, 16) == float_bytes * ((head_dim + 4) if kv_cache == "int8" else head_dim) // (
        4 * head_dim
    )
    result = benchmark(model, list(range(10)), BenchSettings(new_tokens=3, repeats=1))
    rows = dict(render_rows(result))
    assert rows["KV cache per token held"].startswith(f"{kv_cache_bytes(model, 1):,} bytes ({kv_cache.upper()} KV")


def test_bench_names_the_kernel_of_every_layer():
    """A W4 model on the CPU: every decoder linear on torch's int4 kernel, a W8A8 down projection on lmpress's int8
    kernel (or _int_mm), the float head dense; the table has one row per layer role."""
    from lmpress.runtime.kernels import cpu_int
    from lmpress.runtime.throughput import render_rows
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    hf = tiny_hf_model("llama", seed=3)
    for block in hf.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    scheme = QuantScheme(8, -1, True, activations="int8") if name == "down_proj" else QuantScheme(4, 32)
                    qw = quantize_weight_rtn(child.weight.detach(), scheme)
                    setattr(parent, name, QuantizedLinear.from_quantized_weight(qw))
    model = Transformer.from_hf(hf)
    result = benchmark(model, list(range(10)), BenchSettings(new_tokens=3, repeats=1))
    kernels = result["kernels"]
    assert kernels["layers.0.attention.wqkv"] == "cpu-int4" and kernels["layers.1.feed_forward.w13"] == "cpu-int4"
    w8a8 = "cpu-w8a8" if cpu_int.available() else "int8-mm"  # lmpress's int8 kernel, else torch's _int_mm
    assert kernels["layers.1.feed_forward.w2"] == w8a8 and kernels["output"] == "dense"
    rows = dict(render_rows(result))
    assert rows["kernel of feed_forward.w2"] == f"{w8a8} (2 layers)"
    assert rows["kernel of attention.wo"] == "cpu-int4 (2 layers)" and rows["kernel of output"] == "dense (1 layer)"


@pytest.mark.long
@pytest.mark.parametrize(("activations", "kernel"), [("int8", "cpu-w4a8"), ("bf16", "cpu-int4"), (None, "cpu-w4a8")])
def test_bench_cli_runs_the_kernel_its_activations_name(tiny_llama_wide_dir, tmp_path, activations, kernel):
    """``lmpress bench --activations``: int8 (the default) runs lmpress's W4 kernel, bf16 torch's packed one."""
    import lmpress
    from lmpress.export.compressed_tensors import export_compressed_tensors
    from lmpress.runtime.kernels import cpu_int

    if kernel == "cpu-w4a8" and not cpu_int.available():
        pytest.skip("lmpress's C++ kernels do not build here")
    loaded = lmpress.load_model(str(tiny_llama_wide_dir))
    lmpress.quantize_model(loaded.model, method="rtn", bits=4, group_size=64, symmetric=False)
    export_compressed_tensors(loaded.model, loaded.tokenizer, tmp_path / "w4")
    out = tmp_path / "bench.json"
    argv = ["bench", str(tmp_path / "w4"), "--prompt-tokens", "8", "--new-tokens", "3", "--repeats", "1"]
    argv += [] if activations is None else ["--activations", activations]
    assert main([*argv, "--json", str(out)]) == 0
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels["layers.0.attention.wqkv"] == kernel and kernels["layers.1.feed_forward.w2"] == kernel


def test_bench_cli_refuses_unknown_activations(tiny_llama_dir, capsys):
    assert main(["bench", str(tiny_llama_dir), "--activations", "int4"]) == 2
    err = capsys.readouterr().err
    assert "activations 'int4': choose int8 or bf16" in err and "Traceback" not in err
