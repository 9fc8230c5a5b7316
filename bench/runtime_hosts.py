"""bench/runtime.py's results page: one entry per host kind (CPU model + instruction sets), statistics and goals.

A run replaces only its own host's entry in ``bench/results/runtime.json`` and re-renders
``bench/results/runtime.md`` from every host's entry, so a host's numbers are never overwritten by
another host's.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The instruction sets that decide which kernels run, as /proc/cpuinfo names them.
ISA_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "avx_vnni": "AVX-VNNI",
    "amx_int8": "AMX-INT8",
}


def cpu_identity() -> dict[str, Any]:
    """The CPU model, its relevant instruction sets, cores and the host key results are filed under."""
    model, flags, numbers = platform.processor() or platform.machine(), set(), {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() in ("cpu family", "model") and key.strip() not in numbers:
                numbers[key.strip()] = value.strip()
    isa = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    # A VM often names only "AMD EPYC", and Zen 1 (family 23 model 1) and Zen 2 (23/49) share these instruction
    # sets: the family and model numbers, in the key since 2026-12-07, keep their results apart (older sections are
    # filed under the name and instruction sets alone).
    family = f"family {numbers['cpu family']} model {numbers['model']}" if len(numbers) == 2 else ""
    key = f"{model} [{', '.join(isa) or 'no AVX2'}]" + (f" ({family})" if family else "")
    return {"cpu_model": model, "isa": isa, "cores": os.cpu_count(), "key": key, "family": family}


def worker_environment(environ: dict[str, str], repo: Path, omp_wait_policy: str = "default") -> dict[str, str]:
    """The environment of a row's worker process: the repository first on ``PYTHONPATH``; ``OMP_WAIT_POLICY``
    unset by default (libgomp's own: spin a while, then sleep), as each engine's users run it (on a quiet
    AVX-512 EPYC, ``PASSIVE`` cut both lmpress and llama.cpp about 2.5x), or ``"PASSIVE"`` (threads sleep at
    once: on a 2-core machine loaded by other work an eager SmolLM2 W4 step took 170-190 ms spinning and 27-42 ms
    passive)."""
    path = os.pathsep.join(filter(None, [str(repo), environ.get("PYTHONPATH")]))
    env = {**environ, "PYTHONPATH": path}
    env.pop("OMP_WAIT_POLICY", None)
    if omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    return env


def round_orders(names: list[str], repeats: int, warmup: int = 1) -> list[tuple[list[str], bool]]:
    """Each round's order of the rows and whether it counts: ``warmup`` discarded rounds first (the first
    timed run of a process after the others loaded pays for caches and pages), then ``repeats`` counted ones;
    the first row rotates from round to round."""
    rounds = []
    for i in range(warmup + repeats):
        shift = i % max(1, len(names))
        rounds.append((names[shift:] + names[:shift], i >= warmup))
    return rounds


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); with fewer than 2 values all three are the one value."""
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def decode_rate(sample: dict[str, float], new_tokens: int) -> float:
    """Decode tok/s of one repeat: the N - 1 tokens after the first over the time after the first, within the N-token
    run where the sample has it (``after_first``: no prefill in it, which at long context swamps the steps), else
    ``(N - 1) / (t(N) - t(1))`` over two runs."""
    if "after_first" in sample:
        return (new_tokens - 1) / sample["after_first"] if sample["after_first"] > 0 else float("nan")
    return (new_tokens - 1) / (sample["tn"] - sample["t1"]) if sample["tn"] > sample["t1"] else float("nan")


def summarize(samples: list[dict[str, float]], new_tokens: int, info: dict[str, Any]) -> dict[str, Any]:
    """One row from its repeats: decode tok/s per repeat (``decode_rate``), quartiles, copy bandwidth beside."""
    rates = [decode_rate(s, new_tokens) for s in samples]
    q1, median, q3 = quartiles(rates)
    bw = statistics.median(s["bw"] for s in samples)
    per_token = info["bytes_per_token"]
    ttft = statistics.median(s["t1"] for s in samples)  # --timing after-first: the first token of the N-token run
    return {
        **info,
        "decode_tok_s": median,
        "decode_tok_s_q1": q1,
        "decode_tok_s_q3": q3,
        "decode_tok_s_repeats": rates,
        "ttft_s": ttft,
        "prefill_tok_s": info["prompt_tokens"] / ttft,
        "decode_gb_s": median * per_token / 1e9,
        "bandwidth_gb_s": bw,
        "bandwidth_gb_s_repeats": [s["bw"] for s in samples],
        "bandwidth_pct": 100 * median * per_token / 1e9 / bw,
        "load_average_repeats": [s["load"] for s in samples],
    }


def render(rows: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    lines = [
        "| row | decode tok/s: median [quartiles] | TTFT ms | MB read/token | GB/s | % of copy BW | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "decode_tok_s_q1" in r:
            rate = f"{r['decode_tok_s']:.1f} [{r['decode_tok_s_q1']:.1f}, {r['decode_tok_s_q3']:.1f}]"
        else:  # an entry from before the interleaved runs: one median of 3
            rate = f"{r['decode_tok_s']:.1f}"
        lines.append(
            f"| {labels.get(name, name)} | {rate} | {r['ttft_s'] * 1000:.0f} | {r['bytes_per_token'] / 1e6:.0f} | "
            f"{r['decode_gb_s']:.1f} | {r['bandwidth_pct']:.0f}% of {r['bandwidth_gb_s']:.1f} | "
            f"{r['peak_memory_mb']:.0f} |"
        )
    return "\n".join(lines)


def _best(rows: dict[str, dict[str, Any]], prefix: str) -> str | None:
    """The fastest row named ``prefix...``; a row without a rate (NaN: no repeat timed t(N) > t(1)) never wins."""
    names = [n for n in rows if n.startswith(prefix) and not math.isnan(rows[n]["decode_tok_s"])]
    return max(names, key=lambda n: rows[n]["decode_tok_s"], default=None)


def goals(rows: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """Issue 41's goals as this run measured them (each at the median; W4 also at its slower quartile)."""
    out = []
    w4, q4 = _best(rows, "lmpress-w4"), _best(rows, "llama.cpp-q4_1")
    if w4 and q4:
        ref = rows[q4]["decode_tok_s"]
        out.append(
            f"{labels[w4]} / {labels[q4]} (the faster llama.cpp build): {rows[w4]['decode_tok_s'] / ref:.2f}x at the "
            f"median, {rows[w4].get('decode_tok_s_q1', rows[w4]['decode_tok_s']) / ref:.2f}x at its slower quartile "
            "(goal >= 1.5x)"
        )
    if w4:
        r = rows[w4]
        slow = r.get("decode_tok_s_q1", r["decode_tok_s"]) * r["bytes_per_token"] / 1e9 / r["bandwidth_gb_s"] * 100
        out.append(
            f"{labels[w4]}: {r['bandwidth_pct']:.0f}% of the copy bandwidth at the median, {slow:.0f}% at the "
            "slower quartile (goal >= 60%)"
        )
        if "product_4_over_1" in r:
            out.append(
                f"{labels[w4]}: a 4-row product of every linear layer takes {r['product_4_over_1']:.2f}x the time of "
                "a 1-row one (goal <= 1.5x)"
            )
    w8, q8 = _best(rows, "lmpress-w8"), _best(rows, "llama.cpp-q8_0")
    if w8 and q8:
        ratio = rows[w8]["decode_tok_s"] / rows[q8]["decode_tok_s"]
        out.append(f"{labels[w8]} / {labels[q8]} (the faster build): {ratio:.2f}x (goal >= 1.3x)")
    hf, fp32 = rows.get("transformers-fp32"), _best(rows, "lmpress-fp32")
    if hf and fp32:
        out.append(f"{labels[fp32]} / transformers FP32: {rows[fp32]['decode_tok_s'] / hf['decode_tok_s']:.2f}x")
    return out


def file_host_entry(path: Path, key: str, entry: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """File ``entry`` under host ``key`` in ``path`` (JSON; the other hosts' entries kept), write ``render`` of all
    of them to the Markdown page beside it, and return this host's part of the page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hosts = json.loads(path.read_text()) if path.is_file() else {}
    hosts[key] = entry
    path.write_text(json.dumps(hosts, indent=2) + "\n")
    path.with_suffix(".md").write_text(render(hosts))
    return render({key: entry})


def record(path: Path, host: dict[str, Any], entry: dict[str, Any], labels: dict[str, str]) -> None:
    """File ``entry`` under this host's key in ``path`` (JSON) and re-render the Markdown page beside it."""
    hosts = json.loads(path.read_text()) if path.is_file() else {}
    if "meta" in hosts and "rows" in hosts:  # the page's first form: one run, host not recorded
        hosts = {"Xeon, 2 vCPUs (issue 11 run; CPU model not recorded)": {**hosts, "host": {}}}
    hosts[host["key"]] = {**entry, "host": host, "labels": {name: labels[name] for name in entry.get("rows", {})}}
    path.write_text(json.dumps(hosts, indent=2) + "\n")
    path.with_suffix(".md").write_text(render_page(hosts, labels))


def render_page(hosts: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    parts = ["# CPU decode, SmolLM2-135M (bench/runtime.py), one section per host kind", ""]
    for key, entry in hosts.items():
        meta = entry.get("meta", {})
        parts += [f"## {key}", ""]
        if entry.get("note"):
            parts += [entry["note"], ""]
        said = [f"{meta.get('threads', '?')} threads", f"{meta.get('repeats', '?')} repeats"]
        if "prompt_tokens" in meta:
            said.append(f"{meta['prompt_tokens']}-token prompt, {meta.get('new_tokens', '?')} new tokens")
        if meta.get("timing") == "after-first":
            said.append("decode timed after the first token of one run")
        if meta.get("interleaved"):
            said.append("rows interleaved")
        if "load_average" in meta:
            said.append("load average " + ", ".join(f"{x:.2f}" for x in meta["load_average"]))
        if meta.get("when"):
            said.append(meta["when"])
        parts += ["; ".join(said), ""]
        for name, flags in meta.get("llama_cpp_builds", {}).items():
            parts += [f"- {name}: `{flags}`"]
        if meta.get("llama_cpp_builds"):
            parts.append("")
        if entry.get("rows"):
            parts += [render(entry["rows"], entry.get("labels", labels)), ""]
        parts += [f"- {goal}" for goal in entry.get("goals", [])] + [""]
    return "\n".join(parts)
