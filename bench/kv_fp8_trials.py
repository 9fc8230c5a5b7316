"""Where an FP8 KV cache's perplexity goes, and cures tried for it (issue 50): SmolLM2-135M, E4M3 per head with the
q/k Hadamard rotation (``kv_cache: {dtype: fp8, scales: head, rotate: true}``), one change per row.

    python bench/kv_fp8_trials.py                       # every trial, 2 windows of 8192 tokens (bench/kv_cache.py's)
    python bench/kv_fp8_trials.py --trials recipe keys values

Trials (each against the float cache of the same run):

- ``recipe``: the cache as lmpress runs it (scales max|x| / 448 from 128 x 512 calibration tokens, as the recipes);
- ``keys`` / ``values``: only the keys, only the values quantized;
- ``sink-1`` / ``sink-4``: the first 1 or 4 tokens (the attention sink) kept in float;
- ``long-calibration``: the scales from 4 windows of 8192 WikiText-2 valid tokens (every RoPE position);
- ``centred``: the same long calibration, and each layer and head's mean key subtracted before quantizing (scores
  drop by ``q · mean`` for every key alike, which softmax ignores: free at read time);
- ``scale-search``: each layer and head's key scale searched over 16 steps of one binade above max|k| / 448 for the
  least score error on the calibration tokens (``e Σq eᵀ``, the queries' second moment ``Σq``).

Writes bench/results/kv_fp8_trials.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import CALIBRATION, SMOLLM2, cpu_description  # noqa: E402

from lmpress.data import calibration_samples, load_text, tokenize  # noqa: E402
from lmpress.evals.perplexity import PerplexityConfig, perplexity  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import Bars  # noqa: E402
from lmpress.quantize import kv_attention as ka  # noqa: E402
from lmpress.weights.kv_quant import KVScheme, fake_quantize_kv, fp8_scale_from_amax  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TRIALS = ("recipe", "keys", "values", "sink-1", "sink-4", "long-calibration", "centred", "scale-search")
SCHEME = KVScheme("fp8", "head")
SEARCH_STEPS = torch.tensor([2 ** (j / 16) for j in range(16)])  # scale multipliers: one binade, never clipping


class Trial:
    """One trial's cache: per layer key and value scales, the key means it subtracts, what it leaves float."""

    def __init__(self, k_scales: list, v_scales: list, means: dict | None = None, **how: Any) -> None:
        self.k_scales, self.v_scales, self.means = k_scales, v_scales, means
        self.keys, self.values = how.get("keys", True), how.get("values", True)
        self.sink = how.get("sink", 0)

    def attention(self, module, query, key, value, *args, **kwargs):
        query, key = ka.rotate_queries_and_keys(query, key)
        layer = module.layer_idx
        if self.means is not None:
            key = key - self.means[layer].view(1, -1, 1, key.shape[-1]).to(key.dtype)
        if self.keys:
            key = self._kept(key, fake_quantize_kv(key, SCHEME, self.k_scales[layer]))
        if self.values:
            value = self._kept(value, fake_quantize_kv(value, SCHEME, self.v_scales[layer]))
        return ka.inner_attention(module, query, key, value, *args, **kwargs)

    def _kept(self, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[:, :, : self.sink], quantized[:, :, self.sink :]), 2) if self.sink else quantized


def observe(
    model, samples: torch.Tensor, batch: int, means: dict | None = None, collect: bool = False
) -> dict[int, dict[str, Any]]:
    """Per layer: the rotated keys' sum and count, max |key - mean| and max |value| per KV head, and with
    ``collect`` the keys themselves and the queries' second moment per KV head (for the scale search)."""
    seen: dict[int, dict[str, Any]] = {}

    def kernel(module, query, key, value, *args, **kwargs):
        query, key = ka.rotate_queries_and_keys(query, key)
        s = seen.setdefault(module.layer_idx, {"sum": 0.0, "n": 0, "k_amax": 0.0, "v_amax": 0.0, "keys": [], "qq": 0})
        centred = key if means is None else key - means[module.layer_idx].view(1, -1, 1, key.shape[-1])
        s["sum"] = s["sum"] + key.double().sum((0, 2))
        s["n"] += key.shape[0] * key.shape[2]
        s["k_amax"] = torch.maximum(torch.as_tensor(s["k_amax"]), centred.abs().amax((0, 2, 3)))
        s["v_amax"] = torch.maximum(torch.as_tensor(s["v_amax"]), value.abs().amax((0, 2, 3)))
        if collect:
            b, heads, n, width = query.shape
            grouped = query.float().reshape(b, key.shape[1], heads // key.shape[1], n, width)
            s["keys"].append(key.float().clone())
            s["qq"] = s["qq"] + torch.einsum("bgrnd,bgrne->gde", grouped, grouped)
        return ka.inner_attention(module, query, key, value, *args, **kwargs)

    with ka.kernel_in_front(model, "lmpress_bench_observed", kernel):
        for start in range(0, len(samples), batch):
            model(input_ids=samples[start : start + batch], use_cache=False)
    return seen


def searched_scale(keys: torch.Tensor, qq: torch.Tensor) -> torch.Tensor:
    """Per KV head, the scale of ``SEARCH_STEPS`` x max|k| / 448 with the least score error ``sum(e Σq eᵀ)``."""
    first = fp8_scale_from_amax(keys.abs().amax((0, 2, 3)))
    best = first.clone()
    for h in range(keys.shape[1]):
        head = keys[:, h : h + 1]
        costs = []
        for step in SEARCH_STEPS:
            error = (fake_quantize_kv(head, SCHEME, (first[h] * step).reshape(1)) - head).reshape(-1, head.shape[-1])
            costs.append(float(((error @ qq[h]) * error).sum()))
        best[h] = first[h] * SEARCH_STEPS[min(range(len(costs)), key=costs.__getitem__)]
    return best


def trials_of(model, short: torch.Tensor, long: torch.Tensor, names: list[str]) -> dict[str, Trial]:
    seen = observe(model, short, 8, collect="scale-search" in names)
    layers = range(len(seen))
    k_scales = [fp8_scale_from_amax(seen[i]["k_amax"]) for i in layers]
    v_scales = [fp8_scale_from_amax(seen[i]["v_amax"]) for i in layers]
    trials = {
        "recipe": Trial(k_scales, v_scales),
        "keys": Trial(k_scales, v_scales, values=False),
        "values": Trial(k_scales, v_scales, keys=False),
        "sink-1": Trial(k_scales, v_scales, sink=1),
        "sink-4": Trial(k_scales, v_scales, sink=4),
    }
    if "scale-search" in names:
        searched = [searched_scale(torch.cat(seen[i]["keys"]), seen[i]["qq"]) for i in layers]
        trials["scale-search"] = Trial(searched, v_scales)
    if {"long-calibration", "centred"} & set(names):
        whole = observe(model, long, 1)
        trials["long-calibration"] = Trial(
            [fp8_scale_from_amax(whole[i]["k_amax"]) for i in layers],
            [fp8_scale_from_amax(whole[i]["v_amax"]) for i in layers],
        )
        means = {i: (whole[i]["sum"] / whole[i]["n"]).float() for i in layers}
        centred = observe(model, long, 1, means=means)
        trials["centred"] = Trial(
            [fp8_scale_from_amax(centred[i]["k_amax"]) for i in layers],
            [fp8_scale_from_amax(centred[i]["v_amax"]) for i in layers],
            means,
        )
    return {name: trials[name] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", nargs="*", default=list(TRIALS), choices=TRIALS)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(SMOLLM2, "float32", fingerprint=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    config = PerplexityConfig(seq_len=8192, windows=args.windows, batch_size=1)
    windows = config.windows_for(tokenize(tokenizer, load_text("builtin:wikitext2:test")), tokenizer)
    valid = tokenize(tokenizer, load_text("builtin:wikitext2:valid"))
    short = calibration_samples(valid, CALIBRATION["n_samples"], CALIBRATION["seq_len"], CALIBRATION["seed"])
    long = valid[: 4 * 8192].view(4, 8192)
    rows = []
    with Bars() as bars, torch.inference_mode():
        base = perplexity(model, windows, config, bars)["ppl"]
        for name, trial in trials_of(model, short, long, args.trials).items():
            with ka.kernel_in_front(model, "lmpress_bench_fp8_trial", trial.attention):
                ppl = perplexity(model, windows, config, bars)["ppl"]
            rows.append({"trial": name, "ppl": ppl, "delta_pct": 100 * (ppl / base - 1)})
            bars.log(f"{name}: ppl {ppl:.4f} ({rows[-1]['delta_pct']:+.3f}%)")
    lines = [
        f"SmolLM2-135M-Instruct (FP32), WikiText-2 test, {args.windows} x 8192 tokens, float cache ppl {base:.4f}; "
        f"FP8 E4M3 per head, q/k Hadamard-rotated; {cpu_description()}, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d')}; `python bench/kv_fp8_trials.py`",
        "",
        "| trial | ppl | Δ vs float cache |",
        "| --- | --- | --- |",
        *(f"| {r['trial']} | {r['ppl']:.4f} | {r['delta_pct']:+.3f}% |" for r in rows),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_fp8_trials.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "kv_fp8_trials.json").write_text(json.dumps({"base": base, "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
