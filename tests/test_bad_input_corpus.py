"""A corpus of bad inputs through the CLI: each is exit 2, one line on stderr, no traceback, nothing lost.

Every case builds its inputs under ``tmp_path`` (recipes, texts, damaged copies of a tiny
random checkpoint) and runs ``lmpress.cli.main`` in-process. ``lmpress run`` cases write
into an ``--out`` directory that already holds a file: it must come out untouched.
Most cases are refused before any model work; the rest load the tiny model only.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lmpress.cli import main

SENTINEL = "kept.txt"


@dataclass
class Env:
    """What a case builds its inputs from."""

    tmp: Path
    model: Path  # the tiny llama checkpoint (shared, never modified)

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return str(path)

    def recipe(self, raw: Any, name: str = "recipe.yaml") -> str:
        return self.file(name, yaml.safe_dump(raw))

    def model_copy(self, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model, self.tmp / name))


def base_recipe(env: Env) -> dict[str, Any]:
    return {
        "model": {"source": str(env.model)},
        "data": {"samples": 2, "seq_len": 32},
        "stages": [{"method": "rtn", "bits": 4, "group_size": 32}],
        "export": {"formats": ["hf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 100"],
    }


def edited(change: Callable[[dict[str, Any], Env], None]) -> Callable[[Env], str]:
    """A case whose recipe is the base recipe with ``change`` applied."""

    def build(env: Env) -> str:
        raw = copy.deepcopy(base_recipe(env))
        change(raw, env)
        return env.recipe(raw)

    return build


def with_model(make: Callable[[Env], Path | str]) -> Callable[[Env], str]:
    return edited(lambda raw, env: raw["model"].update(source=str(make(env))))


def with_text(name: str, content: str | bytes, key: str = "eval") -> Callable[[Env], str]:
    def change(raw: dict[str, Any], env: Env) -> None:
        path = env.file(name, content)
        if key == "eval":
            raw["eval"]["text"] = path
        else:
            raw["data"]["source"] = path

    return edited(change)


def raw_recipe(content: str | bytes) -> Callable[[Env], str]:
    return lambda env: env.file("recipe.yaml", content)


# Damaged models ---------------------------------------------------------------------------


def no_config(env: Env) -> Path:
    path = env.model_copy()
    (path / "config.json").unlink()
    return path


def bad_config(text: str) -> Callable[[Env], Path]:
    def make(env: Env) -> Path:
        path = env.model_copy()
        (path / "config.json").write_text(text)
        return path

    return make


def unsupported_architecture(env: Env) -> Path:
    path = env.model_copy()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    return path


def truncated_weights(env: Env) -> Path:
    path = env.model_copy()
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def no_weights(env: Env) -> Path:
    path = env.model_copy()
    (path / "model.safetensors").unlink()
    return path


def sharded(env: Env) -> Path:
    """The tiny model's weights in two shards with an index, as the hub shards large models."""
    from safetensors.torch import load_file, save_file

    path = env.model_copy()
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, path / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def shard_missing(env: Env) -> Path:
    path = sharded(env)
    (path / "model-00002-of-00002.safetensors").unlink()
    return path


def index_points_elsewhere(env: Env) -> Path:
    path = sharded(env)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def fake_gguf(env: Env) -> str:
    return env.file("model.gguf", b"PK\x03\x04 a zip file, not GGUF")


def no_gpu(raw: dict[str, Any], env: Env) -> None:
    """For the model.device: cuda cases: skipped where a GPU makes cuda valid."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: model.device: cuda is valid here")


def learned(**settings: Any) -> Callable[[Env], str]:
    return edited(lambda r, e: r.update(stages=[{"method": "learned", "group_size": 32, **settings}]))


# Recipe cases: (id, build -> recipe path, message fragment, extra CLI args) ---------------------

PERPLEXITY = {"seq_len": 64, "windows": 2}
RECIPE_CASES: list[tuple[str, Callable[[Env], str], str, list[str]]] = [
    ("malformed-yaml", raw_recipe("model: x\nstages:\n  - method: rtn\n   bits: 4\n"), "malformed YAML at line 4", []),
    (
        "duplicate-key",
        raw_recipe("model: x\nstages:\n  - method: rtn\nmodel: y\n"),
        "line 4, column 1: key 'model' appears twice",
        [],
    ),
    ("recipe-is-a-list", raw_recipe("- model: x\n"), "a recipe is a YAML mapping", []),
    ("recipe-is-a-scalar", raw_recipe("just words\n"), "a recipe is a YAML mapping", []),
    ("recipe-is-empty", raw_recipe(""), "a recipe is a YAML mapping", []),
    ("binary-recipe", raw_recipe(b"\x89PNG\r\n\x1a\n\x00\x00"), "not UTF-8 text (byte 0x89 at offset 0)", []),
    ("nul-bytes-recipe", raw_recipe(b"model: x\x00\x01\n"), "malformed YAML", []),
    ("unknown-top-key", edited(lambda r, e: r.update(stagez=[])), "stagez: unknown key", []),
    ("unknown-model-key", edited(lambda r, e: r["model"].update(dtyp="float32")), "model.dtyp: unknown key", []),
    ("unknown-data-key", edited(lambda r, e: r["data"].update(sampels=3)), "data.sampels: unknown key", []),
    ("unknown-stage-key", edited(lambda r, e: r["stages"][0].update(bitz=4)), "stages[0].bitz: unknown key", []),
    ("unknown-export-key", edited(lambda r, e: r["export"].update(format=["hf"])), "export.format: unknown key", []),
    ("unknown-eval", edited(lambda r, e: r["eval"].update(perplexitty={})), "eval.perplexitty: unknown eval", []),
    (
        "unknown-eval-key",
        edited(lambda r, e: r["eval"]["perplexity"].update(window=3)),
        "eval.perplexity.window: unknown key",
        [],
    ),
    (
        "unknown-kld-key",
        edited(lambda r, e: r["eval"]["perplexity"].update(kld={"topk": 3})),
        "eval.perplexity.kld.topk: unknown key",
        [],
    ),
    ("eval-key-not-a-string", edited(lambda r, e: r["eval"].update({3: {}})), "eval.3: unknown eval", []),
    ("samples-not-a-number", edited(lambda r, e: r["data"].update(samples="many")), "data.samples", []),
    ("stages-not-a-list", edited(lambda r, e: r.update(stages={"method": "rtn"})), "stages: expected a list", []),
    ("stage-not-a-mapping", edited(lambda r, e: r.update(stages=["rtn"])), "stages[0]: a stage is a mapping", []),
    ("dtype-unknown", edited(lambda r, e: r["model"].update(dtype="int8")), "model.dtype: 'int8' is not one of", []),
    ("model-not-a-string", edited(lambda r, e: r.update(model=42)), "model", []),
    ("eval-text-not-a-string", edited(lambda r, e: r["eval"].update(text=7)), "eval.text: expected a text source", []),
    ("eval-not-a-mapping", edited(lambda r, e: r.update(eval=["perplexity"])), "eval: expected a mapping", []),
    ("gates-not-a-list", edited(lambda r, e: r.update(gates="ppl < 3")), "gates: expected a list", []),
    ("bits-5", edited(lambda r, e: r["stages"][0].update(bits=5)), "stages[0].bits: 5 is not one of 2, 3, 4, 8", []),
    ("group-size-100", edited(lambda r, e: r["stages"][0].update(group_size=100)), "stages[0].group_size", []),
    ("unknown-method", edited(lambda r, e: r["stages"][0].update(method="gptx")), "unknown method 'gptx'", []),
    ("method-list", edited(lambda r, e: r["stages"][0].update(method=["rtn"])), "expected one method name", []),
    ("stage-without-method", edited(lambda r, e: r["stages"][0].pop("method")), "with a 'method' key", []),
    ("unknown-format", edited(lambda r, e: r["export"].update(formats=["tflite"])), "'tflite' is not an export", []),
    ("duplicate-format", edited(lambda r, e: r["export"].update(formats=["hf", "hf"])), "listed twice", []),
    ("bad-gate-syntax", edited(lambda r, e: r.update(gates=["ppl is small"])), "gates[0]: 'ppl is small' is not a", []),
    ("gate-unknown-metric", edited(lambda r, e: r.update(gates=["bleu >= 3"])), "metric 'bleu' is not computed", []),
    (
        "stride-over-seq-len",
        edited(lambda r, e: r["eval"]["perplexity"].update(stride=65)),
        "stride 65 is longer than seq_len 64",
        [],
    ),
    ("missing-model", with_model(lambda e: e.tmp / "no-such-model"), "does not exist", []),
    ("model-dir-without-config", with_model(no_config), "has no config.json", []),
    ("model-config-not-json", with_model(bad_config("{not json")), "config.json: not valid JSON", []),
    ("model-config-without-type", with_model(bad_config('{"vocab_size": 3}')), "no 'model_type'", []),
    ("unsupported-architecture", with_model(unsupported_architecture), "architecture 'gpt2' is not supported", []),
    ("truncated-safetensors", with_model(truncated_weights), "not a readable safetensors file", []),
    ("no-weights", with_model(no_weights), "no .safetensors weights", []),
    (
        "shard-missing",
        with_model(shard_missing),
        "names the shard model-00002-of-00002.safetensors, which is missing",
        [],
    ),
    ("index-points-elsewhere", with_model(index_points_elsewhere), "the shards do not match their index", []),
    ("not-gguf", with_model(fake_gguf), "is not a GGUF file", []),
    ("missing-pypkg", with_model(lambda e: "pypkg:no_such_pkg_4821/m.gguf"), "is not installed", []),
    ("non-utf8-eval-text", with_text("latin1.txt", b"caf\xe9 " * 50), "not UTF-8 (byte 0xe9 at offset 3)", []),
    ("non-utf8-data", with_text("d.txt", b"ok\xff", key="data"), "not UTF-8 (byte 0xff at offset 2)", []),
    ("empty-text", with_text("empty.txt", " \n\n"), "is empty", []),
    ("missing-text", edited(lambda r, e: r["eval"].update(text=str(e.tmp / "nope.txt"))), "does not exist", []),
    ("unsupported-text-type", with_text("t.csv", "a,b\n"), "unsupported type '.csv'", []),
    (
        "unknown-builtin-text",
        edited(lambda r, e: r["eval"].update(text="builtin:nope")),
        "unknown builtin text 'builtin:nope' (known: builtin:python-docs, builtin:python-source, "
        "builtin:wikitext2:valid, builtin:wikitext2:test)",
        [],
    ),
    (
        "unknown-builtin-split",
        edited(lambda r, e: r["data"].update(source="builtin:wikitext2:train")),
        "builtin:wikitext2 has no split 'train' (splits: builtin:wikitext2:valid, builtin:wikitext2:test)",
        [],
    ),
    (
        "builtin-without-split",
        edited(lambda r, e: r["eval"].update(text="builtin:wikitext2")),
        "text source 'builtin:wikitext2' needs a split: builtin:wikitext2:valid, builtin:wikitext2:test",
        [],
    ),
    ("malformed-hub-source", edited(lambda r, e: r["data"].update(source="hf:")), "expected hf:DATASET", []),
    ("jsonl-malformed-line", with_text("t.jsonl", '{"text": "a"}\n{"text": \n'), "line 2 is not valid JSON", []),
    ("jsonl-without-text", with_text("t.jsonl", '{"text": "a"}\n{"body": "b"}\n'), "line 2 has no 'text'", []),
    ("jsonl-not-an-object", with_text("t.jsonl", '{"text": "a"}\n[1]\n'), "line 2 is list, not a JSON", []),
    ("text-too-short", with_text("short.txt", "a few words"), "eval.perplexity: the text has 8 tokens, fewer", []),
    (
        "too-many-windows",
        edited(lambda r, e: r["eval"]["perplexity"].update(windows=10**6)),
        "eval.perplexity: the text has",
        [],
    ),
    (
        "window-longer-than-context",
        edited(lambda r, e: r["eval"]["perplexity"].update(seq_len=1024)),
        "longer than the model's context (512)",
        [],
    ),
    (
        "calibration-too-short",
        edited(lambda r, e: r.update(data={"samples": 10**6, "seq_len": 64}, stages=[{"method": "gptq"}])),
        "calibration text too short",
        [],
    ),
    (
        "awq-export-8-bit",
        edited(lambda r, e: r.update(export={"formats": ["awq"]}) or r["stages"][0].update(bits=8)),
        "awq",
        [],
    ),  # fmt: skip
    (
        "gguf-export-act-order",
        edited(
            lambda r, e: r.update(
                export={"formats": ["gguf"]}, stages=[{"method": "gptq", "group_size": 32, "act_order": True}]
            )
        ),
        "act-order g_idx permutes columns across GGUF's 32-column blocks: set static_groups: true",
        [],
    ),
    (
        "gguf-export-asymmetric",
        edited(lambda r, e: r.update(export={"formats": ["gguf"]}) or r["stages"][0].update(symmetric=False)),
        "use symmetric: true",
        [],
    ),  # fmt: skip
    (
        "kquant-8-bit",
        edited(lambda r, e: r["stages"][0].update(bits=8, k_quant_scales=True)),
        "stages[0]: k_quant_scales (Q4_K's 6-bit group scales per 256 columns) need bits: 4, group_size: 32",
        [],
    ),
    (
        "kquant-act-order",
        edited(
            lambda r, e: r.update(
                stages=[{"method": "gptq", "group_size": 32, "act_order": True, "k_quant_scales": True}]
            )
        ),
        "stages[0]: k_quant_scales with act_order: true needs static_groups: true",
        [],
    ),
    (
        "kquant-narrow-layers",
        edited(lambda r, e: r.update(export={"formats": ["gguf"]}) or r["stages"][0].update(k_quant_scales=True)),
        "stage rtn: k_quant_scales needs in_features divisible by 256 (Q4_K's super-blocks); 12 layer(s) are not",
        [],
    ),
    (
        "onnx-export-3-bit",
        edited(lambda r, e: r.update(export={"formats": ["onnx"]}) or r["stages"][0].update(bits=3)),
        "onnx: stages[0]: 3-bit weights: ONNX export holds 4- or 8-bit MatMulNBits",
        [],
    ),  # fmt: skip
    (
        "onnx-export-per-channel",
        edited(lambda r, e: r.update(export={"formats": ["onnx"]}) or r["stages"][0].update(group_size=-1)),
        "per-channel scales: MatMulNBits blocks are 32, 64 or 128 columns",
        [],
    ),  # fmt: skip
    # pruning
    ("sparsity-1", edited(lambda r, e: r.update(stages=[{"method": "wanda", "sparsity": 1.0}])), "sparsity", []),
    (
        "sparsity-negative",
        edited(lambda r, e: r.update(stages=[{"method": "magnitude", "sparsity": -0.1}])),
        "sparsity",
        [],
    ),
    (
        "nm-n-not-below-m",
        edited(lambda r, e: r.update(stages=[{"method": "sparsegpt", "pattern": "4:4"}])),
        "0 < N < M",
        [],
    ),
    (
        "nm-m-not-dividing",
        edited(lambda r, e: r.update(stages=[{"method": "wanda", "pattern": "2:3"}])),
        "M=3 does not divide",
        [],
    ),
    (
        "nm-with-sparsity",
        edited(lambda r, e: r.update(stages=[{"method": "wanda", "pattern": "2:4", "sparsity": 0.3}])),
        "sparsity does not apply",
        [],
    ),
    (
        "too-many-heads",
        edited(lambda r, e: r.update(stages=[{"method": "structured", "heads": 6}])),
        "removes every one of the 4 attention heads",
        [],
    ),
    (
        "broken-gqa-group",
        edited(lambda r, e: r.update(stages=[{"method": "structured", "heads": 1}])),
        "breaks a GQA group",
        [],
    ),
    (
        "every-layer",
        edited(lambda r, e: r.update(stages=[{"method": "structured", "layers": 2}])),
        "removes every one of the model's 2 decoder layers",
        [],
    ),
    # compute device, learned rounding
    (
        "model-device-cuda-without-gpu",
        edited(lambda r, e: no_gpu(r, e) or r["model"].update(device="cuda")),
        "model.device: cuda, but no CUDA GPU is available here (torch.cuda.is_available() is False); set model.device",
        [],
    ),
    ("set-model-device-cuda-without-gpu", edited(no_gpu), "no CUDA GPU", ["--set", "model.device=cuda"]),
    ("model-device-unknown", edited(lambda r, e: r["model"].update(device="tpu")), "model.device: 'tpu'", []),
    ("learned-lr-over-1", learned(lr=2), "stages[0].lr: Input should be less than or equal to 1", []),
    ("learned-lr-zero", learned(lr=0), "stages[0].lr: Input should be greater than 0", []),
    ("learned-iterations-zero", learned(iterations=0), "stages[0].iterations", []),
    ("learned-iterations-huge", learned(iterations=10**7), "stages[0].iterations", []),
    ("learned-unknown-init", learned(init="sgd"), "stages[0].init: 'sgd' is not one of", []),
    ("learned-bits-5", learned(bits=5), "stages[0].bits: 5 is not one of 2, 3, 4, 8", []),
    (
        "learned-3-bit-to-onnx",
        edited(lambda r, e: r.update(export={"formats": ["onnx"]}, stages=[{"method": "learned", "bits": 3}])),
        "onnx: stages[0]: 3-bit weights",
        [],
    ),
    # INT8 / FP8
    (
        "int8-activations-with-group-size",
        edited(lambda r, e: r.update(stages=[{"method": "smoothquant", "group_size": 64}])),
        "int8 per-token activations need per-channel weight scales (group_size: -1), got group_size 64",
        [],
    ),
    (
        "w8a8-export-gptq",
        edited(lambda r, e: r.update(stages=[{"method": "smoothquant"}], export={"formats": ["gptq"]})),
        "gptq: stages[0]: int8 activations (W8A8), which gptq cannot describe",
        [],
    ),
    (
        "bnb-on-quantized-layers",
        edited(lambda r, e: r.update(stages=[r["stages"][0], {"method": "bnb_4bit"}], export={"formats": []})),
        "stage bnb_4bit: bitsandbytes cannot wrap 14 layer(s)",
        [],
    ),
    (
        "fp8-weights-group",
        edited(lambda r, e: r.update(stages=[{"method": "fp8", "weights": "group"}])),
        "stages[0].weights",
        [],
    ),
    ("set-malformed-yaml", edited(lambda r, e: None), "is not valid YAML", ["--set", "stages[0].bits=["]),
    ("set-missing-index", edited(lambda r, e: None), "stages[3] does not exist", ["--set", "stages[3].bits=8"]),
    ("set-without-value", edited(lambda r, e: None), "expected key.path=value", ["--set", "stages[0].bits"]),
    ("set-through-a-scalar", edited(lambda r, e: None), "is not a mapping", ["--set", "data.samples.x=1"]),
    ("set-invalid-value", edited(lambda r, e: None), "stages[0].bits: 7 is not one of", ["--set", "stages[0].bits=7"]),
]


def assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], err


def out_with_a_file(tmp: Path) -> Path:
    out = tmp / "out"
    out.mkdir()
    (out / SENTINEL).write_text("already here")
    return out


@pytest.fixture()
def env(tmp_path, tiny_llama_dir, monkeypatch) -> Env:
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    return Env(tmp_path, tiny_llama_dir)


@pytest.mark.parametrize(
    ("build", "fragment", "extra"), [c[1:] for c in RECIPE_CASES], ids=[c[0] for c in RECIPE_CASES]
)
def test_bad_recipe_run_is_exit_2_and_keeps_out(env, capsys, build, fragment, extra):
    recipe = build(env)
    out = out_with_a_file(env.tmp)
    code = main(["run", recipe, "--out", str(out), "--overwrite", "--quiet", *extra])
    assert_one_line_error(code, capsys.readouterr().err, fragment)
    assert sorted(p.name for p in out.iterdir()) == [SENTINEL]
    assert (out / SENTINEL).read_text() == "already here"


# CLI-level cases: (id, build -> argv, message fragment) ------------------------------------------


def run_args(env: Env, out: Path, *extra: str) -> list[str]:
    return ["run", env.recipe(base_recipe(env)), "--out", str(out), "--quiet", *extra]


def out_is_a_file(env: Env) -> list[str]:
    return run_args(env, Path(env.file("out", "a file")))


def out_not_empty(env: Env) -> list[str]:
    return run_args(env, out_with_a_file(env.tmp))


def suite(env: Env, raw: Any) -> str:
    return env.recipe(raw, "suite.yaml")


PPL_SUITE = {"eval": {"perplexity": PERPLEXITY}}
CLI_CASES: list[tuple[str, Callable[[Env], list[str]], str]] = [
    ("missing-recipe", lambda e: ["run", str(e.tmp / "nope.yaml"), "--out", str(e.tmp / "o")], "does not exist"),
    ("recipe-is-a-directory", lambda e: ["run", str(e.tmp), "--out", str(e.tmp / "o")], "is not a file"),
    ("out-is-a-file", out_is_a_file, "exists and is not a directory"),
    ("out-not-empty", out_not_empty, "exists and is not empty; pass --overwrite"),
    (
        "eval-ratio-gate-without-baseline",
        lambda e: ["eval", str(e.model), "--suite", suite(e, {**PPL_SUITE, "gates": ["ppl_ratio <= 1.1"]})],
        "pass --baseline MODEL",
    ),
    (
        "eval-kld-gate-without-baseline",
        lambda e: [
            "eval",
            str(e.model),
            "--suite",
            suite(e, {"eval": {"perplexity": {**PERPLEXITY, "kld": {"top_k": 8}}}, "gates": ["kld_mean <= 1"]}),
        ],
        "pass --baseline MODEL",
    ),
    ("eval-binary-suite", lambda e: ["eval", str(e.model), "--suite", e.file("s.yaml", b"\xff\xfe")], "not UTF-8"),
    ("eval-malformed-suite", lambda e: ["eval", str(e.model), "--suite", e.file("s.yaml", "eval: [")], "malformed"),
    ("eval-suite-is-a-list", lambda e: ["eval", str(e.model), "--suite", suite(e, [1])], "a suite is a YAML mapping"),
    ("eval-missing-suite", lambda e: ["eval", str(e.model), "--suite", str(e.tmp / "nope.yaml")], "does not exist"),
    ("eval-unknown-eval", lambda e: ["eval", str(e.model), "--suite", suite(e, {"eval": {"bleu": {}}})], "bleu"),
    ("eval-missing-model", lambda e: ["eval", str(e.tmp / "nope"), "--suite", suite(e, PPL_SUITE)], "does not exist"),
    (
        "eval-truncated-baseline",
        lambda e: ["eval", str(e.model), "--baseline", str(truncated_weights(e)), "--suite", suite(e, PPL_SUITE)],
        "not a readable safetensors file",
    ),
    (
        "eval-out-is-a-file",
        lambda e: ["eval", str(e.model), "--suite", suite(e, PPL_SUITE), "--out", e.file("o", "x")],
        "exists and is not a directory",
    ),
    ("eval-junit-is-a-directory", lambda e: ["eval", str(e.model), "--junit", str(e.tmp)], "is a directory"),
    ("run-junit-is-a-directory", lambda e: run_args(e, e.tmp / "o", "--junit", str(e.tmp)), "is a directory"),
    ("inspect-missing", lambda e: ["inspect", str(e.tmp / "nope")], "no such file or directory"),
    ("inspect-a-file", lambda e: ["inspect", e.file("x.bin", b"\x00")], "inspect reads checkpoint directories"),
    ("inspect-non-artifact", lambda e: ["inspect", str(Path(e.file("d/x.txt", "hi")).parent)], "neither a checkpoint"),
    ("inspect-corrupt-config", lambda e: ["inspect", str(bad_config("{oops")(e))], "not valid JSON"),
    ("inspect-truncated-weights", lambda e: ["inspect", str(truncated_weights(e))], "not a readable safetensors"),
    ("compare-missing-runs", lambda e: ["compare", str(e.tmp / "a"), str(e.tmp / "b")], "no report.json"),
    (
        "compare-corrupt-report",
        lambda e: ["compare", e.file("a/report.json", "{"), e.file("b/report.json", "{")],
        "not valid JSON",
    ),
]


def damaged_run(env: Env) -> str:
    """A run directory whose hf/ export was changed after its manifest was written."""
    from lmpress.export.manifest import write_manifest

    run = env.tmp / "run"
    shutil.copytree(env.model, run / "hf")
    write_manifest(run, recipe={}, metrics={})
    with open(run / "hf" / "config.json", "a") as f:
        f.write(" ")
    return str(run / "hf")


def other_tokenizer(env: Env) -> str:
    """A copy of the model whose tokenizer maps two tokens to each other's ids (same size, different vocabulary)."""
    copy = env.model_copy("draft")
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return str(copy)


def without_gpu(argv: list[str]) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: --device cuda is valid here")
    return argv


def gen(env: Env, *extra: str) -> list[str]:
    return ["generate", str(env.model), "--prompt", "def f(x):", "--max-new-tokens", "4", *extra]


CLI_CASES += [
    ("generate-prompt-too-long", lambda e: ["generate", str(e.model), "--prompt", "word " * 2000], "context of 512"),
    ("generate-top-p", lambda e: gen(e, "--top-p", "1.5"), "top_p must lie in (0, 1]"),
    ("generate-draft-tokenizer", lambda e: gen(e, "--draft", other_tokenizer(e)), "tokenizer differs"),
    ("generate-damaged-artifact", lambda e: ["generate", damaged_run(e), "--prompt", "x"], "does not match"),
    ("generate-cuda-without-gpu", lambda e: without_gpu(gen(e, "--device", "cuda")), "no CUDA GPU"),
    ("generate-unknown-device", lambda e: gen(e, "--device", "tpu"), "is not one of cpu, cuda"),
    ("bench-prompt-too-long", lambda e: ["bench", str(e.model), "--prompt-tokens", "400"], "context of 512"),
    ("bench-one-new-token", lambda e: ["bench", str(e.model), "--new-tokens", "1"], "--new-tokens must be >= 2"),
    ("bench-damaged-artifact", lambda e: ["bench", damaged_run(e)], "does not match"),
    ("bench-draft-tokenizer", lambda e: ["bench", str(e.model), "--draft", other_tokenizer(e)], "tokenizer differs"),
    ("bench-cuda-without-gpu", lambda e: without_gpu(["bench", str(e.model), "--device", "cuda"]), "no CUDA GPU"),
    ("bench-json-is-a-directory", lambda e: ["bench", str(e.model), "--json", str(e.tmp)], "is a directory"),
]


@pytest.mark.parametrize(("build", "fragment"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input_is_exit_2(env, capsys, build, fragment):
    argv = build(env)
    before = {p: p.stat().st_mtime_ns for p in env.tmp.rglob("*") if p.is_file()}
    code = main(argv)
    assert_one_line_error(code, capsys.readouterr().err, fragment)
    for path, mtime in before.items():  # nothing the user had is rewritten or removed
        assert path.exists() and path.stat().st_mtime_ns == mtime, path


@pytest.mark.parametrize(
    "stage",
    [
        {"method": "rtn", "bits": 4, "group_size": 32},
        # SparseGPT's joint quantization writes quantized layers too: the plan checks see them before any work
        {"method": "sparsegpt", "pattern": "2:4", "quantize": {"bits": 4, "group_size": 32}},
    ],
    ids=["rtn", "sparsegpt-quantize"],
)
@pytest.mark.parametrize(
    ("fmt", "fragment"),
    [
        ("gguf", "export gguf: architecture 'opt' is not written by lmpress's GGUF writer"),
        ("onnx", "export onnx: architecture 'opt' is not written by lmpress's ONNX exporter"),
    ],
)
def test_export_of_unsupported_architecture_is_exit_2(env, capsys, monkeypatch, tiny_opt_dir, fmt, fragment, stage):
    def no_weights(*args, **kwargs):
        raise AssertionError("the plan was not refused before the weights were loaded")

    monkeypatch.setattr("lmpress.pipeline.load_model", no_weights)
    raw = base_recipe(env)
    raw["model"]["source"] = str(tiny_opt_dir)
    raw["stages"] = [stage]
    raw["export"]["formats"] = [fmt]
    out = out_with_a_file(env.tmp)
    code = main(["run", env.recipe(raw), "--out", str(out), "--overwrite", "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, fragment)
    assert sorted(p.name for p in out.iterdir()) == [SENTINEL]


def truncated_gguf(env: Env) -> str:
    return env.file("model.gguf", b"GGUF\x03\x00\x00\x00" + b"\x01" * 40)


def test_truncated_gguf_is_exit_2(env, capsys):
    code = main(["eval", truncated_gguf(env), "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, "model.gguf")


def test_fp8_without_float8_dtypes_is_exit_2(env, capsys, monkeypatch):
    raw = base_recipe(env)
    raw["stages"] = [{"method": "fp8"}]
    raw["export"]["formats"] = ["compressed-tensors"]
    monkeypatch.delattr(torch, "float8_e4m3fn")
    out = out_with_a_file(env.tmp)
    code = main(["run", env.recipe(raw), "--out", str(out), "--overwrite", "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, "stage fp8: the installed torch")
    assert sorted(p.name for p in out.iterdir()) == [SENTINEL]


def test_corpus_size():
    assert len(RECIPE_CASES) + len(CLI_CASES) >= 50
