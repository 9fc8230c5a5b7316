"""Report dicts shaped like the pipeline's report.json, built from real eval results on the tiny model."""

from __future__ import annotations

from pathlib import Path

from lmpress.evals.kld import KLDConfig
from lmpress.evals.longctx import PasskeyConfig, PositionNLLConfig, run_passkey, run_position_nll
from lmpress.evals.perplexity import PerplexityConfig, run_perplexity
from tests.evals.conftest import make_ctx, perturbed

EVALS = {
    "perplexity": (PerplexityConfig(seq_len=128, windows=4, kld=KLDConfig(top_k=32)), run_perplexity),
    "ppl_by_position": (PositionNLLConfig(seq_len=512, documents=1, edges=[0, 64, 128, 256, 512]), run_position_nll),
    "passkey": (PasskeyConfig(lengths=[256, 512], depths=[0, 1], max_new_tokens=2), run_passkey),
}


def build_report(model, tokenizer, text, store: Path, noise: float = 1.0) -> dict:
    candidate = perturbed(model, noise)
    sides = {"baseline": {}, "candidate": {}}
    for name, (config, handler) in EVALS.items():
        for role, m in (("baseline", model), ("candidate", candidate)):
            sides[role][name] = handler(m, tokenizer, config, make_ctx(text, tokenizer, role, store / name))
    report = {role: {field: {} for field in ("metrics", "details", "protocol")} for role in ("baseline", "candidate")}
    for role, results in sides.items():
        for name, result in results.items():
            report[role]["metrics"].update(result.metrics)
            report[role]["details"][name] = result.details
            report[role]["protocol"][name] = result.protocol
    report["gates"] = [
        {
            "gate": "kld_mean <= 0.001",
            "metric": "kld_mean",
            "op": "<=",
            "threshold": 0.001,
            "passed": False,
            "value": report["candidate"]["metrics"]["kld_mean"],
            "margin": 0.001 - report["candidate"]["metrics"]["kld_mean"],
        },
    ]
    report["model"] = {"source": "tiny"}
    return report
