"""Serving how-to that runs (docs/serving.md, issue 40 part 3): each server the page names is started on an lmpress
export of a tiny random Llama with the page's command, asked for one greedy completion over HTTP, and its answer
compared with lmpress's runtime (``generate_text``, as ``lmpress generate`` runs). ONNX Runtime has no server of
its own: its in-process session is run as the page shows. Each consumer that is not installed skips, saying so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmpress.evals.agreement_matrix import PROMPTS, build_candidate, scheme_named
from lmpress.evals.vllm_consumer import vllm_python
from lmpress.export.consumers import vllm_cpu_runs_wna16
from lmpress.registry import exporter
from lmpress.runtime.text import generate_text
from tests.quantize.test_awq import calibration_for

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
PROMPT = PROMPTS[0]
NEW_TOKENS = 8
# the page's commands, with EXPORT and PORT filled in by the test
# vllm-cpu 0.32.0's `vllm serve` dies at start (it asks importlib.metadata for a distribution named "vllm"; this
# one is "vllm-cpu"), so the page and the test start the same server by its module
VLLM_SERVE = (
    "python -m vllm.entrypoints.openai.api_server --model EXPORT --port PORT --max-model-len 512 --enforce-eager"
)
LLAMA_CPP_SERVE = "python -m llama_cpp.server --model EXPORT/model.gguf --port PORT"


@pytest.fixture(scope="module")
def exports(tiny_llama_wide_dir, tmp_path_factory):
    """W4 g32 symmetric: compressed-tensors (vLLM), GGUF Q4_0 (llama.cpp), ONNX MatMulNBits (ONNX Runtime)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_wide_dir)
    root = tmp_path_factory.mktemp("serving")
    candidate = build_candidate(
        tiny_llama_wide_dir, scheme_named("W4 g32 sym"), calibration_for(tokenizer), root / "state"
    )
    written = {}
    for fmt in ("compressed-tensors", "gguf", "onnx"):
        out = root / fmt
        out.mkdir()
        exporter(fmt)(candidate, tokenizer, out)
        written[fmt] = out
    return written


def lmpress_answer(export: Path) -> str:
    """What ``lmpress generate EXPORT --max-new-tokens 8 --temperature 0`` prints after the prompt."""
    pieces: list[str] = []
    generate_text(str(export), PROMPT, max_new_tokens=NEW_TOKENS, sampling={"temperature": 0.0}, on_text=pieces.append)
    answer = "".join(pieces)
    assert answer.strip(), "the runtime's answer is empty: nothing to compare"
    return answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def serve(command: list[str], port: int, log: Path, env: dict[str, str], ready_s: float = 600) -> subprocess.Popen:
    """Start a server and wait until it answers /v1/models (or fail with its log's tail)."""
    sink = log.open("w")
    server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
            return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    server.kill()
    tail = " | ".join(log.read_text().strip().splitlines()[-5:])
    pytest.fail(f"{command[0]} did not start (exit {server.poll()}): {tail}")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def command_line(template: str, export: Path, port: int) -> list[str]:
    return template.replace("EXPORT", str(export)).replace("PORT", str(port)).split()


def test_the_page_shows_the_commands_the_tests_run():
    page = DOC.read_text()
    assert VLLM_SERVE.replace("EXPORT", "out/w4/compressed-tensors").replace("PORT", "8000") in page
    assert LLAMA_CPP_SERVE.replace("EXPORT", "out/w4/gguf").replace("PORT", "8000") in page


@pytest.fixture(scope="module")
def vllm_env() -> Path:
    """The vLLM environment's python (skips before any export is written when there is none)."""
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM's environment is not installed (docs/serving.md; set LMPRESS_VLLM_PYTHON)")
    return python


@pytest.fixture(scope="module")
def vllm_export(vllm_env, exports, tiny_llama_wide_dir, tmp_path_factory) -> Path:
    """The W4 compressed-tensors export; on an AVX2-only CPU, where vLLM's CPU build has no 4-bit weight-only
    kernel (lmpress.export.consumers.vllm_cpu_runs_wna16), the same model as W8A8 int8, which it runs."""
    if vllm_cpu_runs_wna16():
        return exports["compressed-tensors"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_wide_dir)
    root = tmp_path_factory.mktemp("serving-w8a8")
    scheme = scheme_named("W8A8 int8 (SmoothQuant)")
    candidate = build_candidate(tiny_llama_wide_dir, scheme, calibration_for(tokenizer), root / "state")
    out = root / "compressed-tensors"
    out.mkdir()
    exporter("compressed-tensors")(candidate, tokenizer, out)
    return out


@pytest.mark.long
def test_vllm_serve_answers_as_lmpress_generates(vllm_env, vllm_export, tmp_path):
    python = vllm_env
    export = vllm_export
    port = free_port()
    command = command_line(VLLM_SERVE, export, port)
    command[0] = str(python)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    server = serve(command, port, tmp_path / "vllm.log", env)
    try:
        ids = AutoTokenizer.from_pretrained(export)(PROMPT, add_special_tokens=False)["input_ids"]
        body = {"model": str(export), "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        answer = post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["text"]
    finally:
        stop(server)
    assert answer == lmpress_answer(export)


def test_llama_cpp_server_answers_as_lmpress_generates(exports, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("starlette_context", reason="llama-cpp-python[server] extras are not installed")
    export = exports["gguf"]
    port = free_port()
    command = command_line(LLAMA_CPP_SERVE, export, port)
    command[0] = sys.executable
    server = serve(command, port, tmp_path / "llama.log", dict(os.environ))
    try:
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        reply = post(f"http://127.0.0.1:{port}/v1/completions", body)
    finally:
        stop(server)
    ids = AutoTokenizer.from_pretrained(export)(PROMPT, add_special_tokens=False)["input_ids"]
    assert reply["usage"]["prompt_tokens"] == len(ids)  # the same prompt tokens: no BOS added on either side
    assert reply["choices"][0]["text"] == lmpress_answer(export)


def test_onnx_runtime_session_answers_as_lmpress_generates(exports):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    from lmpress.export.onnx import FILE_NAME, greedy_generate, onnx_session

    export = exports["onnx"]
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    tokens = greedy_generate(onnx_session(export / FILE_NAME), ids, NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(tokens) == lmpress_answer(export)
