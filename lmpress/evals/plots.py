"""PNG plots for report.md, only where a picture says more than the table's numbers.

- NLL by position bucket, baseline vs candidate (where damage sits in the context);
- passkey accuracy as a depth x length heatmap, baseline beside candidate;
- the distribution of per-token KLD (a mean hides a heavy tail).

Plots read the report's ``details`` (``report[side]["details"][eval_name]``) by
what they hold, not by eval name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lmpress.cache import atomic_path  # noqa: E402


def save_figure(fig: plt.Figure, path: Path, **kwargs: Any) -> None:
    """Save ``fig`` as a PNG at ``path`` atomically, and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, **kwargs)
    plt.close(fig)


FLOAT_CACHE = "candidate_float_cache"  # the report's side of the candidate re-scored on a float KV cache


def _find(report: dict[str, Any], side: str, key: str) -> Any:
    for details in report.get(side, {}).get("details", {}).values():
        if isinstance(details, dict) and key in details:
            return details[key]
    return None


def plot_nll_by_position(
    baseline: list[dict], candidate: list[dict], path: Path, float_cache: list[dict] | None = None
) -> None:
    """NLL per position bucket, baseline against candidate (and the candidate on a float KV cache, where the run
    quantized the cache), with the candidate's excess below."""
    labels = [row["bucket"] for row in candidate]
    x = np.arange(len(labels))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[2, 1])
    if baseline:
        top.plot(x, [row["nll"] for row in baseline], "o-", label="baseline")
    if float_cache:
        top.plot(x, [row["nll"] for row in float_cache], "^--", label="candidate, float KV cache")
    top.plot(x, [row["nll"] for row in candidate], "s-", label="candidate")
    top.set_ylabel("mean NLL (nats/token)")
    top.legend()
    top.grid(alpha=0.3)
    if baseline:
        delta = [c["nll"] - b["nll"] for b, c in zip(baseline, candidate, strict=True)]
        bottom.bar(x, delta, color="tab:red")
        bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel("candidate - baseline")
    bottom.set_xticks(x, labels)
    bottom.set_xlabel("token position bucket")
    bottom.grid(alpha=0.3)
    fig.suptitle("NLL by position")
    fig.tight_layout()
    save_figure(fig, path)


def plot_passkey(grids: dict[str, dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 3.8), squeeze=False)
    image = None
    for ax, (side, grid) in zip(axes[0], grids.items(), strict=True):
        accuracy = np.array(grid["accuracy"], dtype=float)
        image = ax.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.set_yticks(range(len(grid["depths"])), [f"{d:.0%}" for d in grid["depths"]])
        ax.set_xlabel("prompt length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("key depth")
        ax.set_title(side)
        for (i, j), value in np.ndenumerate(accuracy):
            ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    fig.suptitle("Passkey retrieval")
    save_figure(fig, path, bbox_inches="tight")


def plot_kld_histogram(histogram: dict, path: Path) -> None:
    edges, counts = np.array(histogram["edges"]), np.array(histogram["counts"], dtype=float)
    shares = counts / max(counts.sum(), 1)
    lefts = np.maximum(edges[:-1], edges[1] / 10)  # the [0, first) bin drawn one decade wide on the log axis
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(lefts, shares, width=edges[1:] - lefts, align="edge", edgecolor="black", linewidth=0.3)
    ax.set_xscale("log")
    used = np.nonzero(counts)[0]
    ax.set_xlim(lefts[used[0]] / 3, edges[used[-1] + 1] * 3)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("KL(baseline || candidate) per token (nats)")
    ax.set_ylabel("share of positions")
    ax.set_title("Per-token KLD distribution")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def plot_training_curve(losses: list[dict], evals: list[dict], path: Path) -> None:
    """Distillation: the training loss per step and the held-out perplexity where it was measured."""
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, [row["loss"] for row in losses], color="tab:blue", linewidth=1, label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if evals:
        right = ax.twinx()
        steps_ppl = ([e["step"] for e in evals], [e["ppl"] for e in evals])
        right.plot(*steps_ppl, "o-", color="tab:orange", label="held-out ppl")
        right.set_ylabel("held-out perplexity")
        fig.legend(loc="upper right")
    ax.set_title("Distillation")
    fig.tight_layout()
    save_figure(fig, path)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[tuple[str, str]]:
    """Write the plots the report's details support into ``out_dir``; ``(title, filename)`` for report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, str]] = []

    candidate = _find(report, "candidate", "nll_by_position")
    if candidate and len(candidate) >= 2:
        baseline = _find(report, "baseline", "nll_by_position") or []
        if baseline and [r["bucket"] for r in baseline] != [r["bucket"] for r in candidate]:
            baseline = []
        floats = _find(report, FLOAT_CACHE, "nll_by_position")
        if floats and [r["bucket"] for r in floats] != [r["bucket"] for r in candidate]:
            floats = None
        plot_nll_by_position(baseline, candidate, out_dir / "nll_by_position.png", floats)
        written.append(("NLL by position bucket", "nll_by_position.png"))

    grids = {side: _find(report, side, "passkey_grid") for side in ("baseline", FLOAT_CACHE, "candidate")}
    grids = {"candidate, float KV cache" if side == FLOAT_CACHE else side: grid for side, grid in grids.items()}
    grids = {side: grid for side, grid in grids.items() if grid}
    if grids and any(np.array(g["accuracy"]).size > 1 for g in grids.values()):
        plot_passkey(grids, out_dir / "passkey.png")
        written.append(("Passkey accuracy by depth and length", "passkey.png"))

    histogram = _find(report, "candidate", "kld_histogram")
    if histogram and sum(histogram["counts"]) > 0:
        plot_kld_histogram(histogram, out_dir / "kld_histogram.png")
        written.append(("Per-token KLD distribution", "kld_histogram.png"))

    for index, stage in enumerate(report.get("stages", [])):
        training = (stage.get("summary") or {}).get("training")
        if training and training["losses"]:
            name = f"training_stage{index}.png"
            plot_training_curve(training["losses"], training["evals"], out_dir / name)
            written.append((f"Training curve of stage {index} ({stage['method']})", name))
    return written
