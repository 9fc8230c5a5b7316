"""lm-eval-harness tasks on any lmpress model, through lm-eval's own evaluator.

Sample recipe eval (a registry task where its data is reachable, a local YAML
task over local files offline):

    eval:
      lmeval: {tasks: [arc_easy], metrics: [acc, acc_norm], limit: 200}
      lmeval: {tasks: [my_task], include_path: tasks/, metrics: [acc]}

``LmpressLM`` wraps an in-memory model and its tokenizer (or, with
``LmpressLM.from_source``, an HF checkpoint directory, hub id or .gguf file) as
an lm-eval ``LM``: loglikelihood, loglikelihood_rolling and greedy
generate_until. Metrics are reported as ``TASK_METRIC`` (``arc_easy_acc``).
"""

from __future__ import annotations

import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt
from torch import nn

from lmpress.anatomy import context_length
from lmpress.errors import LmpressInputError
from lmpress.evals.kld import vocab_digest
from lmpress.evals.longctx import greedy_decode
from lmpress.registry import EvalConfig, EvalContext, EvalResult, register_eval
from lmpress.runtime.model import Transformer

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # lm-eval is optional: pip install 'lmpress[lmeval]'
    TemplateLM = object  # type: ignore[assignment,misc]


def _require_lm_eval() -> None:
    if TemplateLM is object:
        raise LmpressInputError("eval.lmeval needs lm-eval: pip install 'lm-eval>=0.4.5'")


class LmpressLM(TemplateLM):
    """An lmpress model (``nn.Module`` returning ``.logits``) as an lm-eval language model."""

    backend = "causal"

    def __init__(self, model: nn.Module, tokenizer, batch_size: int = 8, max_length: int | None = None) -> None:
        _require_lm_eval()
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self._max_length = max_length or context_length(model)
        self._device = next(model.parameters()).device

    @classmethod
    def from_source(cls, source: str, dtype: str = "float32", **kwargs: Any) -> LmpressLM:
        from lmpress.loader import load_model

        loaded = load_model(source, dtype)
        return cls(loaded.model, loaded.tokenizer, **kwargs)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context becomes: BOS where the tokenizer has one (as lm-eval's HFLM does), else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """Sum of the continuation's log-probabilities, and whether greedy decoding would produce it.

        Requests are ``(key, context_ids, continuation_ids)``; inputs longer than the
        context are cut from the left. Batches are right-padded: a causal model's
        logits before the padding do not depend on it.
        """
        prepared = []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-(self.max_length + 1) :]
            prepared.append((tokens[:-1], continuation))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(prepared)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = len(prepared[chunk[0]][0])
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                batch[row, : len(prepared[i][0])] = torch.tensor(prepared[i][0])
            logprobs = torch.log_softmax(self.model(batch.to(self._device)).logits.float(), dim=-1).cpu()
            for row, i in enumerate(chunk):
                inputs, continuation = prepared[i]
                span = logprobs[row, len(inputs) - len(continuation) : len(inputs)]
                target = torch.tensor(continuation)
                total = span.gather(-1, target[:, None]).sum().item()
                results[i] = (total, bool((span.argmax(-1) == target).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        totals = []
        for (text,) in (req.args for req in requests):
            windows = map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(logprob for logprob, _ in scored))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation up to the first stop string (or EOS, or ``max_gen_toks`` tokens)."""
        outputs = []
        runtime = Transformer.sharing(self.model)  # one runtime view for every request
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") and kwargs.get("temperature", 0) > 0:
                raise LmpressInputError("eval.lmeval: lmpress decodes greedily; set do_sample: false in the task")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            prompt = self.tok_encode(context)[-(self.max_length - max_new) :]
            stop = partial(_says_any, self.tokenizer, until)
            tokens = greedy_decode(self.model, prompt, max_new, self.eot_token_id, stop, runtime=runtime)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for s in until:
                if s:
                    text = text.split(s)[0]
            outputs.append(text)
        return outputs


def _says_any(tokenizer, stops: list[str], tokens: list[int]) -> bool:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(s and s in text for s in stops)


class LMEvalConfig(EvalConfig):
    tasks: list[str] = Field(min_length=1)
    include_path: str | None = None  # a directory of local task YAML files
    metrics: list[str] = Field(default=["acc"], min_length=1)  # reported per task as TASK_METRIC
    num_fewshot: int | None = None
    limit: PositiveInt | None = None  # examples per task (None: all)
    batch_size: PositiveInt = 8
    seed: int = 0

    def metric_names(self) -> list[str]:
        return [f"{task}_{metric}" for task in self.tasks for metric in self.metrics]

    def check(self, model: nn.Module) -> None:
        check_task_names(self, task_manager(self))


def task_manager(config: LMEvalConfig):
    """lm-eval's TaskManager; only the local tasks when they hold every task (indexing the registry takes ~30 s)."""
    _require_lm_eval()
    if config.include_path is not None and not Path(config.include_path).is_dir():
        raise LmpressInputError(f"eval.lmeval.include_path: {config.include_path} is not a directory")
    path = str(Path(config.include_path).resolve()) if config.include_path else None
    if path is not None:
        local = _manager(path, False)
        if set(config.tasks) <= set(local.all_tasks):
            return local
    return _manager(path, True)


@lru_cache(maxsize=8)
def _manager(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def check_task_names(config: LMEvalConfig, manager) -> None:
    known = set(manager.all_tasks)
    for task in config.tasks:
        if task not in known:
            where = f" or in {config.include_path}" if config.include_path else " (local tasks: set include_path)"
            raise LmpressInputError(f"eval.lmeval.tasks: lm-eval has no task {task!r} in its registry{where}")


def load_tasks(config: LMEvalConfig) -> dict[str, Any]:
    """lm-eval's loaded task objects; a clear error for an unknown task or unreachable data."""
    manager = task_manager(config)
    check_task_names(config, manager)
    try:
        return manager.load(list(config.tasks))
    except Exception as e:  # datasets raises many types for "unreachable"; lm-eval wraps others
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise LmpressInputError(
            f"eval.lmeval.tasks: cannot load the data of {', '.join(config.tasks)} ({type(e).__name__}: {first}); "
            "offline, use a local YAML task over local files (include_path)"
        ) from e


def _task_metrics(results: dict, config: LMEvalConfig) -> dict[str, float]:
    metrics = {}
    for task in config.tasks:
        scores = results.get("groups", {}).get(task) or results["results"].get(task, {})
        reported = {key.split(",")[0]: value for key, value in scores.items() if "," in key and "_stderr" not in key}
        for metric in config.metrics:
            if metric not in reported:
                raise LmpressInputError(
                    f"eval.lmeval.metrics: task {task!r} reports {sorted(reported)}, not {metric!r}"
                )
            metrics[f"{task}_{metric}"] = float(reported[metric])
    return metrics


def run_lm_eval(model: nn.Module, tokenizer, config: LMEvalConfig) -> tuple[dict[str, float], dict, dict]:
    """The configured tasks through ``lm_eval.simple_evaluate``: metrics, details, protocol."""
    import lm_eval

    load_tasks(config)  # a clear error now rather than a traceback from inside the harness
    lm = LmpressLM(model, tokenizer, batch_size=config.batch_size)
    began = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        task_manager=task_manager(config),
        log_samples=False,
        bootstrap_iters=0,
        random_seed=config.seed,
        numpy_random_seed=config.seed,
        torch_random_seed=config.seed,
        fewshot_random_seed=config.seed,
        verbosity="ERROR",
    )
    seconds = time.perf_counter() - began
    metrics = _task_metrics(results, config)
    details = {"lmeval_results": results["results"], "lmeval_seconds": seconds}
    protocol = {
        "harness": f"lm-eval {getattr(lm_eval, '__version__', '?')}",
        "tasks": config.tasks,
        "task_versions": results.get("versions", {}),
        "n_shot": results.get("n-shot", {}),
        "limit": config.limit,
        "seed": config.seed,
        "include_path": config.include_path,
        "decoding": "greedy",
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "tokenizer_sha256": vocab_digest(tokenizer),
    }
    return metrics, details, protocol


@register_eval("lmeval", LMEvalConfig)
def run_lmeval(model: nn.Module, tokenizer, config: LMEvalConfig, ctx: EvalContext) -> EvalResult:
    metrics, details, protocol = run_lm_eval(model, tokenizer, config)
    return EvalResult(metrics=metrics, details=details, protocol=protocol)
