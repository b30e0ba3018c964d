"""DARE (arXiv:2601.21804): the label-free reward from the group's uncertainty-aware answer distribution.

Hand-computed distribution, pruning, exploration bonus and GRPO advantage on a small group; the
estimator's inputs (answer clusters, token entropy) come from the run's methods; one step on the tiny
model through the runner; bad parameters are errors.
"""

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError


def _entropy(u, R=3):
    """[B, R] entropy whose per-row mean token entropy is ``u`` (constant over the row's tokens)."""
    return torch.tensor(u, dtype=torch.float32)[:, None].expand(len(u), R).clone()


def test_dare_rewards_by_hand():
    from rlpost.algos.dare import dare_rewards

    # one group of M = 4: answers A, A, B, C with mean token entropies 0.2, 0.4, 0.25, 1.5
    # u(A) = 0.3, u(B) = 0.25, u(C) = 1.5; n / u = 2/0.3, 1/0.25, 1/1.5 = 6.667, 4, 0.667 (sum 11.333)
    # p = 0.5882, 0.3529, 0.0588; tau 0.1 prunes C; p~ = 6.667/10.667 = 0.625, 4/10.667 = 0.375; M~ = 3
    # b~(A) = (1 - 2/3)(1 - 0.3) = 0.2333, b~(B) = (1 - 1/3)(1 - 0.25) = 0.5
    # r = p~ + 0.5 b~: A 0.625 + 0.11667 = 0.74167, B 0.375 + 0.25 = 0.625, C (pruned) 0
    r, kept = dare_rewards(torch.tensor([0, 0, 1, 2]), torch.tensor([0.2, 0.4, 0.25, 1.5]), torch.zeros(4, dtype=torch.long),
                           alpha=0.5, prune_threshold=0.1, uncertainty_eps=1e-8, clip_bonus=True)
    assert r.tolist() == pytest.approx([0.741667, 0.741667, 0.625, 0.0], abs=1e-5)
    assert kept.tolist() == [True, True, True, False]
    # majority voting would give B (a minority answer) 0; DARE gives it most of A's reward
    # no pruning (tau 0): p = 0.5882, 0.3529, 0.0588, M = 4; b(A) = 0.5 x 0.7 = 0.35, b(B) = 0.75 x 0.75 = 0.5625,
    # b(C) = 0.75 x (1 - 1.5) = -0.375, clipped to 0: r(C) = 0.0588 (unclipped: 0.0588 - 0.1875 = -0.1287)
    r0, _ = dare_rewards(torch.tensor([0, 0, 1, 2]), torch.tensor([0.2, 0.4, 0.25, 1.5]), torch.zeros(4, dtype=torch.long),
                         alpha=0.5, prune_threshold=0.0, uncertainty_eps=1e-8, clip_bonus=True)
    assert r0.tolist() == pytest.approx([0.588235 + 0.175, 0.588235 + 0.175, 0.352941 + 0.28125, 0.058824], abs=1e-5)
    r1, _ = dare_rewards(torch.tensor([0, 0, 1, 2]), torch.tensor([0.2, 0.4, 0.25, 1.5]), torch.zeros(4, dtype=torch.long),
                         alpha=0.5, prune_threshold=0.0, uncertainty_eps=1e-8, clip_bonus=False)
    assert float(r1[3]) == pytest.approx(0.058824 - 0.1875, abs=1e-5)


def test_dare_edge_cases():
    from rlpost.algos.dare import dare_rewards

    kw = dict(alpha=0.5, prune_threshold=0.1, uncertainty_eps=1e-8, clip_bonus=True)
    # one answer: p = 1, bonus (1 - 2/2) = 0 -> 1 each; an unparseable row (negative id) gets 0 and counts in nothing
    r, kept = dare_rewards(torch.tensor([3, 3, 5, -4]), torch.tensor([0.5, 0.1, 0.3, 0.0]), torch.tensor([0, 0, 1, 1]), **kw)
    assert r.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0]) and kept.tolist() == [True, True, True, False]
    # a threshold above every p still keeps the most probable answer: three equal answers, p = 1/3 each < 0.5
    r, kept = dare_rewards(torch.tensor([0, 1, 2]), torch.tensor([0.2, 0.2, 0.2]), torch.zeros(3, dtype=torch.long),
                           alpha=0.5, prune_threshold=0.5, uncertainty_eps=1e-8, clip_bonus=True)
    # all three tie at the maximum: all kept, p~ = 1/3, b = (1 - 1/3) 0.8 = 0.5333 -> r = 0.3333 + 0.2667 = 0.6
    assert r.tolist() == pytest.approx([0.6, 0.6, 0.6], abs=1e-6) and kept.all()
    with pytest.raises(ValueError, match=">= 0"):
        dare_rewards(torch.tensor([0, 1]), torch.tensor([-0.1, 0.2]), torch.zeros(2, dtype=torch.long), **kw)


def test_dare_advantage_by_hand():
    # group 0 as above: r = 0.74167, 0.74167, 0.625, 0; mean 0.52708; unbiased std 0.35567
    # A = (r - mean) / (std + 1e-6) = 0.60332, 0.60332, 0.27530, -1.48194; group 1 (one answer): 0
    mask = torch.ones(6, 3)
    mask[2, 2] = 0
    inp = AdvantageInput(rewards=torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]),  # gold rewards: never read
                         response_mask=mask, group_index=torch.tensor([0, 0, 0, 0, 1, 1]),
                         answer_ids=torch.tensor([0, 0, 1, 2, 7, 7]),
                         entropy=_entropy([0.2, 0.4, 0.25, 1.5, 0.9, 0.1]))
    inp.entropy[2, 2] = 50.0  # off the mask: not counted in the row's mean entropy
    out = compute_advantages("dare", inp)
    assert out.advantages[:, 0].tolist() == pytest.approx([0.60332, 0.60332, 0.27530, -1.48194, 0.0, 0.0], abs=1e-4)
    assert float(out.advantages[2, 2]) == 0.0 and (out.advantages[4:] == 0).all()
    same = compute_advantages("dare", AdvantageInput(**{**inp.__dict__, "rewards": torch.zeros(6)}))
    assert torch.equal(same.advantages, out.advantages)  # label-free: the verifier's rewards do not enter


def test_dare_preset_params_and_errors(compose):
    from conftest import tiny_overrides
    from rlpost.config.compose import validate_config
    from rlpost.methods.base import MethodSet

    cfg = compose(tiny_overrides("algo=dare"))
    assert cfg.algo.adv_estimator == "dare" and cfg.algo.loss == "ppo_clip"
    names = {m.name for m in MethodSet.for_config(cfg).methods}
    assert {"rollout_entropy", "seed_grpo"} <= names  # token entropy and answer clusters are filled for it
    with pytest.raises(ConfigError, match="alpa"):
        validate_config(compose(tiny_overrides("algo=dare", "+algo.adv_params.alpa=0.3")))
    inp = AdvantageInput(rewards=torch.zeros(2), response_mask=torch.ones(2, 2), group_index=torch.zeros(2, dtype=torch.long),
                         answer_ids=torch.tensor([0, 1]), entropy=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="alpha"):
        compute_advantages("dare", inp, alpha=1.5)
    with pytest.raises(ValueError, match="answer clusters"):
        compute_advantages("dare", AdvantageInput(rewards=torch.zeros(2), response_mask=torch.ones(2, 2),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def test_dare_trains_on_tiny(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo=dare", "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0",
                          "steps=1"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert r["step"] == 1 and all(isinstance(v, (int, float)) for k, v in r.items() if k.startswith("loss/"))
