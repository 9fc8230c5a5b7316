"""Where a runtime process's resident memory goes when it loads an export (issue 11's peak-RSS goal).

    python bench/load_memory.py                 # SmolLM2 W4 g64 with a W8 head, as bench/runtime.py's row

Steps, each the RSS it adds: ``import torch``; the tokenizer (``RuntimeTokenizer``), before and after
freed memory is handed back (``return_freed_memory``); the model (``load_checkpoint``); and the total
after ``load_runtime``, which does both, run in a fresh process. Writes bench/results/load_memory.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def rss_mib() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def steps() -> dict[str, float]:
    python = rss_mib()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime import w4_artifact

    from lmpress.memory import return_freed_memory
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.tokenizer import RuntimeTokenizer

    path, out = w4_artifact("w4g64-head8"), {"python_mib": python}
    out["import_torch_and_lmpress_mib"] = round(rss_mib() - python, 1)
    before = rss_mib()
    tokenizer = RuntimeTokenizer(path)
    out["tokenizer_mib"] = round(rss_mib() - before, 1)
    return_freed_memory()
    out["tokenizer_after_trim_mib"] = round(rss_mib() - before, 1)
    before = rss_mib()
    model = load_checkpoint(path, torch.float32, torch.device("cpu"))
    return_freed_memory()
    out["model_mib"] = round(rss_mib() - before, 1)
    del tokenizer, model
    return out


def load_runtime_total() -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime import w4_artifact

    from lmpress.runtime.text import load_runtime

    load_runtime(str(w4_artifact("w4g64-head8")), "cpu", "float32")
    return rss_mib()


def main() -> None:
    if sys.argv[1:] == ["--total"]:
        print(load_runtime_total())
        return
    result = steps()
    total = subprocess.run([sys.executable, __file__, "--total"], capture_output=True, text=True, check=True)
    result["load_runtime_total_mib"] = float(total.stdout.split()[-1])
    (RESULTS / "load_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
