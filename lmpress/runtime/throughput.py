"""What ``lmpress bench`` measures on the runtime: time to first token, prefill and decode speed,
bytes read per decoded token against the machine's measured memory bandwidth, peak memory, and
for speculative decoding its acceptance and its speedup over plain decoding in the same run.

Each result names the kernel that ran every linear layer (``kernels``: module path -> ``select.KERNELS``
name), so a number is never read without knowing what produced it.

Decode tok/s = (N - 1) / (t(N new tokens) - t(1 new token)), so prefill and setup cancel
out; each time is the median of ``repeats`` runs. Bytes per token = every distinct weight
tensor (a tied embedding counts once, the RoPE tables not at all) + the KV cache read at the
mean decode length. The ceiling is a large tensor copy timed in the same process
(read + write bytes over time, as STREAM's copy counts them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import track_peak_rss
from lmpress.runtime.eagle3 import Eagle3Head, decoding_head_step
from lmpress.runtime.generate import ForwardFn, StepFn, decoding_forward, decoding_step, generate
from lmpress.runtime.model import Transformer
from lmpress.runtime.speculative import PromptLookupDrafter, SpeculativeStats, compile_rounds, speculative_decode
from lmpress.weights.kv_quant import cache_bytes_per_token

COPY_MEGABYTES = 512


@dataclass(frozen=True)
class BenchSettings:
    new_tokens: int = 256
    repeats: int = 3
    compile: bool = False  # time a torch.compile'd decode step (the warm-up run pays the compile)

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise LmpressInputError(f"--new-tokens must be >= 2 to time decoding, got {self.new_tokens}")
        if self.repeats < 1:
            raise LmpressInputError(f"--repeats must be >= 1, got {self.repeats}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device | str = "cpu", megabytes: int = COPY_MEGABYTES, repeats: int = 5) -> float:
    """The machine's memory bandwidth as a large copy sees it: 2 x bytes / seconds, best of ``repeats``."""
    device = torch.device(device)
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best / 1e9


def layer_kernels(model: Transformer) -> dict[str, str]:
    """The kernel (``kernels.kernel_of``) of every linear layer of ``model``, by module path:
    ``layers.3.attention.wqkv`` (fused q/k/v; ``.0``, ``.1``, ``.2`` where they run apart), ..., ``output``."""
    from lmpress.runtime.kernels import kernel_of
    from lmpress.runtime.linears import FusedLinear

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedLinear):
            for j, part in enumerate(module.parts):
                found[name if len(module.parts) == 1 else f"{name}.{j}"] = kernel_of(part)
    found["output"] = kernel_of(model.output)
    return found


def kernel_rows(kernels: dict[str, str]) -> list[tuple[str, str]]:
    """``layer_kernels`` for a table: one row per layer role (``attention.wqkv``, ...), its kernels and how many layers
    run each."""
    roles: dict[str, dict[str, int]] = {}
    for path, kernel in kernels.items():
        role = path.split(".", 2)[2] if path.startswith("layers.") else path
        counts = roles.setdefault(role, {})
        counts[kernel] = counts.get(kernel, 0) + 1
    return [
        (f"kernel of {role}", ", ".join(f"{kernel} ({n} layer{'s' if n > 1 else ''})" for kernel, n in counts.items()))
        for role, counts in roles.items()
    ]


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads: every distinct parameter and buffer but the RoPE tables and the
    embedding table, of which a step reads one row (unless it is tied to the output layer, read whole)."""
    seen, total = set(), 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    # Buffers only a prefill reads (``PREFILL_ONLY``: tinygemm's nibble pairs beside the GPU layout) do not count.
    prefill_only = {f"{name}.{b}" for name, m in model.named_modules() for b in getattr(m, "PREFILL_ONLY", ())}
    for name, tensor in tensors:
        if tensor is None or "rope_" in name or name.startswith("tok_embeddings.") or name in prefill_only:
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def kv_cache_bytes(model: Transformer, length: int) -> int:
    """Bytes of keys and values (a quantized cache's codes and scales) a decode step reads with ``length`` tokens
    in the cache."""
    args = model.args
    element = torch.empty((), dtype=model.dtype).element_size()
    scheme = None if model.kv_quant is None else model.kv_quant.scheme
    per_token = cache_bytes_per_token(scheme, args.n_layers, args.n_kv_heads, args.head_dim, args.value_dim, element)
    return round(per_token * length)


def median_seconds(run: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generation_times(
    generate_n: Callable[[int], Any], new_tokens: int, repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds to generate 1 and ``new_tokens`` tokens (after a warm-up run of the same length, which
    also compiles a compiled step for this cache size)."""
    return interleaved_generation_times({"run": generate_n}, new_tokens, repeats, device)["run"]


def interleaved_generation_times(
    runs: dict[str, Callable[[int], Any]], new_tokens: int, repeats: int, device: torch.device
) -> dict[str, tuple[float, float]]:
    """``generation_times`` of several ways to generate, timed in turn within each repeat, so that a machine
    whose speed drifts (a shared VM's: plain decoding ran 55-62 tok/s across bench/distill_table.py's three
    processes) slows them alike and their ratio holds."""
    for generate_n in runs.values():
        generate_n(new_tokens)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
    for _ in range(repeats):
        for name, generate_n in runs.items():
            for n, samples in zip((1, new_tokens), times[name], strict=True):
                synchronize(device)
                start = time.perf_counter()
                generate_n(n)
                synchronize(device)
                samples.append(time.perf_counter() - start)
    return {name: (statistics.median(one), statistics.median(many)) for name, (one, many) in times.items()}


def decode_rate(times: tuple[float, float], new_tokens: int) -> float:
    one, many = times
    return (new_tokens - 1) / (many - one) if many > one else float("nan")


def running_peak_mb(run: Callable[[], Any], device: torch.device) -> float:
    """Peak memory while ``run`` runs: resident set (MiB) on the CPU, allocated GPU memory on CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        run()
        return torch.cuda.max_memory_allocated(device) / 2**20
    with track_peak_rss() as peak:
        run()
    return peak.mb


def bench_plain(
    model: Transformer,
    prompt: list[int],
    settings: BenchSettings,
    bandwidth_gbs: float | None = None,
    step: StepFn | None = None,
) -> dict[str, Any]:
    """One row: prefill and decode speed of plain decoding (``step``: default ``decoding_step``, the step
    ``lmpress generate`` runs), bytes per token, memory."""
    device = model.device
    step = step or decoding_step(device, settings.compile)

    def run(n: int) -> list[int]:
        return generate(model, prompt, max_new_tokens=n, step=step)[0]

    times = generation_times(run, settings.new_tokens, settings.repeats, device)
    rate = decode_rate(times, settings.new_tokens)
    per_token = weight_bytes(model) + kv_cache_bytes(model, len(prompt) + settings.new_tokens // 2)
    row = {
        "prompt_tokens": len(prompt),
        "new_tokens": settings.new_tokens,
        "ttft_s": times[0],
        "prefill_tok_s": len(prompt) / times[0],
        "decode_tok_s": rate,
        "bytes_per_token": per_token,
        "kv_cache_bytes_per_token": kv_cache_bytes(model, 1),
        "decode_gb_s": rate * per_token / 1e9,
        "peak_memory_mb": running_peak_mb(lambda: run(settings.new_tokens), device),
    }
    if bandwidth_gbs:
        row["bandwidth_gb_s"] = bandwidth_gbs
        row["bandwidth_pct"] = 100 * row["decode_gb_s"] / bandwidth_gbs
    return row


def bench_speculative(
    model: Transformer,
    prompt: list[int],
    settings: BenchSettings,
    plain: dict[str, Any],
    draft: Transformer | None = None,
    forward: ForwardFn | None = None,
    draft_head: Eagle3Head | None = None,
    step: StepFn | None = None,
) -> dict[str, Any]:
    """Greedy speculative decoding (``draft``, an EAGLE-3 ``draft_head``, else prompt lookup) against plain
    decoding, the two timed in turn (``interleaved_generation_times``; ``plain``, the plain row timed before, is
    reported beside).

    With ``settings.compile`` the draft's (or the draft head's) steps and the target's verifying forwards are
    compiled, as the plain steps are."""
    stats = SpeculativeStats()
    forward = forward or decoding_forward(model.device, settings.compile)
    step = step or decoding_step(model.device, settings.compile)
    head_step = decoding_head_step(settings.compile)

    def run_plain(n: int) -> list[int]:
        return generate(model, prompt, max_new_tokens=n, step=step)[0]

    def run(n: int, record: SpeculativeStats | None = None) -> list[int]:
        lookup = None if draft is not None or draft_head is not None else PromptLookupDrafter()
        tokens = speculative_decode(
            model,
            prompt,
            draft=draft,
            max_new_tokens=n,
            prompt_lookup=lookup,
            stats=record,
            forward=forward,
            draft_head=draft_head,
            head_step=head_step,
        )
        return list(tokens)

    if settings.compile:
        compile_rounds(forward, model, draft, len(prompt), settings.new_tokens, draft_head, head_step)
    times = interleaved_generation_times(
        {"plain": run_plain, "speculative": run}, settings.new_tokens, settings.repeats, model.device
    )
    rate, plain_rate = (decode_rate(times[name], settings.new_tokens) for name in ("speculative", "plain"))
    speculative_tokens = run(settings.new_tokens, stats)
    plain_tokens = generate(model, prompt, max_new_tokens=settings.new_tokens)[0]
    return {
        "drafter": "draft model"
        if draft is not None
        else "EAGLE-3 head"
        if draft_head is not None
        else "prompt lookup",
        "decode_tok_s": rate,
        "plain_decode_tok_s": plain_rate,  # timed in turn with the speculative runs: the speedup's base
        "plain_row_decode_tok_s": plain["decode_tok_s"],
        "speedup": rate / plain_rate,
        "whole_run_speedup": times["plain"][1] / times["speculative"][1],  # prefills (both models') included
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_target_step": stats.tokens_per_step,
        "identical_to_plain": speculative_tokens == plain_tokens,
    }


def benchmark(
    model: Transformer,
    prompt: list[int],
    settings: BenchSettings,
    draft: Transformer | None = None,
    prompt_lookup: bool = False,
    draft_head: Eagle3Head | None = None,
) -> dict[str, Any]:
    """Everything ``lmpress bench`` reports for ``model`` on ``prompt``, as a JSON-ready dict."""
    if len(prompt) + settings.new_tokens > model.args.max_seq_len:
        raise LmpressInputError(
            f"a {len(prompt)}-token prompt and {settings.new_tokens} new tokens exceed the model's context of "
            f"{model.args.max_seq_len}"
        )
    bandwidth = copy_bandwidth_gbs(model.device)
    result = {"settings": asdict(settings), "device": str(model.device), "threads": torch.get_num_threads()}
    result["kernels"] = layer_kernels(model)
    result["kv_cache"] = "float" if model.kv_quant is None else model.kv_quant.describe()
    step = decoding_step(model.device, settings.compile)  # plain decoding's compiled step, shared by both rows
    result["plain"] = bench_plain(model, prompt, settings, bandwidth, step)
    if draft is not None or prompt_lookup or draft_head is not None:
        forward = decoding_forward(model.device, settings.compile)
        spec = bench_speculative(model, prompt, settings, result["plain"], draft, forward, draft_head, step)
        result["speculative"] = spec
    return result


def bench_prompt(tokenizer: Any, n_tokens: int, text: str | None = None) -> list[int]:
    """``n_tokens`` token ids of ``text`` (default: the start of the built-in Python docs text)."""
    if text is None:
        from lmpress.data import BUILTIN_PYTHON_DOCS, load_text

        ids = tokenizer(load_text(BUILTIN_PYTHON_DOCS).text[: 20 * n_tokens], add_special_tokens=False)["input_ids"]
        return ids[:n_tokens]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise LmpressInputError("the prompt is empty")
    return ids


def _kv_text(result: dict[str, Any], plain: dict[str, Any]) -> str:
    per_token = plain.get("kv_cache_bytes_per_token")
    return "" if per_token is None else f"{per_token:,} bytes ({result.get('kv_cache', 'float')})"


def render_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """``(what, value)`` rows of a ``benchmark`` result, for a table."""
    plain = result["plain"]
    rows = [
        ("device", f"{result['device']}, {result['threads']} threads ({result.get('device_choice', 'as given')})"),
        ("prompt / new tokens", f"{plain['prompt_tokens']} / {plain['new_tokens']}"),
        ("time to first token", f"{plain['ttft_s'] * 1000:.1f} ms"),
        ("prefill", f"{plain['prefill_tok_s']:.1f} tok/s"),
        ("decode", f"{plain['decode_tok_s']:.1f} tok/s"),
        ("bytes read per token", f"{plain['bytes_per_token'] / 1e6:.1f} MB"),
        ("KV cache per token held", _kv_text(result, plain)),
        ("decode bandwidth", f"{plain['decode_gb_s']:.1f} GB/s"),
    ]
    if "bandwidth_pct" in plain:
        ceiling = f"{plain['bandwidth_pct']:.0f}% of {plain['bandwidth_gb_s']:.1f} GB/s"
        rows.append(("of the measured copy bandwidth", ceiling))
    rows.append(("peak memory while generating", f"{plain['peak_memory_mb']:.0f} MiB"))
    rows += kernel_rows(result.get("kernels", {}))
    spec = result.get("speculative")
    if spec:
        rows += [
            (f"speculative decode ({spec['drafter']})", f"{spec['decode_tok_s']:.1f} tok/s"),
            ("speculative speedup", f"{spec['speedup']:.2f}x plain decoding ({spec['plain_decode_tok_s']:.1f} tok/s)"),
            ("whole run, prefills included", f"{spec['whole_run_speedup']:.2f}x"),
            ("acceptance rate", f"{spec['acceptance_rate']:.2f}"),
            ("tokens per target step", f"{spec['tokens_per_target_step']:.2f}"),
            ("same tokens as plain decoding", "yes" if spec["identical_to_plain"] else "NO"),
        ]
    return rows
