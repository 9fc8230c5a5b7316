"""vLLM serves lmpress's EAGLE-3 heads: a head trained by lmpress for a tiny random Llama, written as
OUT/draft-head, is loaded by vLLM's CPU build as the model itself (the verifier read from its config) and drafts
there as it drafts in lmpress: vLLM accepts most of its drafts where lmpress does (a head vLLM read wrongly, a
norm or the fc inputs in another order, a d2t offset misapplied, would have none accepted), and its greedy
output equals vLLM's plain decoding.

Needs the vLLM environment (docs/serving.md): ``$LMPRESS_VLLM_PYTHON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmpress.distill.draft_head import (
    DraftHeadTraining,
    capture_draft_data,
    draft_vocabulary,
    initialize_from_target,
    train_draft_head,
)
from lmpress.evals.vllm_consumer import vllm_python
from lmpress.runtime.eagle3 import Eagle3Config, Eagle3Head, save_draft_head
from lmpress.runtime.model import Transformer
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode
from tests.conftest import save_tiny_model

WORKER = textwrap.dedent(
    """
    import json, sys

    def main():
        from vllm import LLM, SamplingParams
        request = json.load(open(sys.argv[1]))
        prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
        greedy = SamplingParams(temperature=0.0, max_tokens=request["new_tokens"])
        answer = {}
        for name, model in (("plain", request["target"]), ("head", request["head"])):
            llm = LLM(model=model, enforce_eager=True, max_model_len=256, seed=0, disable_log_stats=False)
            answer[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
            counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
            answer[name + "_metrics"] = {k: v for k, v in counts.items() if k.startswith("vllm:spec_decode")}
            del llm
        json.dump(answer, open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.long
def test_vllm_drafts_with_the_head_as_lmpress_does(tmp_path):
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM's environment is not installed (docs/serving.md; set LMPRESS_VLLM_PYTHON)")
    target_dir = save_tiny_model(tmp_path / "target", "llama", num_hidden_layers=8)
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    target = Transformer.from_hf(hf)
    prompts = torch.randint(3, 300, (12, 8), generator=torch.Generator().manual_seed(0))
    config = Eagle3Config.for_target(target, hf.config, 256)
    data = capture_draft_data(target, prompts, 24, config.feature_layers)
    torch.manual_seed(0)
    head = Eagle3Head(config)
    head.draft_tokens.copy_(draft_vocabulary(data.choices, 256, config.vocab_size))
    initialize_from_target(head, hf)
    # the same prompts it is then asked to draft for: this checks how vLLM reads the head, not how it generalizes
    train_draft_head(head, target, data, DraftHeadTraining(epochs=30, steps=3, lr=3e-3, batch_size=4))
    stats = SpeculativeStats()
    for p in prompts.tolist():
        list(speculative_decode(target, p, draft_head=head, max_new_tokens=16, k=3, adaptive=False, stats=stats))
    assert stats.acceptance_rate > 0.5, stats  # lmpress's own acceptance: the head learned these continuations
    save_draft_head(head, tmp_path / "draft-head", str(target_dir), ["LlamaForCausalLM"], 3)

    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "prompts": prompts.tolist(),
                "new_tokens": 16,
                "target": str(target_dir),
                "head": str(tmp_path / "draft-head"),
            }
        )
    )
    (tmp_path / "worker.py").write_text(WORKER)
    answer_file = tmp_path / "answer.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [str(python), "-P", str(tmp_path / "worker.py"), str(request), str(answer_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads(answer_file.read_text())
    assert answer["head"] == answer["plain"]  # speculative decoding left vLLM's greedy output as it was
    metrics = answer["head_metrics"]
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted / drafted > 0.5 * stats.acceptance_rate, (metrics, stats)
