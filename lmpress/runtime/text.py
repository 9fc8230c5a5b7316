"""Text in, text out on the runtime: what ``lmpress generate`` runs.

Loads any model or export lmpress reads (``lmpress.loader.load_model``: manifest
checked, quantized layers kept packed), builds the runtime decoder from it and
streams decoded text as tokens come, plain or speculative (a draft model, or
prompt lookup).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmpress.data import BUILTIN_PYTHON_DOCS, load_text
from lmpress.errors import LmpressInputError
from lmpress.export.speculators import export_fingerprint
from lmpress.memory import return_freed_memory
from lmpress.runtime.eagle3 import Eagle3Head, decoding_head_step, load_draft_head
from lmpress.runtime.generate import cache_length, compile_steps, decoding_forward, decoding_step, generate_tokens
from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS, check_cpu_activations
from lmpress.runtime.model import MOE_TYPES, Transformer
from lmpress.runtime.sample import SamplingConfig
from lmpress.runtime.speculative import (
    PromptLookupDrafter,
    SpeculativeStats,
    check_same_vocabulary,
    frequent_tokens,
    restrict_vocabulary,
    speculative_decode,
)
from lmpress.weights.kv_quant import KVQuant


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    seconds: float = 0.0  # from the prompt's prefill to the last token
    speculative: SpeculativeStats | None = None
    load_seconds: float = 0.0  # reading the model (and any draft) before the prefill
    compile_seconds: float = 0.0  # compiling the decode step (--compile), once, before the prefill
    first_token_seconds: float = 0.0  # the prefill and the first token, after loading
    since_start: float | None = None  # from the process's start to the first token

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first, as ``lmpress bench`` counts decoding."""
        after = self.seconds - self.first_token_seconds
        return (len(self.tokens) - 1) / after if len(self.tokens) > 1 and after > 0 else float("nan")

    def summary(self) -> str:
        line = (
            f"{len(self.tokens)} new tokens after a {self.prompt_tokens}-token prompt: loaded in "
            f"{self.load_seconds:.1f} s, "
            + (f"compiled its decode step in {self.compile_seconds:.1f} s, " if self.compile_seconds else "")
            + f"first token {self.first_token_seconds:.2f} s later"
        )
        if self.since_start is not None:
            line += f" ({self.since_start:.1f} s after the command started)"
        line += f", then {self.decode_rate:.1f} tok/s"
        if self.speculative is not None and self.speculative.target_steps:
            line += (
                f"; acceptance {self.speculative.acceptance_rate:.2f}, "
                f"{self.speculative.tokens_per_step:.2f} tokens per target step"
            )
        return line


def _seconds_since_process_start() -> float | None:
    import psutil

    try:
        return time.time() - psutil.Process().create_time()
    except psutil.Error:
        return None


def _timing_first(tokens: Iterator[int], result: GenerationResult, began: float) -> Iterator[int]:
    """``tokens``, noting in ``result`` when the first arrives."""
    for i, token in enumerate(tokens):
        if i == 0:
            result.first_token_seconds = time.perf_counter() - began
            result.since_start = _seconds_since_process_start()
        yield token


DEVICES = ("cpu", "cuda")


def resolve_device(requested: str | None) -> tuple[torch.device, str]:
    """``--device`` and why it was chosen: ``cuda`` needs a GPU (else an input error); unset picks CUDA when present."""
    from lmpress.placement import resolve_device as resolve

    if requested is not None and requested not in DEVICES:
        raise LmpressInputError(f"--device {requested!r} is not one of {', '.join(DEVICES)}")
    device = resolve(requested, "--device")
    if requested is not None:
        return device, f"--device {requested}"
    return device, "a CUDA GPU was found" if device.type == "cuda" else "no CUDA GPU found"


def load_runtime(
    source: str,
    device: torch.device | str = "cpu",
    dtype: str | None = None,
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
) -> tuple[Transformer, Any]:
    """The runtime model and tokenizer of any model or export lmpress reads (the manifest is checked).

    ``dtype`` defaults to float32 on the CPU and bfloat16 on CUDA, where the Triton kernels take half-precision
    activations; a float32 CPU build keeps a checkpoint's bfloat16 or float16 float weights as stored
    (``Build.dense_dtype``: float32 products, half the bytes). On the CPU, weight-only quantized layers take their
    activations as ``cpu_activations``: "int8" (per 4 values, lmpress's kernels, where they hold the layer) or
    "bf16" (torch's packed kernels). A checkpoint directory (dense, GPTQ, AWQ, compressed-tensors; a .gguf or
    pypkg: source once converted) is read straight into the runtime (``checkpoint.py``: memory-mapped, no
    transformers model); other exports (GGUF and ONNX directories, bitsandbytes) go through
    ``lmpress.loader.load_model``.
    """
    check_cpu_activations(cpu_activations)
    device = torch.device(device)
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    checkpoint = _direct_checkpoint(source)
    if checkpoint is not None:
        from lmpress.loader import DTYPES
        from lmpress.placement import require_capability
        from lmpress.weights.float8 import FP8_CAPABILITY

        # FP8 weights need FP8 tensor cores; NVFP4's E4M3 block scales (``weight_scale``) are only widened to float
        if device.type == "cuda" and any(d.startswith("F8") for d in stored_dtypes(checkpoint, ".weight")):
            require_capability(device, FP8_CAPABILITY, f"{source} (FP8 layers)")
        from lmpress.runtime.checkpoint import load_checkpoint
        from lmpress.runtime.tokenizer import RuntimeTokenizer

        model = load_checkpoint(checkpoint, DTYPES[dtype], device, cpu_activations=cpu_activations)
        tokenizer = RuntimeTokenizer(checkpoint)
        # after both: parsing tokenizer.json leaves ~13 MiB freed in the heap (bench/load_memory.py)
        return_freed_memory()
        return model, tokenizer
    decoded = _decoded_export(source)
    if decoded is not None:
        from lmpress.loader import DTYPES
        from lmpress.runtime.checkpoint import load_decoded
        from lmpress.runtime.tokenizer import RuntimeTokenizer

        path, (values, tensors) = decoded
        model = load_decoded(path, values, tensors, DTYPES[dtype], device, cpu_activations)
        del decoded, tensors  # the runtime holds its own copies
        tokenizer = RuntimeTokenizer(path)
        return_freed_memory()
        return model, tokenizer
    from lmpress.loader import load_model
    from lmpress.weights.float8 import require_fp8_kernels

    loaded = load_model(source, dtype, fingerprint=False)  # the runtime needs no weights hash
    require_fp8_kernels(loaded.model, device, source)
    model = Transformer.from_hf(loaded.model, device=device, cpu_activations=cpu_activations)
    tokenizer = loaded.tokenizer
    del loaded  # the transformers model: the runtime holds copies of what it needs
    return_freed_memory()
    return model, tokenizer


def stored_dtypes(checkpoint: Path, suffix: str = "") -> set[str]:
    """The safetensors dtype names (F32, BF16, F8_E4M3...) of the tensors in ``checkpoint``'s files whose names end
    with ``suffix``, from their headers alone."""
    from lmpress.checkpoint_files import safetensors_header

    dtypes = set()
    for file in checkpoint.glob("*.safetensors"):
        dtypes |= {dtype for key, (dtype, _) in safetensors_header(file).items() if key.endswith(suffix)}
    return dtypes


def _decoded_export(source: str) -> tuple[Path, tuple[dict[str, Any], dict[str, Any]]] | None:
    """A single-file export directory whose format decodes its tensors for the runtime (GGUF, ONNX), after its
    manifest check and its reader's: (directory, (config values, tensors)); else None."""
    from lmpress.export.manifest import verify_artifact
    from lmpress.registry import artifact_format

    path = Path(os.path.expanduser(source))
    fmt = artifact_format(path) if path.is_dir() and not (path / "config.json").exists() else None
    if fmt is None or fmt.read_tensors is None or not (path / "tokenizer.json").is_file():
        return None
    verify_artifact(path)
    values, tensors = fmt.read_tensors(path)
    if values.get("model_type") in MOE_TYPES:
        return None  # mixtures of experts are read through transformers (checkpoint.py refuses them)
    return path, (values, tensors)


def _direct_checkpoint(source: str) -> Path | None:
    """The checkpoint directory of ``source`` when the runtime reads it itself (manifest checked), else None."""
    from lmpress.checkpoint_files import quant_method
    from lmpress.export.formats import artifact_loader
    from lmpress.export.manifest import verify_artifact
    from lmpress.loader import check_checkpoint_dir, resolve_checkpoint
    from lmpress.registry import reading_format

    if artifact_loader(Path(os.path.expanduser(source))) is not None:  # GGUF / ONNX export directories
        return None
    path = resolve_checkpoint(source)
    try:
        config = check_checkpoint_dir(path)
    except LmpressInputError:
        return None  # load_model checks the manifest first, then says what is wrong
    if config.get("model_type") in MOE_TYPES:
        return None  # mixtures of experts are read through transformers (checkpoint.py refuses them)
    method = quant_method(config)
    if not (path / "tokenizer.json").is_file() or (method is not None and reading_format(method) is None):
        return None  # load_model checks the manifest (once)
    verify_artifact(path)
    return path


def load_draft(
    source: str | None,
    target: Transformer,
    target_tokenizer: Any,
    device: torch.device | str,
    dtype: str | None = None,
    vocabulary: int | None = None,
    vocabulary_text: str = BUILTIN_PYTHON_DOCS,
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
) -> Transformer | None:
    """A draft model for ``target`` (None without ``source``), refused when its tokenizer differs from the
    target's; with ``vocabulary``, scoring only that many tokens, the most frequent in ``vocabulary_text``
    (``restrict_vocabulary``); ``cpu_activations`` as ``load_runtime``'s."""
    if source is None:
        if vocabulary is not None:
            raise LmpressInputError("--draft-vocab cuts a draft model's vocabulary: give --draft")
        return None
    draft, draft_tokenizer = load_runtime(source, device, dtype, cpu_activations)
    check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
    if vocabulary is not None:
        text = load_text(vocabulary_text, default_split="train").text
        ids = torch.tensor(target_tokenizer.encode(text, add_special_tokens=False))
        restrict_vocabulary(draft, frequent_tokens(ids, vocabulary, draft.args.vocab_size))
    return draft


def draft_head_for(folder: str | None, source: str, model: Transformer) -> Eagle3Head | None:
    """The EAGLE-3 head in ``folder`` (None without one) for ``model``, read from ``source``: refused where it was
    trained for another target (``load_draft_head``)."""
    if folder is None:
        return None
    return load_draft_head(
        Path(os.path.expanduser(folder)), model, export_fingerprint(Path(os.path.expanduser(source)))
    )


def _text_pieces(tokenizer: Any, tokens: Iterator[int], out: list[int]) -> Iterator[str]:
    """Decoded text as it grows (a piece is emitted once the tokens so far decode to more text)."""
    shown = ""
    for token in tokens:
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if len(text) > len(shown) and not text.endswith("\ufffd"):  # wait out half a multi-byte character
            yield text[len(shown) :]
            shown = text


def generate_text(
    source: str,
    prompt: str,
    max_new_tokens: int = 128,
    sampling: dict[str, Any] | None = None,
    seed: int | None = 0,
    draft: str | None = None,
    prompt_lookup: bool = False,
    device: torch.device | str = "cpu",
    on_text: Callable[[str], None] = print,
    draft_vocab: int | None = None,
    draft_vocab_text: str = BUILTIN_PYTHON_DOCS,
    compile: bool = False,
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
    kv_quant: KVQuant | None = None,
    draft_head: str | None = None,
) -> GenerationResult:
    """Generate from ``prompt`` with the model at ``source``; ``on_text`` receives the text as it comes.
    ``draft_vocab``, ``draft_vocab_text``: ``load_draft``'s ``vocabulary`` and ``vocabulary_text``;
    ``compile``: decode (and draft and verify) through ``torch.compile``'d steps, CUDA graphs on a GPU;
    ``cpu_activations``: ``load_runtime``'s (target and draft); ``kv_quant``: the target's KV cache quantized;
    ``draft_head``: the folder of an EAGLE-3 head trained for ``source`` (``load_draft_head``)."""
    if sum((draft is not None, prompt_lookup, draft_head is not None)) > 1:
        raise LmpressInputError("--draft, --prompt-lookup and --draft-head are kinds of draft: choose one")
    if max_new_tokens < 1:
        raise LmpressInputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    config = SamplingConfig(**(sampling or {}))
    loading = time.perf_counter()
    model, tokenizer = load_runtime(source, device, cpu_activations=cpu_activations)
    model.kv_quant = kv_quant
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise LmpressInputError("the prompt is empty")
    common = dict(max_new_tokens=max_new_tokens, sampling=config, eos_token_id=tokenizer.eos_token_id, seed=seed)
    draft_model = load_draft(
        draft, model, tokenizer, device, None, draft_vocab, draft_vocab_text, cpu_activations=cpu_activations
    )
    head = draft_head_for(draft_head, source, model)
    result = GenerationResult(prompt_tokens=len(ids), load_seconds=time.perf_counter() - loading)
    speculative = draft is not None or prompt_lookup or head is not None
    step = decoding_step(model.device, compile)
    if compile and not speculative:  # speculative_decode compiles its reads itself, before its first round
        compiling = time.perf_counter()
        compile_steps(step, model, cache_length(len(ids), max_new_tokens, model.args.max_seq_len), config)
        result.compile_seconds = time.perf_counter() - compiling
    began = time.perf_counter()
    if speculative:
        result.speculative = SpeculativeStats()
        tokens = speculative_decode(
            model,
            ids,
            draft=draft_model,
            draft_head=head,
            prompt_lookup=PromptLookupDrafter() if prompt_lookup else None,
            stats=result.speculative,
            forward=decoding_forward(model.device, compile),
            head_step=decoding_head_step(compile),
            **common,
        )
    else:
        steps = generate_tokens(model, ids, step=step, **common)
        tokens = (int(step[0]) for step in steps if int(step[0]) >= 0)
    for piece in _text_pieces(tokenizer, _timing_first(tokens, result, began), result.tokens):
        on_text(piece)
    result.seconds = time.perf_counter() - began
    return result
