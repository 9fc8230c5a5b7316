"""bench/draft_tree.py's count of a tree's drafts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import draft_tree  # noqa: E402


def test_a_trees_drafts_are_every_kept_branch_continued():
    assert draft_tree.drafts_of((1, 1, 1)) == 3
    assert draft_tree.drafts_of((2, 1, 1)) == 6
    assert draft_tree.drafts_of((2, 2, 1)) == 10
