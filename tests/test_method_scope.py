"""SCOPE (arXiv:2602.24110): a PRM locates a failed rollout's first wrong step; the prefix stays, the suffix is resampled.

A fake engine (one character per token) and PRM scores set by hand give the repair's exact
tokens, log-probs, rewards and counts; the bad inputs (no PRM path, a bad threshold, a misspelt
parameter, no step in any failed rollout) are errors naming the fix; one step on ``model=tiny``
with a random tiny PRM runs the whole path.
"""

import json

import pytest
import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import SamplerContext, build_sampler
from conftest import CharTok  # noqa: E402


class FakeEngine:
    """First call: every row answers ``first``; later calls (continuations) answer ``cont``.

    Each token's rollout log-prob is -0.1 in the first call and -0.5 in later ones.
    """

    pad_id = 0

    def __init__(self, first="ab\ncd\nef", cont="\nX"):
        self.tokenizer, self.first, self.cont, self.calls = CharTok(), first, cont, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        text = self.first if len(self.calls) == 1 else self.cont
        B, P, R = len(prompts), max(len(p) for p in prompts), len(text)
        pid, pm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            pid[i, P - len(p):] = torch.tensor(p)
            pm[i, P - len(p):] = 1
        lp = -0.1 if len(self.calls) == 1 else -0.5
        return GenerationResult(prompt_ids=pid, prompt_mask=pm,
                                response_ids=torch.tensor([[ord(c) for c in text]] * B), response_mask=torch.ones(B, R),
                                rollout_logprobs=torch.full((B, R), lp), temperatures=torch.ones(B, R),
                                finished=torch.ones(B, dtype=torch.bool), texts=[text] * B)


def scorer(texts_seen):
    """Reward 1 for a response containing 'X', else 0 (each call recorded)."""
    from rlpost.rewards import Rewards

    def score(rows, texts, lengths):
        texts_seen.append(list(texts))
        r = torch.tensor([1.0 if "X" in t else 0.0 for t in texts])
        return Rewards(r, {"correct": r})

    return score


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    from test_reward_models import _tiny_classifier

    return _tiny_classifier(tmp_path_factory.mktemp("scope"), token=True)


def scope(prm_dir, scores, spans=None, **params):
    """A scope sampler (group size 2) whose PRM returns ``scores`` (per failed row) on the given spans."""
    from omegaconf import OmegaConf

    s = build_sampler(OmegaConf.create({"name": "scope", "params": {"prm_model_path": prm_dir, **params}}), 2)
    s.attach(task=None, examples=["ex0"])
    s._attached = True  # the fake PRM below needs no weights

    def step_scores(texts, examples):
        sp = spans if spans is not None else [[(0, 2), (3, 5), (6, 8)] for _ in texts]  # "ab", "cd", "ef"
        return sp[:len(texts)], scores[:len(texts)]

    s.prm.step_scores = step_scores
    return s


def test_first_error_hand_values():
    from rlpost.samplers.scope import first_error

    assert first_error([0.9, 0.2, 0.8], 0.5) == 1
    assert first_error([0.9, 0.6], 0.5) is None
    assert first_error([0.4], 0.5) == 0
    assert first_error([], 0.5) is None


def test_scope_repairs_from_the_first_wrong_step_by_hand(prm_dir):
    # Two rollouts of prompt "Q", both "ab\ncd\nef" (reward 0). PRM: row 0 scores (0.9, 0.2, 0.8) -> the
    # first error is step 1 ("cd"), so step 0 "ab" is kept: 2 tokens (its last character 'b' is token 1).
    # Row 1 scores (0.1, ...) -> the first step is already wrong: nothing to keep, not repaired.
    # One continuation of "Q" + "ab" -> "\nX" (reward 1): row 0 becomes "ab\nX", log-probs
    # (-0.1, -0.1, -0.5, -0.5), reward 1; row 1 is unchanged; 3 rollouts spent.
    seen = []
    s = scope(prm_dir, [[0.9, 0.2, 0.8], [0.1, 0.9, 0.9]])
    eng = FakeEngine()
    from rlpost.rollout.base import SamplingParams

    res = s.sample(eng, [[ord("Q")]], SamplingParams(max_new_tokens=8), SamplerContext(score=scorer(seen), prompt_indices=[0]))
    assert eng.calls[1][0] == [[ord("Q"), ord("a"), ord("b")]]  # the continuation is prompted with the prefix
    assert eng.calls[1][1].max_new_tokens == 6  # the step's budget minus the kept prefix
    g = res.generation
    assert g.texts == ["ab\nX", "ab\ncd\nef"]
    assert g.response_ids[0, :4].tolist() == [ord(c) for c in "ab\nX"] and g.response_mask[0].sum() == 4
    assert torch.allclose(g.rollout_logprobs[0, :4], torch.tensor([-0.1, -0.1, -0.5, -0.5]))
    assert g.prompt_ids[0][g.prompt_mask[0] > 0].tolist() == [ord("Q")]  # trained under the original prompt
    assert res.rewards.tolist() == [1.0, 0.0] and res.extras["reward_correct"].tolist() == [1.0, 0.0]
    assert res.group_index.tolist() == [0, 0] and res.rollouts_spent == 3
    m = res.metrics
    assert (m["sampler/scope_failed"], m["sampler/scope_located"], m["sampler/scope_replaced"]) == (2.0, 1.0, 1.0)
    assert m["sampler/scope_repair_solved"] == 1.0 and m["sampler/scope_prefix_tokens_mean"] == 2.0
    assert seen == [["ab\ncd\nef"] * 2, ["ab\nX"]]  # each generated row scored once


def test_scope_replace_better_keeps_a_failed_rollout_when_the_repair_is_no_better(prm_dir):
    from rlpost.rollout.base import SamplingParams

    s = scope(prm_dir, [[0.9, 0.2, 0.8], [0.1, 0.9, 0.9]], replace="better")
    res = s.sample(FakeEngine(cont="\nY"), [[ord("Q")]], SamplingParams(max_new_tokens=8),
                   SamplerContext(score=scorer([]), prompt_indices=[0]))
    assert res.generation.texts == ["ab\ncd\nef"] * 2 and res.metrics["sampler/scope_replaced"] == 0.0
    assert res.metrics["sampler/scope_located"] == 1.0 and res.rollouts_spent == 3  # the repair was still paid for
    s = scope(prm_dir, [[0.9, 0.2, 0.8], [0.1, 0.9, 0.9]], replace="always")
    res = s.sample(FakeEngine(cont="\nY"), [[ord("Q")]], SamplingParams(max_new_tokens=8),
                   SamplerContext(score=scorer([]), prompt_indices=[0]))
    assert res.generation.texts == ["ab\nY", "ab\ncd\nef"] and res.metrics["sampler/scope_replaced"] == 1.0


def test_scope_bad_inputs_are_errors_naming_the_fix(prm_dir):
    from omegaconf import OmegaConf

    from rlpost.rollout.base import SamplingParams

    with pytest.raises(ConfigError, match="prm_model_path"):
        build_sampler(OmegaConf.create({"name": "scope", "params": {}}), 2)
    with pytest.raises(ConfigError, match="error_threshold"):
        build_sampler(OmegaConf.create({"name": "scope", "params": {"prm_model_path": prm_dir, "error_threshold": 1.5}}), 2)
    with pytest.raises(ConfigError, match="error_treshold"):
        build_sampler(OmegaConf.create({"name": "scope", "params": {"prm_model_path": prm_dir, "error_treshold": 0.5}}), 2)
    with pytest.raises(ConfigError):  # a directory without a PRM head (no config.json)
        build_sampler(OmegaConf.create({"name": "scope", "params": {"prm_model_path": "/nonexistent"}}), 2)
    s = scope(prm_dir, [[], []], spans=[[], []])  # the rule finds no step in any failed rollout
    with pytest.raises(ConfigError, match="found no steps.*segment=newline"):
        s.sample(FakeEngine(), [[ord("Q")]], SamplingParams(max_new_tokens=8), SamplerContext(score=scorer([]), prompt_indices=[0]))
    s = scope(prm_dir, [[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])  # every step passes: nothing to repair, not an error
    res = s.sample(FakeEngine(), [[ord("Q")]], SamplingParams(max_new_tokens=8), SamplerContext(score=scorer([]), prompt_indices=[0]))
    assert res.metrics["sampler/scope_located"] == 0.0 and res.rollouts_spent == 2


def test_scope_sampler_runs_a_step_on_tiny(tmp_path, prm_dir):
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=8", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0", "steps=1",
                          "sampler=scope", f"sampler.params.prm_model_path={prm_dir}", "sampler.params.segment=sentence"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert r["sampler/scope_failed"] >= 0 and "sampler/scope_located" in r
