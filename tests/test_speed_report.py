"""A recipe's ``speed:`` section (size and decode speed before and after, on lmpress's runtime) and the paths a
report records, through the CLI on a tiny random Llama."""

import json
import math
from pathlib import Path

import pytest
import yaml

from lmpress.cli import main


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    # DenseLinear times two matmul forms per weight shape over 128 MiB of copies (tests/runtime cover it): for the
    # tiny model's small weights that is ~100k products, minutes on a busy 2-core machine, and no part of this test
    monkeypatch.setattr("lmpress.runtime.kernels.cpu.weight_left_is_faster", lambda *shape: (False, False))


def files_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def quickstart_like_recipe(tmp_path: Path, model_dir: Path, **changes) -> str:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "rtn", "bits": 4, "group_size": 32, "symmetric": True}],
        "export": {"formats": ["compressed-tensors", "gguf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2}},
        # 16 tokens, median of 3: a tiny model makes 4 tokens in a few ms, which one stall of a loaded CI machine
        # during the 1-token run outlasted (decode rate nan: 4 tokens timed no slower than 1)
        "speed": {"prompt_tokens": 8, "new_tokens": 16, "repeats": 3},
        "gates": ["ppl_ratio <= 100"],
    }
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.long
def test_report_and_console_give_size_and_decode_speed_before_and_after(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", quickstart_like_recipe(tmp_path, tiny_llama_dir), "--out", str(out)]) == 0
    section = json.loads((out / "report.json").read_text())["size_and_speed"]
    rows = {row["model"]: row for row in section["rows"]}
    assert list(rows) == ["baseline (float32, as loaded)", "compressed-tensors/", "gguf/"]
    assert rows["baseline (float32, as loaded)"]["size_mb"] == pytest.approx(files_mb(tiny_llama_dir))
    for fmt in ("compressed-tensors", "gguf"):
        row = rows[f"{fmt}/"]
        assert row["size_mb"] == pytest.approx(files_mb(out / fmt))  # the directory as shipped
        assert row["times_smaller"] == pytest.approx(rows["baseline (float32, as loaded)"]["size_mb"] / row["size_mb"])
        assert row["times_faster"] == pytest.approx(
            row["decode_tok_s"] / rows["baseline (float32, as loaded)"]["decode_tok_s"]
        )
    assert all(math.isfinite(row["decode_tok_s"]) and row["decode_tok_s"] > 0 for row in rows.values())
    markdown = (out / "report.md").read_text()
    assert "## Size and speed" in markdown and "| gguf/ |" in markdown and "| compressed-tensors/ |" in markdown
    console = capsys.readouterr().out
    assert "size and decode speed" in console and "gguf/" in console


def test_report_names_the_tokenizer_where_the_run_leaves_it(tiny_llama_dir, tmp_path):
    """The run writes into .OUT.partial/ and renames it: the report must not name the partial directory."""
    out = tmp_path / "run"
    recipe = quickstart_like_recipe(tmp_path, tiny_llama_dir, speed=None, export={"formats": ["hf"]})
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 0
    report_json, report_md = (out / "report.json").read_text(), (out / "report.md").read_text()
    assert ".partial" not in report_json and ".partial" not in report_md
    tokenizer = json.loads(report_json)["candidate"]["protocol"]["perplexity"]["tokenizer"]
    assert tokenizer == str(out / "hf") and (Path(tokenizer) / "tokenizer.json").exists()


def test_speed_section_rejects_unknown_keys(tiny_llama_dir, tmp_path, capsys):
    recipe = quickstart_like_recipe(tmp_path, tiny_llama_dir, speed={"new_tokns": 4})
    assert main(["run", recipe, "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "speed.new_tokns: unknown key" in err and "\n" not in err
