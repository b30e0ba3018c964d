"""CSCR, counterfactual sensitivity credit reallocation: by hand, its privileged batch, and the runner's
plumbing. Moved unchanged from tests/test_methods_r2vpo_xrpo_rapid_cscr.py.
"""

import json

import pytest
import torch


from conftest import train_rows  # noqa: E402  (tests/conftest.py)


# --- CSCR, counterfactual sensitivity credit reallocation --------------------------------------

def test_cscr_reallocates_credit_but_keeps_each_responses_total_and_sign_by_hand():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    # rewards (1, 0): A = +-0.5 / sqrt(0.5) = +-0.7071. Row 0 shifts (|d+|, |d-|) per token: (0.2, 0.2),
    # (0.0, 0.0), (0.4, 0.0) -> s = (0.2, 0, 0.2), mean 0.4 / 3; beta = 0.5: s / mean = (1.5, 0, 1.5)
    # u before renorm = (1 / 1.75, 1, 1 / 1.75) sum 2.142857 -> x 3 / 2.142857 = (0.8, 1.4, 0.8)
    shifts = torch.tensor([[[0.2, -0.2], [0.0, 0.0], [0.4, 0.0]], [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3),
                         group_index=torch.zeros(2, dtype=torch.long), privileged_shifts=shifts)
    A = compute_advantages("cscr", inp).advantages
    z = 0.5 / 0.5 ** 0.5
    assert torch.allclose(A[0], torch.tensor([0.8, 1.4, 0.8]) * z, atol=1e-5)
    assert torch.allclose(A[1], torch.full((3,), -z), atol=1e-5)  # no sensitivity: GRPO's credit
    assert float(A[0].sum()) == pytest.approx(3 * z, abs=1e-5)  # the credit budget is kept
    g = compute_advantages("cscr", inp, downweight_strength=0.0).advantages
    assert torch.allclose(g, torch.tensor([[z] * 3, [-z] * 3]), atol=1e-5)  # strength 0: GRPO
    with pytest.raises(ValueError, match="privileged_shifts"):
        compute_advantages("cscr", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def test_cscr_privileged_batch_prepends_the_context_before_the_real_prompt():
    from rlpost.algos.cscr import privileged_batch
    from rlpost.core.batch import RolloutBatch

    b = RolloutBatch(prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                     response_ids=torch.tensor([[1, 2], [3, 4]]), response_mask=torch.ones(2, 2),
                     rollout_logprobs=torch.zeros(2, 2), group_index=torch.zeros(2, dtype=torch.long),
                     prompt_index=torch.zeros(2, dtype=torch.long))
    p = privileged_batch(b, torch.tensor([42, 43]))
    assert p.prompt_ids[0, -4:].tolist() == [42, 43, 5, 6] and p.prompt_mask[0].tolist() == [0, 1, 1, 1, 1]
    assert p.prompt_ids[1].tolist() == [42, 43, 7, 8, 9] and torch.equal(p.response_ids, b.response_ids)


def test_cscr_runner_supplies_the_privileged_shifts(tmp_path):
    r = train_rows(tmp_path, ["algo.adv_estimator=cscr", "steps=1"])[0]
    assert r["adv/privileged_shift_abs_mean"] > 0  # a context sentence moves a random model's log-probs
