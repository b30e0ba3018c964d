"""OSW-FT (arXiv:2609.00734): SFT on the expert trajectory weighted by 1 - the probes' success rate.

Hand-computed weights (Eq. 9 and the hard-thresholded ablation), the weighted loss and its gradient
against plain SFT, the expert trajectory text, the method's swap of the probe rollouts, the preset's
checks, and one step on the tiny model through the runner.
"""

from types import SimpleNamespace

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError


def test_weights_by_hand():
    from rlpost.algos.osw_ft import success_weights

    # K = 2 probes per query: (1, 1) -> p_hat 1, w 0 (signal lost); (1, 0) -> 0.5, 0.5; (0, 0) -> 0, 1
    c = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    w, p = success_weights(c, g)
    assert p.tolist() == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0] and w.tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    w_hard, _ = success_weights(c, g, "hard")  # Table 3's control: 0 only when every probe succeeds
    assert w_hard.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        success_weights(torch.tensor([1.2, 0.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="linear, hard"):
        success_weights(c, g, "soft")


def test_estimator_reads_the_correctness_component():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    # totals include a format bonus (1.1); the correctness component is what counts: p_hat 0.5 and 0.5
    inp = AdvantageInput(rewards=torch.tensor([1.1, 0.1, 1.1, 0.1]), response_mask=mask,
                         group_index=torch.tensor([0, 0, 1, 1]),
                         extras={"reward_correct": torch.tensor([1.0, 0.0, 0.0, 0.0])})
    out = compute_advantages("osw_ft", inp)
    assert torch.equal(out.advantages, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_loss_is_weighted_sft_by_hand():
    from rlpost.algos.aggregation import aggregate
    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss

    lp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([[0.5, 0.5], [1.0, 1.0]]) * mask
    loss, met = compute_policy_loss("osw_ft", PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=w,
                                                              response_mask=mask))
    total = aggregate("token-mean", loss, mask)
    # token-mean of w * NLL: (0.5 ln2 + 0.5 ln4 + 1 ln2) / 3 = 2.5 ln2 / 3 = 0.577623
    assert float(total.detach()) == pytest.approx(2.5 * 0.693147 / 3, abs=1e-5)
    assert float(met["nll"]) == pytest.approx((0.693147 + 1.386294 + 0.693147) / 3, abs=1e-5)
    assert float(met["weight_mean"]) == pytest.approx(2.0 / 3, abs=1e-6)
    total.backward()  # d/d lp = -w / 3 on the mask: the SFT gradient scaled per query, no weight gradient
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 3, 0.0], abs=1e-6)


def test_expert_trajectory_text():
    from rlpost.algos.osw_ft import expert_trajectory
    from rlpost.tasks.answer_tags import extract_answer

    ex = lambda fmt: (lambda t: extract_answer(t, fmt))  # noqa: E731
    assert expert_trajectory("27 + 45 = 72", 72, "last_number", ex("last_number")) == "27 + 45 = 72"
    assert expert_trajectory("Add 3 and 4 to get 7.", 7, "boxed", ex("boxed")) == "Add 3 and 4 to get 7.\n\\boxed{7}"
    assert expert_trajectory("", 7, "tags", ex("tags")) == "<answer>7</answer>"
    assert expert_trajectory("7", 7, "boxed", ex("boxed")) == "\\boxed{7}"


def test_method_swaps_the_probes_for_the_expert_trajectory(compose):
    from conftest import tiny_overrides
    from rlpost.methods.base import MethodSet
    from rlpost.models.loader import load_tokenizer
    from rlpost.tasks.base import Example

    cfg = compose(tiny_overrides("algo=osw_ft"))
    ms = MethodSet.for_config(cfg)
    assert [m.name for m in ms.methods] == ["osw_ft"]
    assert compose(["model=tiny", "algo=osw_ft"]).algo.n_samples_per_prompt == 2  # K = 2 probes (the paper's)
    tok = load_tokenizer(cfg.model)
    ex = [Example(index=0, question="Calculate 1 + 2.", answer=3, meta={"solution": "1 + 2 = 3"}),
          Example(index=1, question="Calculate 2 + 2.", answer=4, meta={})]
    task = SimpleNamespace(reference_solution=lambda e: e.meta.get("solution") or str(e.answer),
                           extract_answer=lambda t: t.split()[-1] if t.strip() else None)
    from rlpost.core.batch import RolloutBatch

    b = RolloutBatch(prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.long),
                     response_ids=torch.ones(4, 5, dtype=torch.long), response_mask=torch.ones(4, 5),
                     rollout_logprobs=-torch.ones(4, 5), group_index=torch.tensor([0, 0, 1, 1]),
                     prompt_index=torch.tensor([0, 0, 1, 1]), rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
                     response_texts=["a", "b", "c", "d"], answers=[3, 3, 4, 4],
                     extras={"reward_correct": torch.tensor([1.0, 0.0, 1.0, 1.0]), "entropy": torch.ones(4, 5)})
    met = ms.prepare(b, SimpleNamespace(task=task, examples=ex, tokenizer=tok, step=1))
    assert b.response_texts == ["1 + 2 = 3", "1 + 2 = 3", "4", "4"]
    assert "entropy" not in b.extras and torch.equal(b.rewards, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert torch.equal(b.rollout_logprobs, torch.zeros_like(b.response_mask))
    assert met["osw/p_hat_mean"] == pytest.approx(0.75) and met["osw/signal_lost_frac"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="adv_estimator=osw_ft"):
        MethodSet.for_config(compose(tiny_overrides("algo=osw_ft", "algo.adv_estimator=grpo")))
    with pytest.raises(ConfigError, match="wieght"):
        from rlpost.config.compose import validate_config

        validate_config(compose(tiny_overrides("algo=osw_ft", "+algo.adv_params.wieght=hard")))


def test_osw_ft_trains_on_tiny(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo=osw_ft", "eval.at_end=false", "checkpoint.every=0", "steps=1"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    # the tiny random model solves nothing: every probe fails, every weight is 1 (plain SFT)
    assert r["osw/p_hat_mean"] == 0.0 and r["osw/weight_mean"] == 1.0 and r["osw/expert_length_mean"] > 0
