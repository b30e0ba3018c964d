"""DAPO's overlong penalty on episodes through the run's collector (issue 52): the round's scorer
(``rlpost.run.collect._round_prompts``) passes each row's longest model turn (``overlong_lengths``) on to the
step scorer, so an episode of turns 35 + 13 tokens, each inside the 40-token per-turn budget, is punished as its
35-token turn: (32 - 35) / 8 = -0.375 with an 8-token window, not -1.0 for 48 summed tokens."""

from __future__ import annotations

import torch

from rlpost.rewards import RewardFunction
from rlpost.rewards.scoring import StepScorer
from rlpost.run.collect import _round_prompts
from rlpost.samplers.base import _takes
from rlpost.tasks import Example


class NoHints:
    """A selector that plays no role (no hints)."""

    def plays(self, role):
        return False


def test_the_rounds_scorer_passes_each_rows_longest_turn_on():
    rf = RewardFunction(None, overlong_buffer=8, max_len=40)
    rf.correctness = lambda responses, examples: ([0.0] * len(responses), [False] * len(responses),
                                                  {"errors": 0, "timeouts": 0})
    scorer = StepScorer(rf, [Example(0, "q", "2")])
    _, _, score = _round_prompts([0], lambda i: [1, 2], NoHints(), None, scorer)
    assert _takes(score, "overlong_lengths")  # score_rows passes it only to a scorer that takes it
    out = score([0], ["a"], torch.tensor([48]), overlong_lengths=torch.tensor([35]))
    assert out.components["overlong"].tolist() == [-0.375]
    # without an episode's turn lengths the summed length is compared, as for a single turn
    assert score([0], ["a"], torch.tensor([48])).components["overlong"].tolist() == [-1.0]
