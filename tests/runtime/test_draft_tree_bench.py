"""bench/draft_tree.py's count of a tree's drafts and of the tokens a target pass gives."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import draft_tree  # noqa: E402


def test_a_trees_drafts_are_every_kept_branch_continued():
    assert draft_tree.drafts_of((1, 1, 1)) == 3
    assert draft_tree.drafts_of((2, 1, 1)) == 6
    assert draft_tree.drafts_of((2, 2, 1)) == 10


def test_a_pass_gives_the_targets_token_and_the_drafts_accepted_in_a_row():
    """Two rounds (starts 0 and 1) over 4 positions and 3 steps: step j of the round from s sits at s + j."""
    hit = torch.tensor
    hits = [
        hit([[True, True, False, False]]),  # step 0: accepted at starts 0 and 1
        hit([[False, True, False, False]]),  # step 1 at position 1 (start 0): accepted; at 2 (start 1): not
        hit([[False, False, False, True]]),  # step 2 at position 3 (start 1): its step 1 failed, so not counted
    ]
    # start 0: 1 + step 0 + step 1 (step 2 at position 2 missed) = 3; start 1: 1 + step 0 = 2
    assert draft_tree.accepted_per_pass(hits) == 2.5
