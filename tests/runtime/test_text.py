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
