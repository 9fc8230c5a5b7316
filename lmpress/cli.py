"""The ``lmpress`` command.

    lmpress run RECIPE --out DIR [--set key.path=value ...] [--overwrite] [--resume]
    lmpress eval MODEL [--suite FILE] [--baseline MODEL] [--out DIR] [--junit FILE] [--device cpu|cuda|auto]
    lmpress compare RUN_A RUN_B
    lmpress inspect ARTIFACT [--json] [--verify]
    lmpress generate ARTIFACT --prompt TEXT [--draft ARTIFACT [--draft-vocab N] | --prompt-lookup | --draft-head DIR]
                     [--stream]
                     [--compile] [--device cpu|cuda]
    lmpress bench ARTIFACT [--prompt-tokens N] [--new-tokens N] [--draft ARTIFACT [--draft-vocab N] | --prompt-lookup]
                  [--json FILE]

Exit codes: 0 every gate passed, 1 a gate failed, 2 bad input (one line, no
traceback), 3 unexpected error (with traceback).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmpress import __version__
from lmpress.errors import EXIT_BAD_INPUT, EXIT_RUNTIME_ERROR, LmpressInputError, LmpressStopped

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
console = Console()
err_console = Console(stderr=True)


def command(name: str) -> Callable:
    def decorator(fn: Callable[[argparse.Namespace], int]) -> Callable:
        COMMANDS[name] = fn
        return fn

    return decorator


def add_draft_vocab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="the draft scores only the N tokens most frequent in --draft-vocab-text (output unchanged)",
    )
    parser.add_argument(
        "--draft-vocab-text", default="builtin:python-docs", metavar="SOURCE", help="text to count tokens in"
    )


def add_activations_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--activations",
        default="int8",
        metavar="{int8,bf16}",
        help="on the CPU, weight-only quantized layers take their activations as int8 per 4 values (lmpress's "
        "kernels, where they hold the layer; default) or bf16 (torch's packed kernels)",
    )


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache",
        choices=["int8", "int4", "fp8"],
        help="quantize the KV cache: int8 (a scale per token and head), int4 (keys per channel in groups of 32 "
        "tokens, values per token: KIVI) or fp8 (E4M3, scale 1 as vLLM's uncalibrated fp8 cache; a recipe's "
        "kv_cache: calibrates the scales); default: the model's dtype",
    )


def kv_quant_flag(value: str | None):
    """The runtime's ``kv_quant`` for ``--kv-cache``."""
    from lmpress.weights.kv_quant import SCALES_OF, KVQuant, KVScheme

    return None if value is None else KVQuant(KVScheme(value, SCALES_OF[value][0]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmpress", description="Compress LLMs and gate them on quality.")
    versions = (
        f"lmpress {__version__} (torch {importlib.metadata.version('torch')}, Python {platform.python_version()})"
    )
    parser.add_argument("--version", action="version", version=versions)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a recipe: stages, export, eval, gates")
    run.add_argument("recipe", help="recipe YAML file")
    run.add_argument("--out", required=True, help="output directory (created; must be empty unless --overwrite)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set stages[0].bits=8 (repeatable)",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a non-empty --out when the run finishes")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run from its saved state")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument(
        "--check-placement",
        action="store_true",
        help="assert that every forward of every stage computes on the stage's device (slower; for GPU checks)",
    )
    run.add_argument("--junit", metavar="FILE", help="also write the gates as JUnit XML (one test case per gate)")

    plan = sub.add_parser(
        "forecast", help="a recipe run's memory, phase by phase, before any weight is read (a config alone will do)"
    )
    plan.add_argument("recipe", help="recipe YAML file (model.source may be a directory holding only config.json)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument(
        "--processes", type=int, default=1, metavar="N", help="as launched with N processes (torchrun): each one's"
    )

    ev = sub.add_parser("eval", help="evaluate a model (or a checkpoint lmpress wrote) with an eval suite")
    ev.add_argument("model", help="hub id, checkpoint directory, .gguf file or pypkg:PACKAGE/FILE")
    ev.add_argument(
        "--suite",
        help="YAML file with an 'eval:' section (and optional 'gates:'); default: perplexity on builtin:python-docs",
    )
    ev.add_argument("--baseline", help="model to compare against (needed for gates on _ratio/_delta metrics)")
    ev.add_argument("--out", help="write report.json / report.md here")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.add_argument("--junit", metavar="FILE", help="also write the gates as JUnit XML (one test case per gate)")
    ev.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the evals compute (default: cpu)")
    cmp = sub.add_parser("compare", help="two runs' metrics side by side (refused when their protocols differ)")
    cmp.add_argument("run_a", help="run directory (or its report.json)")
    cmp.add_argument("run_b", help="run directory (or its report.json)")
    gen = sub.add_parser("generate", help="generate text with lmpress's runtime from any model or export")
    gen.add_argument("artifact", help="an export lmpress wrote, a checkpoint directory, .gguf file or pypkg:")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--draft", metavar="ARTIFACT", help="speculative decoding with this draft model")
    gen.add_argument("--prompt-lookup", action="store_true", help="speculative decoding with n-gram drafts")
    gen.add_argument(
        "--draft-head", metavar="DIR", help="speculative decoding with an EAGLE-3 head trained for it (RUN/draft-head)"
    )
    add_draft_vocab_arguments(gen)
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (CUDA graphs on a GPU; compiling takes a while)",
    )
    gen.add_argument("--device", help="cpu or cuda (default: cuda where a GPU is found, else the CPU)")
    add_activations_argument(gen)
    add_kv_cache_argument(gen)
    bench = sub.add_parser("bench", help="speed of any model or export on lmpress's runtime: latency, tok/s, GB/s")
    bench.add_argument("artifact", help="an export lmpress wrote, a checkpoint directory, .gguf file or pypkg:")
    bench.add_argument("--prompt", help="prompt text (default: --prompt-tokens tokens of the built-in Python docs)")
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--new-tokens", type=int, default=256)
    bench.add_argument("--repeats", type=int, default=3, help="each time is the median of this many runs")
    bench.add_argument("--device", help="cpu or cuda (default: cuda where a GPU is found, else the CPU)")
    bench.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on the CPU, bfloat16 on CUDA)")
    bench.add_argument("--compile", action="store_true", help="time a torch.compile'd decode step")
    add_activations_argument(bench)
    add_kv_cache_argument(bench)
    bench.add_argument("--draft", metavar="ARTIFACT", help="also time speculative decoding with this draft")
    bench.add_argument("--prompt-lookup", action="store_true", help="also time prompt-lookup speculative decoding")
    bench.add_argument("--draft-head", metavar="DIR", help="also time speculative decoding with this EAGLE-3 head")
    add_draft_vocab_arguments(bench)
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ins = sub.add_parser("inspect", help="format, bits, group size, size on disk and per-layer summary of an artifact")
    ins.add_argument(
        "artifact",
        help="a checkpoint directory (gptq, awq, compressed-tensors, hf), a GGUF or ONNX export, or a run directory",
    )
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument(
        "--verify",
        action="store_true",
        help="also read every weight: all finite, GGUF tensors decoded, ONNX through onnx's checker (cheap checks of "
        "headers, sizes, config against tensors, scales and the run's manifest always run); exit 2 on the first "
        "problem",
    )
    return parser


def print_metrics(report: dict) -> None:
    from lmpress.evals.report import metric_rows

    table = Table(title="lmpress: baseline vs candidate")
    for header in ("metric", "baseline", "candidate", "delta", "gate", "verdict"):
        table.add_column(header)
    for row in metric_rows(report):
        table.add_row(*[cell.replace("<br>", "\n").replace("**", "") for cell in row])
    console.print(table)


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse, before any work, an --out that is a file or a --junit that is a directory."""
    out = getattr(args, "out", None)
    if out and Path(out).exists() and not Path(out).is_dir():
        raise LmpressInputError(f"--out {out} exists and is not a directory")
    junit = getattr(args, "junit", None)
    if junit and Path(junit).is_dir():
        raise LmpressInputError(f"--junit {junit} is a directory; give the XML file to write")


@command("run")
def cmd_run(args: argparse.Namespace) -> int:
    from lmpress.pipeline import run_recipe
    from lmpress.progress import Bars
    from lmpress.recipe import load_recipe

    check_output_paths(args)
    recipe = load_recipe(args.recipe, args.overrides)
    with Bars(enabled=not args.quiet) as bars:
        result = run_recipe(recipe, args.out, args.overwrite, args.resume, bars, check_placement=args.check_placement)
    if not result.report:  # a launched process other than the main one: the main one reports
        return result.exit_code
    print_metrics(result.report)
    if result.report.get("size_and_speed"):
        from lmpress.evals.speed import SPEED_HEADER, speed_rows

        table = Table(title="size and decode speed on lmpress's runtime")
        for column in SPEED_HEADER:
            table.add_column(column)
        for row in speed_rows(result.report["size_and_speed"]):
            table.add_row(*row)
        console.print(table)
    measured_on = result.report.get("measured_on", {}).get("candidate")
    if measured_on:
        console.print(f"candidate measured on {measured_on}", highlight=False)
    for warning in result.report.get("consumer_warnings", []):
        console.print(
            f"[yellow]warning[/] {warning['format']}/: {warning['consumer']} will not load it: {warning['why']}",
            highlight=False,
        )
    for check in result.report.get("export_checks", []):
        if not check["passed"]:
            console.print(
                f"[red]export {check['format']} does not match the candidate:[/] {check['weights']}; "
                f"first-window ppl {check['window_ppl']:.6g} vs {check['candidate_window_ppl']:.6g}"
            )
    if args.junit:
        from lmpress.evals.junit import write_junit

        write_junit(result.report["gates"], args.junit)
    verdict = "[green]PASS" if result.exit_code == 0 else "[red]FAIL"
    console.print(f"{verdict}[/] report: {Path(args.out) / 'report.md'}")
    return result.exit_code


def gates_needing_baseline(recipe) -> list[str]:
    """The gates on ``NAME_ratio``/``NAME_delta`` or on candidate-only metrics (KLD): no baseline, no value."""
    from lmpress.evals.gates import RELATIVE

    candidate_only = {m for config in recipe.eval.evals.values() for m in config.candidate_only}
    return [str(g) for g in recipe.gates if g.metric.endswith(RELATIVE) or g.metric in candidate_only]


@command("forecast")
def cmd_forecast(args: argparse.Namespace) -> int:
    import torch

    from lmpress.memory_plan import GIB, available_memory, forecast_checkpoint
    from lmpress.recipe import load_recipe

    if args.processes < 1:
        raise LmpressInputError(f"--processes {args.processes}: give at least 1")
    recipe = load_recipe(args.recipe, args.overrides)
    forecast = forecast_checkpoint(recipe, args.processes)
    table = Table(title=f"memory forecast: {recipe.model.source}")
    table.add_column("phase")
    table.add_column("GiB", justify="right")
    table.add_column("parts (GiB)")
    for phase, parts in forecast.phases.items():
        listed = ", ".join(f"{name} {size / GIB:.2f}" for name, size in parts.items() if size)
        table.add_row(phase, f"{sum(parts.values()) / GIB:.2f}", listed)
    console.print(table)
    console.print(forecast.describe())
    ram, _ = available_memory(torch.device("cpu"))
    verdict = "fits" if forecast.ram_bytes <= ram else "does not fit"
    console.print(f"this machine has {ram / GIB:.1f} GiB of RAM available: the main process {verdict}")
    return 0


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    from lmpress.evals.suite import evaluate_models
    from lmpress.placement import resolve_device
    from lmpress.progress import Bars
    from lmpress.recipe import parse_recipe, read_yaml_file

    check_output_paths(args)
    device = resolve_device(args.device, "--device")
    raw = {"eval": {"perplexity": {"seq_len": 1024, "windows": 8}}}
    if args.suite:
        raw = read_yaml_file(args.suite, "suite") or {}
        if not isinstance(raw, dict):
            raise LmpressInputError(f"{args.suite}: a suite is a YAML mapping with an 'eval:' section")
    recipe = parse_recipe(
        {"model": args.model, "eval": raw.get("eval"), "gates": raw.get("gates")}, args.suite or "suite"
    )
    needing = gates_needing_baseline(recipe)
    if needing and not args.baseline:
        raise LmpressInputError(f"{args.suite}: gate '{needing[0]}' compares with a baseline; pass --baseline MODEL")
    with Bars(enabled=not args.quiet) as bars:
        report = evaluate_models(recipe, args.baseline, bars, device)
    if args.out:
        from lmpress.evals.report import write_report

        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_report(report, Path(args.out))
    if args.junit:
        from lmpress.evals.junit import write_junit

        write_junit(report["gates"], args.junit)
    print_metrics(report)
    return 0 if report["passed"] else 1


@command("compare")
def cmd_compare(args: argparse.Namespace) -> int:
    from lmpress.evals.compare import compare_runs

    console.print(compare_runs(args.run_a, args.run_b), markup=False, highlight=False, soft_wrap=True)
    return 0


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    from lmpress.runtime.text import generate_text, resolve_device

    device, where = resolve_device(args.device)
    pieces = []
    result = generate_text(
        args.artifact,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=dict(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
        ),
        seed=args.seed,
        draft=args.draft,
        prompt_lookup=args.prompt_lookup,
        draft_head=args.draft_head,
        draft_vocab=args.draft_vocab,
        draft_vocab_text=args.draft_vocab_text,
        device=device,
        compile=args.compile,
        cpu_activations=args.activations,
        on_text=(lambda piece: print(piece, end="", flush=True)) if args.stream else pieces.append,
        kv_quant=kv_quant_flag(args.kv_cache),
    )
    print("" if args.stream else "".join(pieces))
    err_console.print(f"{result.summary()}; on {device.type} ({where})", highlight=False)
    return 0


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from lmpress.runtime.text import draft_head_for, load_draft, load_runtime, resolve_device
    from lmpress.runtime.throughput import BenchSettings, bench_prompt, benchmark, render_rows

    if sum((args.draft is not None, args.prompt_lookup, args.draft_head is not None)) > 1:
        raise LmpressInputError("--draft, --prompt-lookup and --draft-head are kinds of draft: choose one")
    if args.prompt is None and args.prompt_tokens < 1:
        raise LmpressInputError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if args.json and Path(args.json).is_dir():
        raise LmpressInputError(f"--json {args.json} is a directory; give the file to write")
    settings = BenchSettings(new_tokens=args.new_tokens, repeats=args.repeats, compile=args.compile)
    device, where = resolve_device(args.device)
    model, tokenizer = load_runtime(args.artifact, device, args.dtype, args.activations)
    model.kv_quant = kv_quant_flag(args.kv_cache)
    draft = load_draft(
        args.draft, model, tokenizer, device, args.dtype, args.draft_vocab, args.draft_vocab_text, args.activations
    )
    head = draft_head_for(args.draft_head, args.artifact, model)
    prompt = bench_prompt(tokenizer, args.prompt_tokens, args.prompt)
    result = benchmark(model, prompt, settings, draft=draft, prompt_lookup=args.prompt_lookup, draft_head=head)
    result["artifact"], result["device_choice"] = args.artifact, where
    table = Table(title=f"lmpress bench: {args.artifact}")
    table.add_column("what")
    table.add_column("measured")
    for row in render_rows(result):
        table.add_row(*row)
    console.print(table)
    if args.json:
        from lmpress.cache import write_text_atomic

        write_text_atomic(Path(args.json), json.dumps(result, indent=2) + "\n")
    return 0


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from lmpress.export.inspect import inspect_artifact
    from lmpress.export.inspect_render import render_inspect

    info = inspect_artifact(args.artifact, verify=args.verify)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        console.print(render_inspect(info, console.width))
    return 0


def quiet_transformers() -> None:
    """lmpress draws its own bars; transformers' per-file bars and notices would bury them. Set as the defaults
    transformers and huggingface_hub read when first imported: importing transformers here (1 s) would delay
    every command, `generate`'s first token among them, which never needs it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (lmpress called from Python): its defaults are read
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_transformers()
    try:
        return COMMANDS[args.command](args)
    except LmpressInputError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    except LmpressStopped as e:
        err_console.print(f"[red]stopped:[/] {e}", highlight=False, soft_wrap=True)
        return EXIT_RUNTIME_ERROR
    except KeyboardInterrupt:
        err_console.print("interrupted; `lmpress run ... --resume` continues from the last saved state")
        return EXIT_RUNTIME_ERROR
    except Exception:
        traceback.print_exc()
        return EXIT_RUNTIME_ERROR


if __name__ == "__main__":
    sys.exit(main())
