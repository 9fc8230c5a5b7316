"""The skeleton the bench tables share: pick the rows asked for, measure each in a child process (a fresh
interpreter per row, so one row's memory and compiled state never reach another), keep each row as
``bench/results/<table>_rows/<row>.json``, and render the table from every row kept."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from readme_block import write_readme_block

REPO = Path(__file__).resolve().parents[1]


def row_parser(description: str, rows: Iterable[str], reuse_help: str, child: bool = True) -> argparse.ArgumentParser:
    """``--rows`` (default: every row), ``--reuse`` and, with ``child``, the child's hidden ``--one ROW``."""
    rows = list(rows)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", default=",".join(rows), help=f"comma-separated subset of {', '.join(rows)}")
    parser.add_argument("--reuse", action="store_true", help=reuse_help)
    if child:
        parser.add_argument("--one", help=argparse.SUPPRESS)
    return parser


def wanted_rows(parser: argparse.ArgumentParser, asked: str, known: Iterable[str]) -> list[str]:
    """The rows of ``--rows``, in its order; an unknown one ends the program with argparse's usage error."""
    known = list(known)
    wanted = [r.strip() for r in asked.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in known]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(known)}")
    return wanted


def copy_fp32_row(wanted: list[str], row_dir: Path, fp32_row: Path, **extra: Any) -> list[str]:
    """The float32 baseline row is the quantization table's: copied (with ``extra`` keys), not measured again.
    Returns the rows left to measure."""
    row_dir.mkdir(parents=True, exist_ok=True)
    if "fp32" not in wanted or not fp32_row.exists():
        return wanted
    fp32 = json.loads(fp32_row.read_text())
    (row_dir / "fp32.json").write_text(json.dumps({**fp32, **extra, "from": str(fp32_row)}) + "\n")
    return [r for r in wanted if r != "fp32"]


def measure_in_child(script: str, *args: str) -> Any:
    """Run ``script *args`` in a fresh interpreter and return the JSON of its last line of output; a failed child
    ends this program with the child's exit code after printing the end of its stderr."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        raise SystemExit(done.returncode)
    return json.loads(done.stdout.strip().splitlines()[-1])


def kept_rows(row_dir: Path, names: Iterable[str]) -> dict[str, dict]:
    """Every row of ``names`` measured and kept so far, in ``names``' order."""
    return {n: json.loads(path.read_text()) for n in names if (path := row_dir / f"{n}.json").exists()}


def publish(table: str, out: Path, results_block: tuple[str, str] | None = None) -> None:
    """Write ``table`` to ``out``, into docs/results.md between the ``results_block`` (name, heading) markers when
    given, and to stdout."""
    out.write_text(table)
    if results_block is not None:
        write_readme_block(*results_block, table)
    print(table)
