"""Token-budget micro-batching (``trainer.max_tokens_per_micro_batch``): the packing, and the same
gradient, logged loss and log-probs as sequence micro-batching for every aggregation mode."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_overrides, update_with_gradient

from rlpost.algos.registries import LOSS_AGGS
from rlpost.core.batch import RolloutBatch
from rlpost.trainer.torch_engine import padded_tokens, row_lengths, token_budget_micro_batches, trim_batch

_CACHE: dict = {}


def test_first_fit_decreasing_packing_by_hand():
    # rows (prompt, response): 0:(2,10) 1:(2,1) 2:(3,2) 3:(2,9) 4:(1,1); budget 24
    # order by total desc: 0 (12), 3 (11), 2 (5), 1 (3), 4 (2)
    # 0 -> bin A [1 x (2+10)=12]; 3 -> A: 2 x (2+10)=24 fits; 2 -> A: 3 x (3+10)=39 no -> bin B [1 x 5];
    # 1 -> A: 3 x 12 = 36 no, B: 2 x (3+2) = 10 fits; 4 -> A no, B: 3 x 5 = 15 fits
    assert token_budget_micro_batches([2, 2, 3, 2, 1], [10, 1, 2, 9, 1], 24) == [[0, 3], [1, 2, 4]]
    # a row longer than the budget gets a micro-batch of its own; every row appears once
    assert token_budget_micro_batches([4, 1], [30, 1], 10) == [[0], [1]]
    with pytest.raises(ValueError, match="budget"):
        token_budget_micro_batches([1], [1], 0)


def long_tailed_batch(B: int = 8, P: int = 6, R: int = 20, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts of 2..6 tokens, responses of 1..20 tokens (one long tail), random advantages."""
    g = torch.Generator().manual_seed(seed)
    plen = [2, 6, 3, 4, 2, 5, 3, 6][:B]
    rlen = [1, 3, 20, 2, 0, 4, 12, 2][:B]  # row 4: an empty response (in no denominator)
    pm = torch.zeros(B, P, dtype=torch.long)
    rm = torch.zeros(B, R)
    for i in range(B):
        pm[i, P - plen[i]:] = 1
        rm[i, : rlen[i]] = 1
    return RolloutBatch(
        prompt_ids=torch.randint(10, 1000, (B, P), generator=g) * pm, prompt_mask=pm,
        response_ids=torch.randint(10, 1000, (B, R), generator=g), response_mask=rm,
        rollout_logprobs=-torch.rand(B, R, generator=g) * rm, group_index=torch.arange(B) // 4,
        prompt_index=torch.arange(B) // 4, policy_version=torch.zeros(B, dtype=torch.long),
        extras={"advantages": torch.randn(B, 1, generator=g).expand(B, R) * rm},
    )


def test_trim_and_padding_counts_by_hand():
    b = long_tailed_batch()
    assert row_lengths(b) == ([2, 6, 3, 4, 2, 5, 3, 6], [1, 3, 20, 2, 0, 4, 12, 2])
    sub = trim_batch(b.select([0, 3]))  # prompts 2 and 4 tokens, responses 1 and 2
    assert sub.prompt_ids.shape == (2, 4) and sub.response_ids.shape == (2, 2)
    assert sub.extras["advantages"].shape == (2, 2)
    assert padded_tokens(sub) == (2 + 4 + 1 + 2, 2 * (4 + 2))


def _trainer(compose, agg: str, loss: str = "ppo_clip", **tcfg):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    over = [f"trainer.{k}={v}" for k, v in tcfg.items()]
    cfg = compose(tiny_overrides(f"algo.loss={loss}", f"algo.loss_agg={agg}", "trainer.grad_clip=0", "algo.kl.coef=0",
                                 "algo.entropy_coef=0", "rollout.max_new_tokens=20", *over))
    if "model" not in _CACHE:
        _CACHE["model"] = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    return TorchTrainer.from_config(copy.deepcopy(_CACHE["model"]), cfg, "cpu")


def _update(compose, agg: str, loss: str = "ppo_clip", **tcfg):
    """One policy_update on the long-tailed batch; returns (metrics, flat gradient, log-probs)."""
    t = _trainer(compose, agg, loss, **tcfg)
    b = long_tailed_batch()
    lp, _ = t.compute_logprobs(b)
    g = torch.Generator().manual_seed(1)
    b.extras["old_logprobs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * b.response_mask
    b.rollout_logprobs = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * b.response_mask
    torch.manual_seed(0)
    m, g = update_with_gradient(t, b)
    return m, g, lp


@pytest.mark.parametrize("agg", LOSS_AGGS.names())
def test_token_budget_gives_the_gradient_of_sequence_micro_batches(compose, agg):
    m_seq, g_seq, lp_seq = _update(compose, agg, micro_batch_size=3)
    m_tok, g_tok, lp_tok = _update(compose, agg, max_tokens_per_micro_batch=40)
    assert g_seq.norm() > 0
    torch.testing.assert_close(lp_tok, lp_seq, rtol=1e-5, atol=1e-5)  # no-grad passes, rows back in order
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-4, atol=5e-5 * float(g_seq.abs().max()))  # fp32 noise of
    # batch-size-dependent matmul blocking (AVX-512): up to 1.6e-6 absolute on near-zero entries
    for k, v in m_seq.items():
        if k in ("actor/lr", "bench/padding_frac"):
            continue
        assert m_tok[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (k, m_tok[k], v)
    # sorting by length removes most of the padding the long tail forces on sequence micro-batches
    assert m_tok["bench/padding_frac"] < 0.5 * m_seq["bench/padding_frac"]


def test_token_budget_with_a_batch_statistics_loss(compose):
    """clip_cov's covariance is over the whole mini-batch: responses keep its width, prompts are cut."""
    m_seq, g_seq, _ = _update(compose, "token-mean", "clip_cov", micro_batch_size=3)
    m_tok, g_tok, _ = _update(compose, "token-mean", "clip_cov", max_tokens_per_micro_batch=60)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-4, atol=5e-5 * float(g_seq.abs().max()))  # fp32 noise of
    # batch-size-dependent matmul blocking (AVX-512): up to 1.6e-6 absolute on near-zero entries
    assert m_tok["loss/policy"] == pytest.approx(m_seq["loss/policy"], rel=1e-4, abs=1e-6)


def test_negative_budget_is_a_config_error(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch must be >= 0"):
        validate_config(compose(tiny_overrides("trainer.max_tokens_per_micro_batch=-1")))
