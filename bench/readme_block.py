"""Write a bench table into docs/results.md between its markers (appended under a heading the first time)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "docs" / "results.md"  # the measured tables live in the docs site


def write_readme_block(name: str, heading: str, table: str, readme: Path = README) -> None:
    """Replace what lies between ``<!-- name -->`` and ``<!-- /name -->`` with ``table``."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    text = readme.read_text()
    block = f"{begin}\n{table}{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + f"\n\n## {heading}\n\n{block}\n"
    readme.write_text(text)
