"""What the C++ wrapper of a compiled CPU decode step buys: one process, one model, two compiled steps.

    python bench/decode_wrapper.py                      # SmolLM2 W4 g64 head W8, 7 rounds of 256 tokens
    python bench/decode_wrapper.py --artifact w8-head8 --repeats 5

Inductor's wrapper is the code that calls a compiled graph's kernels one after another. In Python it spends some
microseconds per call; a SmolLM2 decode step makes ~120 calls into lmpress's int8 kernels (4 fused linears x 30
layers and the head), and the second thread waits meanwhile. ``lmpress.runtime.generate.wrapper_options`` picks the
C++ wrapper on the CPU; this bench builds one step with it and one with the Python wrapper (the patched
``wrapper_options``, at their first call) on the same model, times them in alternation (A, B, A, B, ...; decode
tok/s = (N - 1) / (t(N) - t(1)) as bench/runtime.py) and reports the compile seconds of each step's first graph.
Writes bench/results/decode_wrapper.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import artifact, plain_prompt  # noqa: E402
from runtime_hosts import cpu_identity, quartiles  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WRAPPERS = ("python", "cpp")


def build_step(model: Any, wrapper: str, max_new: int, prompt: list[int]) -> tuple[Any, float]:
    """A compiled decode for ``wrapper``, its graphs built (timed) by one warm-up generation of ``max_new``."""
    from lmpress.runtime import generate as gen

    forward = gen.compiled_forward()
    chosen = gen.wrapper_options
    if wrapper == "python":  # the options are read when the step is first compiled, at its first call
        gen.wrapper_options = lambda device: {}
    try:
        began = time.perf_counter()
        gen.generate(model, prompt, max_new_tokens=max_new, decode=gen.decode_with(forward))
        seconds = time.perf_counter() - began
    finally:
        gen.wrapper_options = chosen
    return gen.decode_with(forward), seconds


def timed(model: Any, decode: Any, prompt: list[int], n: int) -> float:
    from lmpress.runtime.generate import generate

    began = time.perf_counter()
    generate(model, prompt, max_new_tokens=1, decode=decode)
    t1 = time.perf_counter() - began
    began = time.perf_counter()
    generate(model, prompt, max_new_tokens=n, decode=decode)
    return (n - 1) / (time.perf_counter() - began - t1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="w4g64-head8", choices=["w4g64-head8", "w8-head8"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    from lmpress.runtime.text import load_runtime

    torch.set_num_threads(args.threads)
    model, tokenizer = load_runtime(str(artifact(args.artifact)), "cpu", "float32")
    prompt = plain_prompt(tokenizer, 128)
    steps, compile_s = {}, {}
    for wrapper in WRAPPERS:
        steps[wrapper], compile_s[wrapper] = build_step(model, wrapper, args.new_tokens, prompt)
        print(f"{wrapper} wrapper: first generation (compiles) {compile_s[wrapper]:.1f} s", flush=True)
    rates: dict[str, list[float]] = {w: [] for w in WRAPPERS}
    for round_ in range(args.repeats):
        for wrapper in WRAPPERS if round_ % 2 == 0 else reversed(WRAPPERS):
            rates[wrapper].append(timed(model, steps[wrapper], prompt, args.new_tokens))
            print(f"  round {round_ + 1}: {wrapper} {rates[wrapper][-1]:.1f} tok/s", flush=True)
    rows: dict[str, Any] = {}
    for wrapper in WRAPPERS:
        q1, median, q3 = quartiles(rates[wrapper])
        rows[wrapper] = {
            "tok_s": median,
            "q1": q1,
            "q3": q3,
            "repeats": rates[wrapper],
            "compile_s": compile_s[wrapper],
        }
    ratio = rows["cpp"]["tok_s"] / rows["python"]["tok_s"]
    lines = [
        f"SmolLM2 {args.artifact}, batch 1, 128-token prompt, {args.new_tokens} new tokens, {args.threads} threads, "
        f"{args.repeats} alternating rounds; {cpu_identity()['key']}",
        "",
        "| wrapper | decode tok/s: median [quartiles] | first generation (compiles), s |",
        "|---|---|---|",
        *(f"| {w} | {r['tok_s']:.1f} [{r['q1']:.1f}, {r['q3']:.1f}] | {r['compile_s']:.0f} |" for w, r in rows.items()),
        "",
        f"C++ / Python wrapper: {ratio:.2f}x at the median",
    ]
    print("\n".join(lines))
    if not args.no_record:
        RESULTS.mkdir(exist_ok=True)
        record = {"artifact": args.artifact, "host": cpu_identity()["key"], "threads": args.threads, "rows": rows}
        (RESULTS / "decode_wrapper.json").write_text(json.dumps(record, indent=1) + "\n")
        (RESULTS / "decode_wrapper.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
