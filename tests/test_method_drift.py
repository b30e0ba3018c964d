"""DRIFT (arXiv:2605.31455): discounted turn returns and group-normalised exp(R / beta) weights by hand,
the weighted-SFT loss they give, the frozen-rollout method's checks, and the preset on the tiny model
(its rollouts come from the frozen reference, evaluation from the trained policy)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.drift import discounted_returns, drift_advantage, group_softmax_weights, repeat_penalty_of
from rlpost.core.errors import ConfigError

# row 0: one turn (tokens 0-2); row 1: two turns (0-1, env 2, 3); row 2: three turns (0, env 1, 2, env 3, 4)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.float32)


def test_discounted_returns_by_hand():
    r = torch.tensor([1.0, 1.0, 1.0])
    R = discounted_returns(r, MASK, 0.9)
    # the outcome is the last turn's reward: gamma^(K-1)
    assert R.tolist() == pytest.approx([1.0, 0.9, 0.81])
    tr = torch.zeros(3, 5)
    tr[2, 0] = 0.5   # row 2, turn 0's reward
    tr[2, 2] = -1.0  # row 2, turn 1's reward
    R = discounted_returns(torch.tensor([0.0, 0.0, 2.0]), MASK, 0.5, tr)
    assert R.tolist() == pytest.approx([0.0, 0.0, 0.5 - 0.5 + 0.25 * 2.0])


def test_group_weights_by_hand():
    # group 0: returns 1 and 0 at beta 0.5 -> exp(2), exp(0) over their mean (e^2 + 1) / 2
    w = group_softmax_weights(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1]), 0.5)
    e2 = math.exp(2.0)
    assert w.tolist() == pytest.approx([2 * e2 / (e2 + 1), 2 / (e2 + 1), 1.0])
    assert float(w[:2].mean()) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        group_softmax_weights(torch.tensor([1.0]), torch.tensor([0]), 0.0)


def test_advantage_is_the_weight_on_every_token():
    inp = AdvantageInput(rewards=torch.tensor([1.0, 1.0, 0.0]), response_mask=MASK,
                         group_index=torch.tensor([0, 0, 0]))
    a = drift_advantage(inp, beta=0.1, gamma=0.9, repeat_penalty=0.0).advantages
    # returns 1, 0.9, 0 -> exp(10), exp(9), exp(0) over their mean
    e = [math.exp(10.0), math.exp(9.0), 1.0]
    m = sum(e) / 3
    w = [x / m for x in e]
    for i in range(3):
        assert a[i][MASK[i] > 0].tolist() == pytest.approx([w[i]] * int(MASK[i].sum()), rel=1e-5)
        assert float(a[i][MASK[i] == 0].abs().sum()) == 0.0


def test_repeat_penalty_by_hand():
    """lambda (1 - D / N): the authors' compute_trajectory_penalty on the answer list of a row."""
    n = torch.tensor([3.0, 0.0, 2.0, 4.0, 1.0])
    d = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.0])  # row 4: its one answer was empty (counts, not distinct)
    p = repeat_penalty_of(n, d, 0.5)
    assert p.tolist() == pytest.approx([0.5 * (1 - 1 / 3), 0.0, 0.0, 0.25, 0.5])
    with pytest.raises(ValueError):
        repeat_penalty_of(torch.tensor([1.0]), torch.tensor([2.0]), 0.5)


def test_repeat_penalty_enters_the_return_undiscounted():
    """R = sum_k gamma^k r_k - P, then the group's weights (the authors' add_weights_to_dataset)."""
    inp = AdvantageInput(rewards=torch.tensor([1.0, 1.0, 0.0]), response_mask=MASK,
                         group_index=torch.tensor([0, 0, 0]),
                         extras={"episode_answer_turns": torch.tensor([1.0, 2.0, 3.0]),
                                 "episode_distinct_answers": torch.tensor([1.0, 1.0, 3.0])})
    a = drift_advantage(inp, beta=0.1, gamma=0.9, repeat_penalty=0.5).advantages
    # returns: 1 - 0 = 1; 0.9 - 0.5 (1 - 1/2) = 0.65; 0 - 0 = 0
    e = [math.exp(10.0), math.exp(6.5), 1.0]
    m = sum(e) / 3
    assert [float(a[i][0]) for i in range(3)] == pytest.approx([x / m for x in e], rel=1e-5)
    # the penalty is not discounted: 0.9^1 * 0.25 would give exp(10 * (0.9 - 0.225)) instead
    off = drift_advantage(inp, beta=0.1, gamma=0.9, repeat_penalty=0.0).advantages
    e0 = [math.exp(10.0), math.exp(9.0), 1.0]
    assert float(off[1][0]) == pytest.approx(e0[1] / (sum(e0) / 3), rel=1e-5)


def test_multi_turn_rows_without_answer_counts_are_refused():
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 0.0]), response_mask=MASK, group_index=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="episode_answer_turns"):
        drift_advantage(inp, beta=0.1, gamma=0.9, repeat_penalty=0.5)
    drift_advantage(inp, beta=0.1, gamma=0.9, repeat_penalty=0.0)  # off: nothing to read
    one = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=MASK[:1].repeat(2, 1),
                         group_index=torch.tensor([0, 0]))
    a = drift_advantage(one, beta=0.1, gamma=0.9, repeat_penalty=0.5).advantages  # single turns: P = 0 always
    assert float(a[0][0]) == pytest.approx(2 * math.exp(10) / (math.exp(10) + 1), rel=1e-6)


class _AnswerTask:
    """extract_answer: the word after 'answer is' (None without one)."""

    def extract_answer(self, text):
        import re

        m = re.search(r"answer is\s+(\S+)", text)
        return None if m is None else m.group(1)


def test_episode_sampler_records_answer_turns_and_distinct_answers(compose):
    """Each model turn's recorded text goes through the task's extract_answer; equal answers after the authors'
    normalisation (case, whitespace) count once, a turn without an answer does not count."""
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_tokenizer
    from rlpost.samplers.base import SamplerContext, SamplingParams
    from rlpost.samplers.episode import EpisodeSampler, normalize_turn_answer
    from tests.conftest import tiny_overrides
    from tests.test_agents import ScriptedEngine

    tok = load_tokenizer(compose_config(tiny_overrides()).model)
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    turns = [ids("The answer is X7 " + call), ids("Let me check. " + call), ids("the answer is x7 " + call),
             ids("The answer is 8") + [tok.eos_token_id]]
    s = EpisodeSampler(1, max_turns=4, max_total_tokens=2000)
    s.attach(task=_AnswerTask())
    res = s.sample(ScriptedEngine(tok, turns), [[1, 2, 3]], SamplingParams(max_new_tokens=64), SamplerContext(step=1))
    assert res.extras["episode_turns"].tolist() == [4.0]
    assert res.extras["episode_answer_turns"].tolist() == [3.0]  # turn 2 holds no answer
    assert res.extras["episode_distinct_answers"].tolist() == [2.0]  # X7 = x7, then 8
    assert normalize_turn_answer(" A b\tC ") == "abc"
    # no task attached: nothing recorded (the estimator then refuses multi-turn rows)
    s2 = EpisodeSampler(1, max_turns=4, max_total_tokens=2000)
    res2 = s2.sample(ScriptedEngine(tok, turns), [[1, 2, 3]], SamplingParams(max_new_tokens=64), SamplerContext(step=1))
    assert "episode_answer_turns" not in res2.extras


def test_weighted_sft_loss_by_hand():
    """gpg with A = w and seq-mean-token-mean is the authors' mean_i w_i mean_t(-log p)."""
    from rlpost.algos.aggregation import aggregate
    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss

    lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0, 0.0], [-0.5, -1.5, 0.0, -1.0, 0.0], [-2.0, 0.0, -1.0, 0.0, -3.0]])
    w = torch.tensor([1.5, 1.0, 0.5])
    adv = w[:, None] * MASK
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp, advantages=adv, response_mask=MASK)
    mat, _ = compute_policy_loss("gpg", inp)
    loss = aggregate("seq-mean-token-mean", mat, MASK, None, None)
    # per-sample mean NLL: 2, 1, 2 -> (1.5 * 2 + 1 * 1 + 0.5 * 2) / 3
    assert float(loss) == pytest.approx((3.0 + 1.0 + 1.0) / 3)


def test_method_checks(compose):
    from rlpost.methods.base import MethodSet
    from rlpost.methods.drift import FrozenRollouts

    cfg = compose(["algo=drift"])
    ms = MethodSet.for_config(cfg)
    assert "drift" in ms.names and ms.needs().frozen_rollouts and ms.needs().reference_policy
    with pytest.raises(ConfigError, match="executor=sync"):
        FrozenRollouts(compose(["algo=drift", "executor=async"])).validate()
    with pytest.raises(ConfigError, match="repeat_penalty"):
        FrozenRollouts(compose(["algo=drift", "algo.adv_params.repeat_penalty=-0.5"])).validate()
    assert not MethodSet.for_config(compose(["algo=grpo"])).needs().frozen_rollouts


def test_rollouts_come_from_the_frozen_reference(compose, tmp_path):
    """Two steps at a large learning rate: the rollout engine keeps the initial weights (its module is the
    reference copy), evaluation's engine follows the trained policy."""
    from tests.conftest import tiny_overrides
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("algo=drift", "steps=2", "eval.at_end=false", "eval.every=0", "checkpoint.every=0",
                                 "trainer.lr=1e-2", "algo.n_samples_per_prompt=2"))
    run = Run(cfg, tmp_path / "d")
    ref0 = {k: v.clone() for k, v in run.trainer.ref.state_dict().items()}
    assert run.frozen_rollouts and run.engine is not run.local_engine
    for _ in range(2):
        m = run.train_step()
    assert m["step"] == 2
    moved = any(not torch.equal(v, run.trainer.policy.state_dict()[k]) for k, v in ref0.items())
    assert moved  # the policy trained
    eng_model = run.engine.model  # the HF engine's module: the untouched reference
    for k, v in eng_model.state_dict().items():
        assert torch.equal(v, ref0[k]), k
    ev = run.local_engine.model.state_dict()  # evaluation's engine: the trained weights
    assert all(torch.equal(v, ev[k]) for k, v in run.trainer.policy.state_dict().items())
    run.close()


def test_one_step_on_episodes_tiny(compose, tmp_path):
    """The preset trains on env=calculator episodes with the tiny model."""
    from tests.conftest import tiny_overrides
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=drift", "env=calculator", "task=multiply", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "checkpoint.every=0",
                                 "algo.n_samples_per_prompt=2"))
    train(cfg, tmp_path / "dr")
    rows = [json.loads(x) for x in (tmp_path / "dr" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 1
    assert "drift/repeat_penalty_mean" in rows[-1]  # the sampler recorded per-turn answers for the penalty
