"""The four loss aggregations and their mini-batch denominators, against numbers worked out by hand.

The loss matrix holds non-zero values on padding positions on purpose (a KL or entropy term is
not zero there), and one row is all padding (a distributed engine's filler row), so a mode that
lets padding into its numerator or its count gives a different number.
"""

from __future__ import annotations

import pytest
import torch

from rlpost.algos.aggregation import agg_count, aggregate

#: 3 rows x 4 positions; row 0 has 3 response tokens, row 1 has 1, row 2 none (padding row)
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0],
                     [4.0, 50.0, 60.0, 70.0],
                     [7.0, 8.0, 9.0, 10.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 0.0, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0]])


def test_token_mean_counts_only_response_tokens():
    # (1 + 2 + 3 + 4) / 4 tokens
    assert float(aggregate("token-mean", LOSS, MASK)) == pytest.approx(2.5)
    assert agg_count("token-mean", MASK) == 4.0
    # the mini-batch denominator replaces the micro-batch's own count
    assert float(aggregate("token-mean", LOSS, MASK, denom=8.0)) == pytest.approx(10.0 / 8.0)


def test_seq_modes_count_only_rows_with_a_response_token():
    assert agg_count("seq-mean-token-mean", MASK) == 2.0
    assert agg_count("seq-mean-token-sum", MASK) == 2.0
    assert agg_count("seq-mean-token-sum-norm", MASK) == 2.0
    # per-row means 2 and 4, mean over the 2 non-empty rows
    assert float(aggregate("seq-mean-token-mean", LOSS, MASK)) == pytest.approx(3.0)
    # per-row sums 6 and 4
    assert float(aggregate("seq-mean-token-sum", LOSS, MASK)) == pytest.approx(5.0)


def test_seq_mean_token_sum_norm_divides_by_the_given_constant_not_the_width():
    # Dr. GRPO: per-row sums 6 and 4 divided by the constant 10 (max_new_tokens), mean over 2 rows
    assert float(aggregate("seq-mean-token-sum-norm", LOSS, MASK, norm_const=10.0)) == pytest.approx(0.5)
    # without a constant: the padded width R = 4
    assert float(aggregate("seq-mean-token-sum-norm", LOSS, MASK)) == pytest.approx(1.25)
    # a wider padding of the same rows leaves the value unchanged when the constant is given
    wide_loss = torch.nn.functional.pad(LOSS, (0, 3), value=5.0)
    wide_mask = torch.nn.functional.pad(MASK, (0, 3))
    assert float(aggregate("seq-mean-token-sum-norm", wide_loss, wide_mask, norm_const=10.0)) == pytest.approx(0.5)


def test_micro_batch_shares_add_up_to_the_mini_batch_loss():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        whole = aggregate(mode, LOSS, MASK, norm_const=10.0)
        d = agg_count(mode, MASK)
        parts = sum(aggregate(mode, LOSS[i: i + 1], MASK[i: i + 1], denom=d, norm_const=10.0) for i in range(3))
        assert float(parts) == pytest.approx(float(whole)), mode
