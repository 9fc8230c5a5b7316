import json
import math

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from lmpress.errors import LmpressInputError  # noqa: E402
from lmpress.evals.lmeval import LMEvalConfig, LmpressLM, run_lm_eval, run_lmeval  # noqa: E402
from tests.evals.conftest import make_ctx  # noqa: E402

QUESTIONS = [
    ("What does def start?", ["a function definition", "a loop", "a class body", "an import"], 0),
    ("Which keyword leaves a loop?", ["return", "break", "yield", "pass"], 1),
    ("What does len return?", ["a string", "a list", "the number of items", "nothing"], 2),
    ("Which statement raises an exception?", ["try", "assert", "with", "raise"], 3),
    ("What is a tuple?", ["an immutable sequence", "a mapping", "a set", "a file"], 0),
    ("Which value is false?", ["1", "0", "'a'", "[0]"], 1),
]


@pytest.fixture()
def task_dir(tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(
        f"""task: lmpress_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
    )
    return tmp_path


@pytest.mark.long
def test_local_multiple_choice_task_through_lm_eval_matches_hflm(tiny, task_dir):
    """The task runs through lm_eval.simple_evaluate; lm-eval's own HF wrapper gives the same scores."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tokenizer = tiny
    config = LMEvalConfig(tasks=["lmpress_tiny_mc"], include_path=str(task_dir), metrics=["acc", "acc_norm"])
    metrics, details, protocol = run_lm_eval(model, tokenizer, config)
    assert set(metrics) == set(config.metric_names()) == {"lmpress_tiny_mc_acc", "lmpress_tiny_mc_acc_norm"}
    assert protocol["tasks"] == ["lmpress_tiny_mc"] and protocol["harness"].startswith("lm-eval")

    reference = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4),
        tasks=["lmpress_tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    expected = reference["results"]["lmpress_tiny_mc"]
    assert metrics["lmpress_tiny_mc_acc"] == pytest.approx(expected["acc,none"])
    assert metrics["lmpress_tiny_mc_acc_norm"] == pytest.approx(expected["acc_norm,none"])
    assert details["lmeval_results"]["lmpress_tiny_mc"]["acc,none"] == pytest.approx(expected["acc,none"])


def _instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_and_rolling_match_hflm(tiny):
    model, tokenizer = tiny
    ours, ref = LmpressLM(model, tokenizer, batch_size=3), HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    pairs = [("The sky is", " blue."), ("def f(x):", " return x"), ("", "hello world"), ("a" * 30, " b c d")]
    for (a, ga), (b, gb) in zip(
        ours.loglikelihood(_instances("loglikelihood", pairs)),
        ref.loglikelihood(_instances("loglikelihood", pairs)),
        strict=True,
    ):
        assert a == pytest.approx(b, rel=1e-4) and ga == gb and a < 0
    texts = [("A long text about Python. " * 60,), ("short",)]
    rolling = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", texts))
    expected = ref.loglikelihood_rolling(_instances("loglikelihood_rolling", texts))
    assert rolling == pytest.approx(expected, rel=1e-4)
    assert all(math.isfinite(x) for x in rolling)


def test_generate_until_matches_hflm_greedy(tiny):
    model, tokenizer = tiny
    ours, ref = LmpressLM(model, tokenizer), HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    requests = [("def f(x):", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False})]
    assert ours.generate_until(_instances("generate_until", requests)) == ref.generate_until(
        _instances("generate_until", requests)
    )


@pytest.mark.long
def test_unknown_task_is_refused(tiny, docs_text, tmp_path, task_dir):
    model, tokenizer = tiny
    config = LMEvalConfig(tasks=["no_such_task_anywhere"], include_path=str(task_dir))
    with pytest.raises(LmpressInputError, match="lm-eval has no task 'no_such_task_anywhere'"):
        run_lmeval(model, tokenizer, config, make_ctx(docs_text, tokenizer, "baseline", tmp_path))


def test_unreachable_task_data_is_refused(tiny, tmp_path):
    model, tokenizer = tiny
    (tmp_path / "gone.yaml").write_text(
        f"""task: lmpress_gone
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "missing.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: c
doc_to_target: a
"""
    )
    config = LMEvalConfig(tasks=["lmpress_gone"], include_path=str(tmp_path))
    with pytest.raises(LmpressInputError, match="cannot load the data of lmpress_gone"):
        run_lm_eval(model, tokenizer, config)


def test_missing_metric_is_a_clear_error(tiny, task_dir):
    model, tokenizer = tiny
    config = LMEvalConfig(tasks=["lmpress_tiny_mc"], include_path=str(task_dir), metrics=["f1"], limit=2)
    with pytest.raises(LmpressInputError, match="reports .*'acc'.*not 'f1'"):
        run_lm_eval(model, tokenizer, config)
