"""ReRULE (Replay What Matters: Off-Policy Replay for Efficient LLM Reinforcement Unlearning, arXiv:2606.15333):
``selector=rerule`` buffers low-reward hard-case groups of the early steps and appends them to later batches;
``precision.correction=tis`` weights replayed tokens by ``min(pi_old / pi_behaviour, cap)``.

Every number below is worked out by hand from the rule in :class:`rlpost.selectors.replay.ReruleSelector`.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.corrections import compute_correction
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import GenerationResult
from rlpost.run.collect import StepRollouts
from rlpost.samplers.base import SampleResult
from rlpost.selectors import SELECTORS, build_selector

PARAMS = dict(reward_threshold=0.5, buffer_size=8, replay_start=3, replay_ratio=0.25, max_replays=0)


def _step(groups, prompts, lp=-0.5, resp_len=3):
    """A scored step: ``groups[j]`` the rewards of prompt ``prompts[j]``; every token's behaviour log-prob ``lp``
    (a float, or one per group); response token ids encode (prompt, row) so replayed rows can be traced."""
    rows = [(j, r) for j, g in enumerate(groups) for r in g]
    B = len(rows)
    lps = lp if isinstance(lp, (list, tuple)) else [lp] * len(groups)
    resp = torch.tensor([[prompts[j] * 10 + i] * resp_len for i, (j, _) in enumerate(rows)])
    gen = GenerationResult(
        prompt_ids=torch.tensor([[prompts[j], 7] for j, _ in rows]), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=resp, response_mask=torch.ones(B, resp_len),
        rollout_logprobs=torch.tensor([[lps[j]] * resp_len for j, _ in rows]), temperatures=torch.ones(B, resp_len),
        finished=torch.ones(B, dtype=torch.bool), texts=[f"p{prompts[j]}r{i}" for i, (j, _) in enumerate(rows)],
    )
    rw = torch.tensor([r for _, r in rows], dtype=torch.float32)
    res = SampleResult(generation=gen, group_index=torch.tensor([j for j, _ in rows]), rollouts_spent=B,
                       extras={"reward_correct": rw.clone(), "token_values": resp.float()}, rewards=rw)
    return StepRollouts(res, list(prompts), rw)


def _sel(**kw):
    return SELECTORS.get("rerule")(20, 4, seed=0, **{**PARAMS, **kw})


def test_only_low_reward_groups_with_mixed_rewards_are_buffered():
    sel = _sel()
    # means 0.25 (hard), 0.75, 0.0 (all equal: GRPO advantage 0), 0.5 (not below the threshold)
    out = sel.postprocess(_step([[0, 0, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1]], [3, 4, 5, 6]), step=1)
    assert [e["prompt"] for e in sel.buffer] == [3]
    e = sel.buffer[0]
    assert e["rewards"] == [0, 0, 1, 0] and e["step"] == 1 and e["mean"] == 0.25 and e["uses"] == 0
    assert e["gen"].response_ids[:, 0].tolist() == [30, 31, 32, 33]  # the group's own rows
    assert sel.metrics()["selector/stored_groups"] == 1.0
    # the collection stage leaves the batch as it was
    assert out.result.group_index.shape[0] == 16 and out.result.extras["replay_age"].tolist() == [0.0] * 16


def test_buffer_keeps_the_hardest_one_entry_per_prompt():
    sel = _sel(reward_threshold=0.8, buffer_size=2)
    sel.postprocess(_step([[0, 1, 1, 1], [0, 1, 0, 1]], [1, 2]), step=1)  # means 0.75, 0.5
    sel.postprocess(_step([[0, 0, 0, 1]], [3]), step=2)  # 0.25: the 0.75 entry is evicted
    assert [(e["prompt"], e["mean"]) for e in sel.buffer] == [(3, 0.25), (2, 0.5)]
    sel.postprocess(_step([[1, 0, 1, 1]], [2]), step=2)  # prompt 2 again (0.75): replaces its 0.5 entry
    assert [(e["prompt"], e["mean"], e["step"]) for e in sel.buffer] == [(3, 0.25, 2), (2, 0.75, 2)]
    sel.postprocess(_step([[0, 1, 1, 0]], [4]), step=2)  # 0.5 evicts the 0.75 entry
    assert [(e["prompt"], e["mean"]) for e in sel.buffer] == [(3, 0.25), (4, 0.5)]


def test_replay_starts_at_replay_start_appends_ceil_ratio_groups_and_stores_no_more():
    sel = _sel(replay_ratio=0.3)
    sel.postprocess(_step([[0, 0, 1, 0], [1, 1, 1, 1]], [3, 4], lp=-0.7), step=1)
    sel.postprocess(_step([[0, 1, 0, 0]], [5], lp=-0.9), step=2)
    assert [e["prompt"] for e in sel.buffer] == [5, 3]  # equal means: the newer first
    # step 3 = replay_start: 4 fresh groups -> ceil(0.3 * 4) = 2 replayed groups; the hard fresh group
    # of prompt 9 is not stored any more
    out = sel.postprocess(_step([[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0], [0, 0, 1, 0]], [6, 7, 8, 9], resp_len=2),
                          step=3)
    assert sel.replayed == 2 and [e["prompt"] for e in sel.buffer] == [5, 3]
    res = out.result
    assert res.group_index.shape[0] == 16 + 8 and out.prompt_indices == [6, 7, 8, 9, 3, 5]
    # lowest mean first, then the oldest: prompt 3 (step 1) before prompt 5 (step 2)
    assert res.group_index[16:].tolist() == [4] * 4 + [5] * 4
    assert out.row_prompt_index[16:].tolist() == [3] * 4 + [5] * 4
    assert res.rewards[16:].tolist() == [0, 0, 1, 0, 0, 1, 0, 0] and out.rewards is res.rewards
    assert res.generation.response_ids[16:, 0].tolist() == [30, 31, 32, 33, 50, 51, 52, 53]
    assert res.generation.rollout_logprobs[16:, 0].tolist() == pytest.approx([-0.7] * 4 + [-0.9] * 4)
    assert res.extras["replay_age"].tolist() == [0.0] * 16 + [2.0] * 4 + [1.0] * 4
    assert res.extras["reward_correct"][16:].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]
    assert res.rollouts_spent == 16  # no rollouts spent on replay
    # a [B, R] extra travels with its rows; the fresh rows' (2 tokens wide) are right-padded with 0
    tv = res.extras["token_values"]
    assert tv.shape == (24, 3) and tv[16:, 0].tolist() == [30, 31, 32, 33, 50, 51, 52, 53]
    assert tv[:16, 2].tolist() == [0.0] * 16 and res.generation.response_mask[:16, 2].tolist() == [0.0] * 16


def test_before_replay_start_nothing_is_replayed_and_ratio_zero_never_replays():
    sel = _sel(replay_start=5)
    sel.postprocess(_step([[0, 0, 1, 0]], [3]), step=1)
    out = sel.postprocess(_step([[1, 1, 1, 0]], [4]), step=4)
    assert sel.replayed == 0 and out.prompt_indices == [4]
    sel = _sel(replay_ratio=0.0)
    sel.postprocess(_step([[0, 0, 1, 0]], [3]), step=1)
    out = sel.postprocess(_step([[1, 1, 1, 0]], [4]), step=3)
    assert sel.replayed == 0 and out.result.extras["replay_age"].tolist() == [0.0] * 4


def test_replay_order_spreads_uses_skips_prompts_in_the_batch_and_caps_replays():
    sel = _sel(reward_threshold=0.8, max_replays=2)
    sel.postprocess(_step([[0, 0, 0, 1], [0, 1, 0, 1], [1, 1, 0, 1]], [1, 2, 3]), step=1)  # means .25 .5 .75
    picks = []
    for s in range(3, 10):
        out = sel.postprocess(_step([[1, 1, 1, 0]], [2 if s == 4 else 9]), step=s)  # 1 group -> ceil(.25) = 1
        picks.append(out.prompt_indices[1:])
    # fewest uses first, then lowest mean; at step 4 prompt 2 is in the batch (prompt 3 is taken);
    # each entry at most twice, then nothing is left
    assert picks == [[1], [3], [2], [1], [2], [3], []]
    assert [e["uses"] for e in sorted(sel.buffer, key=lambda e: e["prompt"])] == [2, 2, 2]


def test_tis_weight_of_replayed_tokens_by_hand():
    # replayed row: old - behaviour = [log 3, log 0.5, -0.1]: weights min(3, 2) = 2, 0.5, exp(-0.1);
    # a fresh row (old = behaviour) weighs 1
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, -0.3]])
    beh = torch.tensor([[-1.0 - math.log(3.0), -2.0 - math.log(0.5), -0.4], [-0.3, -0.3, -0.3]])
    w, m = compute_correction("tis", old, beh, torch.ones(2, 3), cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5, math.exp(-0.1), 1.0, 1.0, 1.0], rel=1e-6)
    assert float(m["frac_modified"]) == pytest.approx(1 / 6)  # only the capped token


def test_loss_of_a_fresh_and_a_replayed_row_by_hand():
    # row 0 fresh, A = +1, ratios [1, 1.5] -> PPO clip (0.2) gives [-1, -1.2]; weights 1
    # row 1 replayed, A = -0.5, ratios [0.5, 1] -> PPO gives [max(0.25, 0.4), 0.5] = [0.4, 0.5];
    #   old - behaviour = [log 3, log 0.5] -> weights [2 (capped), 0.5] -> [0.8, 0.25]
    # seq-mean-token-mean: ((-1 - 1.2) / 2 + (0.8 + 0.25) / 2) / 2 = (-1.1 + 0.525) / 2 = -0.2875
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    lp = old + torch.log(torch.tensor([[1.0, 1.5], [0.5, 1.0]]))
    beh = old - torch.log(torch.tensor([[1.0, 1.0], [3.0, 0.5]]))
    A = torch.tensor([[1.0, 1.0], [-0.5, -0.5]])
    mask = torch.ones(2, 2)
    inp = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=A, response_mask=mask, rollout_logprobs=beh)
    loss_mat, _ = compute_policy_loss("ppo_clip", inp)
    w, _ = compute_correction("tis", old, beh, mask, cap=2.0)
    assert (loss_mat * w).flatten().tolist() == pytest.approx([-1.0, -1.2, 0.8, 0.25], rel=1e-6)
    assert float(aggregate("seq-mean-token-mean", loss_mat * w, mask)) == pytest.approx(-0.2875, rel=1e-6)


def test_trainer_update_weights_replayed_rows_by_the_capped_ratio(compose):
    """One update of the tiny model with ``precision.correction=tis`` (the recipe's setting): rows 0-3 are
    replayed with behaviour log-probs ``old - d``; the logged policy loss is the hand value
    ``-mean_i A_i mean_t min(exp(d_it), 2)`` (ratio 1 on the first update, fresh rows' weight 1)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides, update_with_gradient
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("selector=rerule", "precision=fp32", "precision.correction=tis"))
    t = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], cfg, "cpu")
    b = make_batch(B=8)
    lp, _ = t.compute_logprobs(b)
    m = b.response_mask
    d = torch.zeros_like(lp)
    d[:4] = torch.tensor([1.0, 0.2, -0.5, 0.9, 0.0, -1.0])[: lp.shape[1]]  # exp: 2.72 (capped), 1.22, 0.61, ...
    b.rollout_logprobs = (lp - d) * m
    b.extras["replay_age"] = torch.tensor([3.0] * 4 + [0.0] * 4)
    A = b.extras["advantages"][:, 0]
    w = torch.exp(d).clamp(max=2.0)
    want = -sum(float(A[i]) * float((w[i] * m[i]).sum() / m[i].sum()) for i in range(8)) / 8
    metrics, _ = update_with_gradient(t, b)
    assert metrics["loss/policy"] == pytest.approx(want, rel=1e-4)


def test_replayed_rows_gradient_does_not_depend_on_micro_batch_size(compose):
    """The recipe's update (GRPO loss, TIS on replayed rows) gives one gradient with micro-batches of 1 and 8 rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides, update_with_gradient
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    model = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    grads = []
    for mb in (1, 8):
        cfg = compose(tiny_overrides("+recipe=rerule", "model=tiny", "precision=fp32", f"trainer.micro_batch_size={mb}"))
        assert cfg.selector.name == "rerule" and cfg.precision.correction == "tis"
        import copy

        t = TorchTrainer.from_config(copy.deepcopy(model), cfg, "cpu")
        b = make_batch(B=8)
        lp, _ = t.compute_logprobs(b)
        g = torch.Generator().manual_seed(1)
        b.rollout_logprobs = (lp + 0.5 * torch.randn(lp.shape, generator=g)) * b.response_mask
        b.extras["replay_age"] = torch.tensor([2.0] * 4 + [0.0] * 4)
        grads.append(update_with_gradient(t, b)[1])
    assert grads[1].norm() > 0
    # the same criterion as tests/test_preset_microbatch_invariance.py: fp32 summation order alone gives ~2e-6
    rel = float((grads[0] - grads[1]).norm() / grads[1].norm())
    assert rel < 1e-4, f"micro_batch_size 1 vs 8 gradients differ by {rel:.2e} relative"


def test_bad_params_are_errors():
    from types import SimpleNamespace

    for bad, msg in [({"buffer_size": 0}, "buffer_size"), ({"replay_start": 0}, "replay_start"),
                     ({"replay_ratio": -0.1}, "replay_ratio"), ({"max_replays": -1}, "max_replays"),
                     ({"replay_ration": 0.5}, "replay_ration")]:
        with pytest.raises(ConfigError, match=msg):
            build_selector(SimpleNamespace(name="rerule", params=bad, prompts_per_step=2), 8, 0)


def test_buffer_survives_state_dict_round_trip():
    sel = _sel()
    sel.postprocess(_step([[0, 0, 1, 0]], [3]), step=1)
    sel.choose(1, set())
    other = _sel()
    other.load_state_dict(sel.state_dict())
    assert [(e["prompt"], e["uses"], e["rewards"]) for e in other.buffer] == [(3, 1, [0, 0, 1, 0])]


def test_driver_run_buffers_early_and_appends_replayed_rows_to_the_batch():
    """Through the rollout driver (a fake engine answering prompt k right with probability p[k]): the replayed
    rows reach the learner's batch with their prompt, stored rewards, behaviour log-probs and age."""
    from fake_engine import FakeEngine, scorer

    from rlpost.rollout.base import SamplingParams
    from rlpost.run.collect import collect_rollouts
    from rlpost.samplers import SAMPLERS

    eng = FakeEngine({i + 100: (0.3 if i < 4 else 1.0) for i in range(8)})
    sel = SELECTORS.get("rerule")(8, 4, seed=0, **{**PARAMS, "replay_start": 3, "replay_ratio": 0.5})
    sam = SAMPLERS.get("group")(6)
    replayed = 0
    for step in range(1, 6):
        out = collect_rollouts(sel, sam, eng, SamplingParams(max_new_tokens=6, seed=3), step=step,
                               encode=lambda i: [i + 100, 7], score=scorer())
        B = out.result.group_index.shape[0]
        batch = out.to_batch(["1"] * B, 0, step - 1)
        age = batch.extras["replay_age"]
        assert out.metrics["rollout/spent"] == 24 and age.shape[0] == B == len(batch.rewards)
        if step < 3:
            assert B == 24 and float(age.sum()) == 0.0
        else:
            replayed += sel.replayed
            assert B == 24 + 6 * sel.replayed and bool((age[24:] >= 1).all()) and float(age[:24].sum()) == 0.0
        # every row answers the prompt it is labelled with
        assert [int(x) - 100 for x in batch.prompt_ids[:, -2]] == batch.prompt_index.tolist()
        out.update_selector(sel)
    assert replayed > 0 and all(e["step"] < 3 for e in sel.buffer)
