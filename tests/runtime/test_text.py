"""``lmpress generate``: text from any model lmpress loads, plain or speculative, through the CLI."""

from __future__ import annotations

import pytest
import torch

from lmpress.cli import main

PROMPT = "The Python language reference describes the syntax and the core semantics of"


def reference_text(model_dir, new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.long
@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--stream"],
        ["--prompt-lookup"],
        ["--draft", "SELF"],
        ["--draft", "SELF", "--draft-vocab", "40"],
        ["--compile"],
        ["--compile", "--draft", "SELF"],
    ],
)
def test_greedy_text_equals_transformers_generate(tiny_llama_dir, capsys, mode):
    mode = [str(tiny_llama_dir) if arg == "SELF" else arg for arg in mode]
    code = main(["generate", str(tiny_llama_dir), "--prompt", PROMPT, "--max-new-tokens", "12", *mode])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.rstrip("\n") == reference_text(tiny_llama_dir, 12)
    assert "12 new tokens" in captured.err
    if mode:
        assert ("acceptance" in captured.err) == ("--draft" in mode or "--prompt-lookup" in mode)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--top-p", "1.5"], "top_p must lie in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt-lookup", "--draft", "x"], "choose one"),
        (["--draft-vocab", "40"], "--draft-vocab cuts a draft model's vocabulary: give --draft"),
        (["--draft", "SELF", "--draft-vocab", "0"], "a draft vocabulary of 0 tokens: choose 1 to"),
        (["--draft", "SELF", "--draft-vocab", "9", "--draft-vocab-text", "nope.txt"], "nope.txt does not exist"),
    ],
)
def test_bad_generation_settings_are_exit_2(tiny_llama_dir, capsys, args, message):
    args = [str(tiny_llama_dir) if arg == "SELF" else arg for arg in args]
    assert main(["generate", str(tiny_llama_dir), "--prompt", PROMPT, *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "expected"), [([], "int8"), (["--activations", "bf16"], "bf16")])
def test_generate_cli_passes_its_activations_to_the_runtime(tiny_llama_dir, capsys, monkeypatch, argv, expected):
    from lmpress.runtime import text

    seen = []
    real = text.load_runtime

    def recording(source, device="cpu", dtype=None, cpu_activations="unset"):
        seen.append(cpu_activations)
        return real(source, device, dtype, cpu_activations)

    monkeypatch.setattr(text, "load_runtime", recording)
    args = ["generate", str(tiny_llama_dir), "--prompt", PROMPT, "--max-new-tokens", "2", *argv]
    assert main([*args, "--draft", str(tiny_llama_dir)]) == 0
    assert seen == [expected, expected]  # the target and its draft


def test_generate_times_loading_the_first_token_and_decoding_apart(tiny_llama_dir, monkeypatch):
    """What a user reads: how long loading took, the first token after it (and after the command started), and
    the decode rate as ``lmpress bench`` counts it (tokens after the first over the time after the first)."""
    import time

    from lmpress.runtime import text

    real = text.load_runtime

    def slow_load(*args, **kwargs):
        time.sleep(0.4)
        return real(*args, **kwargs)

    monkeypatch.setattr(text, "load_runtime", slow_load)
    pieces = []

    def slow_reader(piece: str) -> None:  # each later token waits for this: decoding looks 0.05 s a piece slower
        pieces.append(piece)
        time.sleep(0.05)

    result = text.generate_text(str(tiny_llama_dir), PROMPT, max_new_tokens=8, on_text=slow_reader)
    assert result.load_seconds >= 0.4 > result.first_token_seconds > 0
    assert result.since_start is not None and result.since_start > result.load_seconds
    assert result.decode_rate == pytest.approx(7 / (result.seconds - result.first_token_seconds))
    assert result.decode_rate <= 7 / (0.05 * (len(pieces) - 1))  # the reader's waits count as decoding
    summary = result.summary()
    assert f"loaded in {result.load_seconds:.1f} s, first token {result.first_token_seconds:.2f} s later" in summary
    assert f"then {result.decode_rate:.1f} tok/s" in summary and "after the command started" in summary


def test_a_compiled_generate_compiles_its_step_before_the_first_token(tiny_llama_dir, monkeypatch):
    """``--compile`` compiles the decode step up front and says how long that took, so the decode rate is the
    compiled step's (as ``lmpress bench`` times it), not one dominated by compiling: no graph is compiled while
    the tokens come."""
    from torch._dynamo.utils import counters

    from lmpress.runtime import text

    compiled = []
    real = text.compile_steps

    def recording(*args, **kwargs):
        real(*args, **kwargs)
        compiled.append(counters["stats"]["unique_graphs"])

    monkeypatch.setattr(text, "compile_steps", recording)
    result = text.generate_text(str(tiny_llama_dir), PROMPT, max_new_tokens=6, compile=True, on_text=lambda _: None)
    assert len(compiled) == 1 and result.compile_seconds > 0
    assert counters["stats"]["unique_graphs"] == compiled[0]
    assert f"compiled its decode step in {result.compile_seconds:.1f} s, first token" in result.summary()
    eager = text.generate_text(str(tiny_llama_dir), PROMPT, max_new_tokens=6, on_text=lambda _: None)
    assert eager.tokens == result.tokens and eager.compile_seconds == 0 and "compiled" not in eager.summary()
