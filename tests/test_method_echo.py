"""ECHO (arXiv:2602.02150): token confidence and its smoothings, the branch width, the pruning rules, the
confidence-adaptive clip and the hybrid advantage shaping, by hand; presets, recipe and one tiny run; the sampler against a fake engine whose model is uncertain only after token 7."""

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.echo import (adaptive_clip, branch_width, entropy_delta, grouped_confidence, tail_confidence,
                               token_confidence, token_entropy_from_probs)
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.core.errors import ConfigError
from rlpost.samplers.echo import EchoSamplerParams, plan_branch, prune_position

PROBS = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])


def test_token_entropy_confidence_and_smoothings_by_hand():
    # C (k = 2) = mean of the two largest: (0.5 + 0.3)/2, (0.7 + 0.1)/2, 0.25
    C = token_confidence(PROBS, 2)
    assert torch.allclose(C, torch.tensor([0.4, 0.4, 0.25], dtype=torch.float64))
    # H row 0 = -(0.5 ln 0.5 + 0.3 ln 0.3 + 2 * 0.1 ln 0.1) = 0.34657 + 0.36119 + 0.46052
    H = token_entropy_from_probs(PROBS)
    assert math.isclose(float(H[0]), 1.168282, rel_tol=1e-5) and math.isclose(float(H[2]), math.log(4), rel_tol=1e-9)
    # grouped confidence W = 2: [0.4, (0.4 + 0.4)/2, (0.4 + 0.25)/2]
    assert torch.allclose(grouped_confidence(C, 2), torch.tensor([0.4, 0.4, 0.325], dtype=torch.float64))
    # dH, W = 2: [0, 2 - 1, 4 - (1 + 2)/2]
    assert entropy_delta(torch.tensor([1.0, 2.0, 4.0]), 2).tolist() == [0.0, 1.0, 2.5]
    # tail confidence: the last W tokens of each response (row 1 has 2 tokens)
    conf = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    assert torch.allclose(tail_confidence(conf, mask, 2), torch.tensor([0.35, 0.55]))
    assert torch.allclose(tail_confidence(conf, mask, 0), torch.tensor([0.25, 0.55]))  # W <= 0: whole response


def test_branch_width_by_hand():
    p = EchoSamplerParams()
    kw = dict(entropy_low=p.entropy_low, entropy_high=p.entropy_high, branch_threshold=p.branch_threshold,
              alpha=p.alpha, beta=p.beta, min_branches=p.min_branches, max_branches=p.max_branches)
    # 1 + 2 (3 - 1)/2.5 - (0.1 - 0.15)/0.15 = 1 + 1.6 + 0.3333 = 2.93 -> 3
    assert branch_width(3.0, 0.1, **kw) == 3
    assert branch_width(3.5, 0.0, **kw) == 4  # 1 + 2 + 1
    assert branch_width(1.0, 0.15, **kw) == 1  # both terms 0
    assert branch_width(6.0, 0.0, **kw) == 4  # 6 clipped to b_max
    assert branch_width(1.0, 0.6, **kw) == 1  # 1 - 3 clipped to b_min


def test_plan_branch_by_hand():
    p = EchoSamplerParams()
    H = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 4.0, 0.5], dtype=torch.float64)
    C = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.01, 0.01, 0.2], dtype=torch.float64)
    # t = 5: H 4 >= 3.5, dH = 4 - 0.5 = 3.5 >= 0.2, C^G = (0.2 + 0.2 + 0.01 + 0.01)/4 = 0.105 <= 0.15;
    # width 1 + 2 * 3/2.5 - (0.105 - 0.15)/0.15 = 1 + 2.4 + 0.3 = 3.7 -> 4
    assert plan_branch(H, C, p) == (5, 4)
    C2 = C.clone()
    C2[4] = 0.2  # C^G at 5 = 0.1525 > tau: no fork
    assert plan_branch(H, C2, p) is None


def test_pruning_decision_by_hand():
    p = EchoSamplerParams()
    H = torch.ones(8, dtype=torch.float64)
    C = torch.tensor([0.2, 0.2, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01], dtype=torch.float64)
    # C_tail (W 8) = 0.2, 0.2, 0.1367, 0.105, 0.086: three declines by t = 4 and 0.086 <= 0.1
    assert prune_position(H, C, p) == (4, "tail_decline")
    # without that rule: C^G (W 4) at t = 5 is 0.04/4 = 0.01 < 0.02 (t = 4: 0.0575)
    assert prune_position(H, C, EchoSamplerParams(tail_threshold=0.0)) == (5, "low_confidence")
    # entropy spike: dH (W 4) = 0, 0.6, 1.2, 2.0 rising 3 tokens in a row, 2.0 > 0.5
    Hs = torch.tensor([1.0, 1.0, 1.6, 2.4, 3.5], dtype=torch.float64)
    assert prune_position(Hs, torch.full((5,), 0.2, dtype=torch.float64), p) == (4, "entropy_spike")
    assert prune_position(H, torch.full((8,), 0.2, dtype=torch.float64), p) is None


def test_adaptive_clip_and_loss_by_hand():
    # eps = 0.05 + 0.15 sigmoid(4 (1 - C_tail)): C_tail 1 -> 0.125, C_tail 0 -> 0.05 + 0.15 * 0.98201 = 0.19730
    eps = adaptive_clip(torch.tensor([1.0, 0.0]), 0.05, 0.2, 4.0)
    assert torch.allclose(eps, torch.tensor([0.125, 0.05 + 0.15 / (1 + math.exp(-4))]))
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(1.2), 0.0], [math.log(1.2), 0.0]], requires_grad=True)
    A = torch.ones(2, 2)
    m = torch.ones(2, 2)
    conf = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, met = compute_policy_loss("echo", PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=A,
                                                            response_mask=m, extras={"echo_confidence": conf}))
    # row 0: ratio 1.2 clipped at 1.125; row 1: clipped at 1.19730; ratio 1 tokens: -1
    want = torch.tensor([[-1.125, -1.0], [-(1.05 + 0.15 / (1 + math.exp(-4))), -1.0]])
    assert torch.allclose(loss, want, atol=1e-5)
    assert math.isclose(float(met["clip_frac"]), 0.5)
    # without the extra: C = exp(old log-prob) = 1 on every token -> eps 0.125 on both rows
    loss2, _ = compute_policy_loss("echo", PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=A, response_mask=m))
    assert torch.allclose(loss2, torch.tensor([[-1.125, -1.0], [-1.125, -1.0]]), atol=1e-5)


def _adv_inp():
    return AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 2),
                          group_index=torch.tensor([0, 0]),
                          extras={"echo_entropy": torch.tensor([[1.0, 3.0], [1.0, 3.0]]),
                                  "echo_confidence": torch.full((2, 2), 0.2)})


def test_shaped_advantages_by_hand():
    # GRPO: +-0.5 / (sqrt(0.5) + 1e-6) = +-0.70711. z(H): mean 2, unbiased var 4/3 -> +-0.86603; z(1 - C) = 0.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    z = 1.0 / math.sqrt(4.0 / 3.0 + 1e-8)
    out = compute_advantages("echo", _adv_inp())
    want = torch.tensor([[a * (1 - 0.1 * z), a * (1 + 0.1 * z)], [-a * (1 - 0.1 * z), -a * (1 + 0.1 * z)]])
    assert torch.allclose(out.advantages, want, atol=1e-5)  # 0.64587, 0.76834
    # additive shaping: + 0.5 (S - group mean S), group mean 0
    add = compute_advantages("echo", _adv_inp(), add_coeff=0.5)
    assert torch.allclose(add.advantages, want + 0.5 * torch.tensor([[-z, z], [-z, z]]), atol=1e-5)
    # s_max clips S at 0.5
    cl = compute_advantages("echo", _adv_inp(), s_max=0.5)
    assert torch.allclose(cl.advantages[0], torch.tensor([a * 0.95, a * 1.05]), atol=1e-5)
    # no extras, no entropy, no log-probs: S = 0, plain GRPO
    bare = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 2), group_index=torch.tensor([0, 0]))
    assert torch.allclose(compute_advantages("echo", bare).advantages, torch.tensor([[a, a], [-a, -a]]), atol=1e-5)
    with pytest.raises(ConfigError):
        compute_advantages("echo", _adv_inp(), mult_coef=0.1)


def test_presets_recipe_and_bad_params(compose):
    from rlpost.config.compose import validate_config

    cfg = compose(["+recipe=echo", "model=tiny", "logger=none"])
    validate_config(cfg)
    assert (cfg.algo.adv_estimator, cfg.algo.loss, cfg.sampler.name) == ("echo", "echo", "echo")
    assert bool(cfg.task.reward.majority_vote)
    with pytest.raises(ConfigError):
        validate_config(compose(["algo=echo", "model=tiny", "sampler=echo", "+sampler.params.max_branch=3"]))
    with pytest.raises(ConfigError):
        validate_config(compose(["algo=echo", "model=tiny", "+algo.loss_params.kapa=2"]))


@pytest.mark.usefixtures("one_thread")
def test_recipe_one_step_on_the_tiny_model(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=echo", "model=tiny", "steps=1", "logger=jsonl", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "eval.at_end=false",
                          "eval.at_start=false", "checkpoint.every=0", "sampler.params.min_depth=1",
                          "sampler.params.entropy_high=0.0", "sampler.params.entropy_low=-1.0",
                          "sampler.params.entropy_delta_threshold=-100.0", "sampler.params.branch_threshold=1.0"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"])
    assert r["sampler/echo_branched_roots"] >= 1.0  # thresholds opened: every root forks


# ---------------------------------------------------------------- the sampler against its engine

# EntropyModel: next-token distribution uniform over its 12 tokens right after a 7 (H = ln 12, C = top-5 mean
# = 1/12), peaked elsewhere (H ~ 0, C ~ 1/5). FakeEngine's first root for prompt [1, 9] at seed 1 is
# [4, 9, 7, 4, 8, 1]: the 7 at index 2 makes position 3 the one uncertain position.
ROOT = [4, 9, 7, 4, 8, 1]
OPEN = dict(n_roots=1, min_depth=1, entropy_high=2.0, entropy_low=0.5, group_window=1, branch_threshold=0.15,
            prune_threshold=0.0, tail_threshold=0.0, delta_upper=100.0)


def _echo_sample(**kw):
    import dataclasses

    from fake_engine import EntropyModel, FakeEngine, scorer
    from rlpost.rollout.base import SamplingParams
    from rlpost.samplers import SAMPLERS, SamplerContext

    eng = FakeEngine({1: 0.5}, resp_len=6, model=EntropyModel())
    s = SAMPLERS.get("echo")(4, **{**OPEN, **kw})
    r = s.sample(eng, [[1, 9]], dataclasses.replace(SamplingParams(max_new_tokens=6), seed=1),
                 SamplerContext(score=scorer(), step=0, seed=0))
    return eng, r


def test_sampler_forks_where_the_engines_model_is_uncertain_with_the_width_rule():
    """Root stats by hand at t = 3: H = ln 12 = 2.4849, C^G = C = 1/12. Width
    b = round(1 + 2 (2.4849 - 0.5)/1.5 - (1/12 - 0.15)/0.15) = round(4.091) = 4: three branches, all prompted
    with [1, 9] + ROOT[:3], no fresh sample; nothing pruned at prune_threshold 0."""
    from rlpost.samplers.echo import generation_stats

    eng, r = _echo_sample()
    g = r.generation
    assert g.response_ids[0].tolist() == ROOT
    (H, C), = generation_stats(eng.model, _rows(g, [0]), 5)
    assert H[3].item() == pytest.approx(math.log(12), abs=1e-6) and C[3].item() == pytest.approx(1 / 12, abs=1e-6)
    assert H[0].item() < 1e-6 and C[0].item() == pytest.approx(0.2, abs=1e-6)
    assert r.extras["shared_prefix_len"].tolist() == [0, 3, 3, 3]
    for b in (1, 2, 3):
        assert g.prompt_ids[b][g.prompt_mask[b] > 0].tolist() == [1, 9] + ROOT[:3]
        suffix = g.response_ids[b][g.response_mask[b] > 0].tolist()
        assert g.texts[b] == eng.tokenizer.decode(ROOT[:3] + suffix)
    assert r.metrics["sampler/echo_branched_roots"] == 1.0 and r.metrics["sampler/echo_mean_width"] == 4.0
    assert r.metrics["sampler/echo_pruned"] == 0.0 and g.response_mask.sum(-1).tolist()[0] == 6.0


def test_sampler_prunes_rows_online_at_the_first_low_confidence_position():
    """prune_threshold 0.1 > 1/12: the root is cut after t = 3 (keeps 4 of 6 tokens); each branch is cut at
    its fork, position 0, where C = 1/12 (keeps 1 of 3). Rows cut 4, tokens removed 2 + 3 x 2 = 8."""
    eng, r = _echo_sample(prune_threshold=0.1)
    g = r.generation
    assert g.response_mask.sum(-1).tolist() == [4.0, 1.0, 1.0, 1.0]
    assert g.response_ids[0].tolist() == ROOT[:4] + [0, 0] and g.texts[0] == eng.tokenizer.decode(ROOT[:4])
    for b in (1, 2, 3):
        assert g.response_ids[b, 1:].tolist() == [0] * (g.response_ids.shape[1] - 1)
        assert g.texts[b] == eng.tokenizer.decode(ROOT[:3] + g.response_ids[b, :1].tolist())
        assert g.rollout_logprobs[b, 1:].abs().sum() == 0 and not bool(g.finished[b])
    assert r.metrics["sampler/echo_pruned"] == 4.0 and r.metrics["sampler/echo_pruned_tokens"] == 8.0


def _rows(g, idx):
    """Rows ``idx`` of a GenerationResult (tensors sliced, texts picked)."""
    import dataclasses

    return dataclasses.replace(g, **{f.name: (getattr(g, f.name)[idx] if torch.is_tensor(getattr(g, f.name))
                                              else [getattr(g, f.name)[i] for i in idx] if isinstance(getattr(g, f.name), list)
                                              else getattr(g, f.name)) for f in dataclasses.fields(g)})
