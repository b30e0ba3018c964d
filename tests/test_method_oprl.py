"""OPRL (arXiv:2509.19199): an implicit PRM trained online by trajectory DPO; step plus episode advantages.

Hand-computed DPO loss, preference pairs, implicit step rewards and the combined advantage; the
PRM update on ``model=tiny`` lowers the DPO loss, its chunked gradient equals the one-shot one,
its state survives a checkpoint round trip; bad inputs are errors naming the fix.
"""

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError


def test_preference_pairs_and_dpo_loss_by_hand():
    from rlpost.algos.oprl import dpo_loss, preference_pairs

    # group 0 rewards (1, 0, 0.5): pairs (0 > 1), (0 > 2), (2 > 1); group 1 has one row: none
    assert preference_pairs(torch.tensor([1.0, 0.0, 0.5, 1.0]), torch.tensor([0, 0, 0, 1])) == [(0, 1), (0, 2), (2, 1)]
    # s_phi (-1, -3), s_old (-2, -2): h = (1, -1); beta 0.5: 0.5 (1 - (-1)) = 1 -> -log sigmoid(1) = log(1 + e^-1)
    s_phi = torch.tensor([-1.0, -3.0], requires_grad=True)
    loss = dpo_loss(s_phi, torch.tensor([-2.0, -2.0]), [(0, 1)], 0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    loss.backward()  # d/ds_0 = -beta sigmoid(-1) = -0.5 x 0.268941: raising the preferred row lowers the loss
    assert s_phi.grad.tolist() == pytest.approx([-0.5 * 0.268941, 0.5 * 0.268941], abs=1e-5)
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo_loss(s_phi, s_phi.detach(), [], 0.5)


def test_step_rewards_by_hand():
    from rlpost.algos.oprl import step_rewards

    # lp_phi - lp_old = (0.2, 0.4, -0.1), steps (1, 1, 2), beta 0.5: step 1 = 0.5 x 0.6 = 0.3, step 2 = -0.05
    sr = step_rewards(torch.tensor([[0.2, 0.4, -0.1, 9.0]]), torch.zeros(1, 4), torch.tensor([[1, 1, 2, 0]]), 0.5)
    assert torch.allclose(sr, torch.tensor([[0.3, 0.3, -0.05, 0.0]]), atol=1e-6)


def test_oprl_advantage_by_hand():
    # Rewards (1, 0): A^E = +-0.70711. Step rewards: row 0 steps (0.3, -0.05), row 1 (0.1, -0.2).
    # Group steps .3, -.05, .1, -.2: mean .0375, Bessel var .045625, std .213600 ->
    # z = 1.22893, -0.40964, 0.29260, -1.11189. Row 0 = .70711 + (1.22893, 1.22893, -0.40964);
    # row 1 = -.70711 + (0.29260, -1.11189, 0) (its token 2 is in no step).
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3),
                         group_index=torch.zeros(2, dtype=torch.long),
                         extras={"oprl_step_rewards": torch.tensor([[0.3, 0.3, -0.05], [0.1, -0.2, 0.0]]),
                                 "oprl_segment": torch.tensor([[1, 1, 2], [1, 2, 0]])})
    A = compute_advantages("oprl", inp).advantages
    assert torch.allclose(A, torch.tensor([[1.93603, 1.93603, 0.29746], [-0.41451, -1.81899, -0.70711]]), atol=1e-4)
    assert torch.allclose(compute_advantages("oprl", inp, step_weight=0.0).advantages,
                          compute_advantages("grpo", inp).advantages, atol=1e-6)  # weight 0: GRPO
    same = AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 3),
                          group_index=torch.zeros(2, dtype=torch.long), extras=inp.extras)
    z = torch.tensor([[1.22893, 1.22893, -0.40964], [0.29260, -1.11189, 0.0]])
    assert torch.allclose(compute_advantages("oprl", same).advantages, z, atol=1e-4)  # equal outcomes: step credit only
    with pytest.raises(ValueError, match="oprl_step_rewards"):
        compute_advantages("oprl", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def _run(compose, tmp_path, *extra):
    from conftest import tiny_overrides
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("algo=oprl", "algo.n_samples_per_prompt=4", "steps=1", "eval.at_end=false", *extra))
    return Run(cfg, tmp_path / "run")


def test_prm_update_lowers_the_dpo_loss_exactly_chunked_and_round_trips(compose, tmp_path):
    run = _run(compose, tmp_path, "algo.adv_params.prm_lr=1e-3", "algo.adv_params.segment=sentence")
    try:
        c = run.collect(1, run.trainer.version, 0)
        b = c.batch
        b.rewards = torch.tensor([1.0, 0.0] * (len(b) // 2))  # every group has preferences
        m = run.methods.get("oprl")
        services = run.services
        first = m.prepare(b, services)
        second = m.prepare(b, services)
        assert first["adv/oprl_pairs"] == 4.0 * (len(b) // 4) and second["adv/oprl_dpo_loss"] < first["adv/oprl_dpo_loss"]
        assert first["adv/oprl_dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)  # the PRM starts as the policy
        assert b.extras["oprl_step_rewards"].abs().sum() > 0
        # the chunked DPO gradient (micro-batches of 1 row) equals the one-shot gradient
        fwd = services.forward_pass()
        grads = []
        for rows in (1, len(b)):
            for q in m.prm.parameters():
                q.grad = None
            g = torch.linspace(-1, 1, len(b))
            m._seq_logprobs(fwd, m.prm, b, rows, grad_of=g)
            grads.append(torch.cat([q.grad.flatten() for q in m.prm.parameters() if q.grad is not None]))
        # fp32 sums in another order (row chunks, one or two threads): ~1e-7 relative; a chunk-dependent
        # scale or a dropped chunk moves it by 1e-1 and more
        assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-5
        sd = m.state_dict()
        w = next(iter(sd["prm"].values())).clone()
        m2 = type(m)(run.cfg)
        m2.load_state_dict(sd)  # before setup: kept until the PRM exists
        m2.setup(services)
        assert torch.equal(next(iter(m2.prm.state_dict().values())).cpu(), w)
    finally:
        run.close()


def test_oprl_bad_inputs(compose):
    from types import SimpleNamespace

    from conftest import tiny_overrides
    from rlpost.methods.base import MethodSet

    for bad, key in (("algo.adv_params.beta=0", "beta"), ("algo.adv_params.segment=paragraph", "segment"),
                     ("algo.adv_params.prm_updates=-1", "prm_updates"), ("+algo.adv_params.bta=1", "bta")):
        with pytest.raises(ConfigError, match=key):
            MethodSet.for_config(compose(tiny_overrides("algo=oprl", bad)))
    ms = MethodSet.for_config(compose(tiny_overrides("algo=oprl", "algo.adv_params.segment=step_k")))
    from test_method_grpo_vps import CharTok, batch_of

    b = batch_of(["Q", "Q"], ["no marker", "none"], ["1", "2"], R=12)
    ms.methods[0].prm = torch.nn.Linear(1, 1)  # never reached: the segmentation check comes first
    with pytest.raises(ConfigError, match="found no steps.*segment=newline"):
        ms.prepare(b, SimpleNamespace(tokenizer=CharTok(), step=1))


def test_oprl_trains_on_tiny(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo=oprl", "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0",
                          "steps=1"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert r["adv/oprl_steps_per_row"] >= 1 and "adv/oprl_dpo_loss" in r
