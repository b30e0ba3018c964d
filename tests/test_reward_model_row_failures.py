"""A model reward (rm, prm or a plugin kind) that raises fails only its row (issue 52, "Failures isolated to their
row"): the row scores 0 and is counted in ``reward/<name>_errors`` and ``reward/verifier_errors``; the other rows
keep the scores they get without the failing row."""

from __future__ import annotations

import pytest
import torch

from rlpost.rewards import RewardFunction
from rlpost.rewards.models import ModelReward, ModelScore
from rlpost.tasks import Example


class LengthModel(ModelReward):
    """Scores a response by its length; a batch holding "boom" raises, as a forward error on one bad row does."""

    def __init__(self, name="len", weight=0.5):
        self.name, self.weight, self.calls = name, weight, 0

    def score(self, responses, examples, prior):
        self.calls += 1
        if any("boom" in r for r in responses):
            raise RuntimeError("forward failed on a bad row")
        return ModelScore(values=torch.tensor([float(len(r)) for r in responses]),
                          token_rewards=[[(0, 0.1 * len(r))] for r in responses])


class NoAnswerTask:
    """No verifier answer: correctness is 0 for every row, so the total is the model component alone."""

    name = "toy"

    def score(self, response, example):
        return 0.0

    def extract_answer(self, response):
        return None


def _rf(model):
    return RewardFunction(NoAnswerTask(), isolate=False, models={model.name: model})


def test_a_raising_model_reward_fails_only_its_row_and_is_counted():
    responses = ["ab", "boom", "abcd"]
    examples = [Example(index=i, question="q", answer=None) for i in range(3)]
    r = _rf(LengthModel()).score(responses, examples, torch.tensor([2, 4, 4]))
    # the other rows: 0.5 x their length, as without the failing row
    assert r.components["len"].tolist() == [1.0, 0.0, 2.0]
    assert r.total.tolist() == [1.0, 0.0, 2.0]
    assert r.metrics["reward/len_errors"] == 1.0
    clean = _rf(LengthModel()).score(["ab", "no", "abcd"], examples, torch.tensor([2, 2, 4]))
    assert r.metrics["reward/verifier_errors"] == clean.metrics["reward/verifier_errors"] + 1  # one more: the row
    assert r.metrics["reward/len_mean"] == pytest.approx((2 + 0 + 4) / 3)
    # token rewards keep their rows: the failed row has none
    assert r.token_rewards == [[(0, 0.5 * 0.2)], [], [(0, 0.5 * 0.4)]]


def test_a_batch_without_a_failure_is_scored_in_one_call():
    m = LengthModel()
    r = _rf(m).score(["ab", "abc"], [Example(index=i, question="q", answer=None) for i in range(2)],
                     torch.tensor([2, 3]))
    assert m.calls == 1 and r.components["len"].tolist() == [1.0, 1.5] and r.metrics["reward/len_errors"] == 0.0
