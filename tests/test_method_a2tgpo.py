"""A²TGPO (arXiv:2605.06200): information gain, turn-group normalisation, rescaled accumulation and the
turn clip, hand-computed; the IG passes' batch; and the preset on the tiny model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.algos.a2tgpo import TURN_IG_KEY, a2tgpo_advantage, a2tgpo_clip_loss, turn_group_normalise
from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.losses import PolicyLossInput
from rlpost.methods.a2tgpo import InfoGain, gt_passes, info_gain

# row 0: turn 0 = tokens 0-1, env 2, turn 1 = 3-4; row 1: turn 0 = 0, env 1-2, turn 1 = 3, env 4, turn 2 = 5-6
MASK = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 1, 1]], dtype=torch.float32)


def _adv(gamma=1.0, sqrt_rescale=True, ig=True):
    n = torch.zeros(2, 7)
    n[0, 0:2] = 1.0     # row 0 turn 0
    n[1, 0] = -1.0      # row 1 turn 0
    n[1, 3] = 0.5       # row 1 turn 1
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=MASK, group_index=torch.tensor([0, 0]),
                         extras={TURN_IG_KEY: n} if ig else {})
    return a2tgpo_advantage(inp, gamma=gamma, sqrt_rescale=sqrt_rescale, eps=1e-6).advantages


def test_advantage_by_hand():
    a = _adv()
    # outcome terms: rewards (1, 0), mean 0.5, unbiased std 0.70711 -> +0.70711 / -0.70711
    # row 0 terms (1.0, 0.70711): A_1 = 0.70711 / sqrt(1); A_0 = 1.70711 / sqrt(2) = 1.20711
    assert torch.allclose(a[0], torch.tensor([1.20711, 1.20711, 0, 0.70711, 0.70711, 0, 0]), atol=1e-4)
    # row 1 terms (-1, 0.5, -0.70711): A_2 = -0.70711; A_1 = -0.20711 / sqrt(2) = -0.14645;
    # A_0 = -1.20711 / sqrt(3) = -0.69692
    assert torch.allclose(a[1], torch.tensor([-0.69692, 0, 0, -0.14645, 0, -0.70711, -0.70711]), atol=1e-4)


def test_advantage_discount_and_no_rescale():
    # gamma 0.5, row 1 turn 0: (-1 + 0.5 * 0.5 + 0.25 * -0.70711) / sqrt(3) = -0.92678 / 1.73205 = -0.53508
    assert float(_adv(gamma=0.5)[1, 0]) == pytest.approx(-0.53508, abs=1e-4)
    # without the sqrt rescale (IGPO's plain sum): row 0 turn 0 = 1 + 0.70711
    assert float(_adv(sqrt_rescale=False)[0, 0]) == pytest.approx(1.70711, abs=1e-4)


def test_advantage_without_ig_is_grpo_on_the_last_turn():
    # invariant: no IG -> the last turn carries the GRPO advantage, turn k the same divided by sqrt(K - k)
    a = _adv(ig=False)
    g = 0.5 / math.sqrt(0.5)
    assert float(a[0, 3]) == pytest.approx(g, abs=1e-5) and float(a[0, 0]) == pytest.approx(g / math.sqrt(2), abs=1e-5)
    assert float(a[1, 0]) == pytest.approx(-g / math.sqrt(3), abs=1e-5)
    # single-turn rows: exactly GRPO
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 0.5]), response_mask=torch.ones(3, 2),
                         group_index=torch.tensor([0, 0, 0]))
    out = a2tgpo_advantage(inp, gamma=1.0, sqrt_rescale=True, eps=1e-6).advantages
    assert torch.allclose(out[:, 0], torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)


def test_turn_group_normalise_by_hand():
    # group 0: turn-0 IG (0.2, 0.4): mean 0.3, population std 0.1 -> (-1, +1); turn 1 has one row -> 0;
    # group 1: one row -> 0
    out = turn_group_normalise([[0.2], [0.4, 0.1], [0.3]], torch.tensor([0, 0, 1]), eps=0.0)
    assert out[0][0] == pytest.approx(-1.0) and out[1][0] == pytest.approx(1.0)
    assert out[1][1] == 0.0 and out[2] == [0.0]


def test_info_gain_by_hand():
    m = [math.log(0.2), math.log(0.5), math.log(0.4)]
    assert info_gain(m, "prob_diff") == pytest.approx([0.3, -0.1])
    assert info_gain(m, "log_prob_diff") == pytest.approx([math.log(2.5), math.log(0.8)])
    assert info_gain([-1.0], "prob_diff") == []


def _loss(n):
    lp = torch.log(torch.tensor([[1.24]])).requires_grad_(True)
    inp = PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros(1, 1), advantages=torch.ones(1, 1),
                          response_mask=torch.ones(1, 1), extras={TURN_IG_KEY: torch.tensor([[n]])})
    loss, metrics = a2tgpo_clip_loss(inp, eps_low=0.2, eps_high=0.2, beta=0.3)
    loss.sum().backward()
    return float(loss.detach()), float(lp.grad), metrics


def test_turn_clip_by_hand():
    # ratio 1.24, A = 1. n = 2: c = 1 + 0.3 (2 sigmoid(2) - 1) = 1 + 0.3 * 0.76159 = 1.22848, cap 1.24570:
    # inside, loss -1.24 and gradient -1.24 (d(-r)/dlogp = -r); plain PPO (cap 1.2) would have clipped it
    loss, grad, m = _loss(2.0)
    assert loss == pytest.approx(-1.24) and grad == pytest.approx(-1.24)
    assert float(m["clip_scale_mean"]) == pytest.approx(1.22848, abs=1e-5)
    # n = -2: c = 0.77152, cap 1.15430: clipped, loss -1.15430, no gradient
    loss, grad, _ = _loss(-2.0)
    assert loss == pytest.approx(-1.15430, abs=1e-5) and grad == 0.0
    # n = 0: c = 1: PPO's 1.2 cap
    assert _loss(0.0)[0] == pytest.approx(-1.2)


def test_gt_passes_rows():
    batch = SimpleNamespace(response_ids=torch.arange(10, 17).repeat(2, 1), prompt_ids=torch.ones(2, 3, dtype=torch.long),
                            prompt_mask=torch.ones(2, 3, dtype=torch.long), group_index=torch.tensor([0, 0]),
                            prompt_index=torch.tensor([5, 5]), extras={})
    spans = [[(0, 2), (3, 5)], [(0, 7)]]  # row 1 has one turn: no pass
    sb, items = gt_passes(batch, spans, [[7, 8], [9]], [1])
    assert items == [(0, 0), (0, 1)]
    assert sb.response_ids.tolist() == [[1, 7, 8, 0, 0, 0], [10, 11, 12, 1, 7, 8]]
    assert sb.response_mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]]
    assert sb.extras["response_attn"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]


def test_prepare_end_to_end_with_a_fake_pass(compose):
    cfg = compose(["algo=a2tgpo"])
    m = InfoGain(cfg)
    m.validate()
    # two 2-turn episodes of one group; answer probabilities before turns 0 and 1: (0.2, 0.5) and (0.3, 0.4)
    probs = torch.tensor([0.2, 0.5, 0.3, 0.4])
    batch = SimpleNamespace(response_ids=torch.arange(5).repeat(2, 1) + 10, response_mask=torch.tensor([[1., 0, 1, 1, 0]] * 2),
                            prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                            group_index=torch.tensor([3, 3]), prompt_index=torch.tensor([0, 0]), answers=[42, 42], extras={})
    run = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens=False: [len(s)] * 2),
                          rows_pass=lambda b, fn: fn(b),
                          logprobs=lambda b: (torch.log(probs)[:, None].expand(len(b.response_ids), b.response_ids.shape[1]), None))
    metrics = m.prepare(batch, run)
    # IG = (0.3, 0.1): mean 0.2, population std 0.1 -> (+1, -1) on each row's turn 0, 0 on the final turn
    ig = batch.extras[TURN_IG_KEY]
    assert torch.allclose(ig, torch.tensor([[1.0, 0, 0, 0, 0], [-1.0, 0, 0, 0, 0]]), atol=1e-4)
    assert metrics["a2tgpo/passes"] == 4.0 and metrics["a2tgpo/ig_mean"] == pytest.approx(0.2)


def test_config_errors(compose):
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown parameter"):
        InfoGain(compose(["algo=a2tgpo", "+algo.info_gain.prefix=x"])).validate()
    with pytest.raises(ConfigError, match="ig_type"):
        InfoGain(compose(["algo=a2tgpo", "algo.info_gain.ig_type=ratio"])).validate()
    with pytest.raises(ConfigError, match="adv_estimator=a2tgpo"):
        InfoGain(compose(["algo=grpo", "algo.loss=a2tgpo_clip"])).validate()


def test_one_step_on_episodes_tiny(compose, tmp_path):
    """The preset trains one step on env=calculator episodes with the tiny model (the IG passes run
    through the real trainer when an episode has two turns; the tiny model rarely calls a tool)."""
    import json

    from tests.conftest import tiny_overrides
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=a2tgpo", "env=calculator", "task=multiply", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "checkpoint.every=0"))
    train(cfg, tmp_path / "a2")
    rows = [json.loads(x) for x in (tmp_path / "a2" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "a2tgpo/passes" in r)
    assert m["a2tgpo/passes"] >= 0 and math.isfinite(m["actor/loss"] if "actor/loss" in m else 0.0)


def test_ig_pass_equals_a_direct_forward_on_the_tiny_model(compose, tmp_path):
    """The scoring rows through the real trainer give the same answer log-probs as a plain forward of
    prompt + context-before-turn-k + prefix + answer (a hand-built 2-turn episode)."""
    from rlpost.core.batch import RolloutBatch
    from rlpost.run.runner import Run
    from tests.conftest import tiny_overrides

    run = Run(compose(tiny_overrides("algo=a2tgpo", "rollout.temperature=1.0", "algo.info_gain.ig_type=log_prob_diff")),
              tmp_path / "r")
    try:
        tok, pol = run.services.tokenizer, run.services.policy
        prompt = torch.tensor([[0, 0, 5, 6]]).repeat(2, 1)        # left-padded prompt, 2 real tokens
        pmask = torch.tensor([[0, 0, 1, 1]]).repeat(2, 1)
        resp = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])
        mask = torch.tensor([[1., 1, 0, 0, 1, 1], [1., 0, 0, 1, 1, 0]])  # two turns each; env tokens in between
        batch = RolloutBatch(prompt_ids=prompt, prompt_mask=pmask, response_ids=resp, response_mask=mask,
                             rollout_logprobs=torch.zeros(2, 6), group_index=torch.tensor([0, 1]),
                             prompt_index=torch.tensor([0, 1]), answers=[7, 123],
                             extras={"response_attn": torch.tensor([[1.] * 6, [1.] * 5 + [0.]])})
        m = InfoGain(run.cfg)
        m.validate()
        metrics = m.prepare(batch, run.services)
        pre = tok.encode("The answer is", add_special_tokens=False)

        def direct(i, s):
            ans = tok.encode(" " + str(batch.answers[i]), add_special_tokens=False)
            ids = torch.tensor([[5, 6] + resp[i, :s].tolist() + pre + ans])
            with torch.no_grad():
                lp = torch.log_softmax(pol(input_ids=ids).logits.float(), -1)[0]
            L = ids.shape[1]
            return float(sum(lp[t - 1, ids[0, t]] for t in range(L - len(ans), L)) / len(ans))

        # turn starts: row 0 at 0 and 4, row 1 at 0 and 3; IG = m_1 - m_0 (log_prob_diff: a random tiny model's
        # answer probabilities are ~1/vocab, too small to compare as probabilities)
        ms = [direct(0, 0), direct(0, 4), direct(1, 0), direct(1, 3)]
        assert all(abs(x) > 1.0 for x in ms) and abs(ms[1] - ms[0]) > 1e-3
        igs = [ms[1] - ms[0], ms[3] - ms[2]]
        assert metrics["a2tgpo/passes"] == 4.0
        assert metrics["a2tgpo/ig_mean"] == pytest.approx(sum(igs) / 2, rel=1e-4, abs=1e-6)
        assert torch.equal(batch.extras[TURN_IG_KEY], torch.zeros(2, 6))  # one row per group: normalised to 0
    finally:
        run.close()
