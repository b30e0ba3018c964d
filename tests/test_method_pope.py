"""POPE (selector): which prompts get an oracle prefix, how long it is, and that only the sampled
suffix is a response token (carries loss). Moved unchanged from tests/test_methods_pope_hdl_seed_ripo.py.
"""

from __future__ import annotations

import pytest

from fake_engine import CharTok, FakeEngine, scorer

from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS

from rlpost.run.collect import collect_rollouts

from rlpost.selectors import SELECTORS
from rlpost.selectors.mixture import make_hint_fn


PARAMS = SamplingParams(max_new_tokens=6, seed=3)


# ------------------------------------------------------------------------------------------ POPE
def test_pope_state_machine_prefix_share_and_alternation():
    sel = SELECTORS.get("pope")(4, 2, seed=0, prefix_frac=0.25, prefix_step=0.25, max_prefix=0.6)
    assert sel.hint_fractions([0, 1]) == [0.0, 0.0]  # never seen: unguided first
    sel.update([0, 1], [[0.0] * 4, [0.0, 1.0, 0.0, 0.0]])  # prompt 0 solved 0/4 -> hard; prompt 1 solved once
    assert sel.is_hard(0) and not sel.is_hard(1)
    assert sel.hint_fractions([0, 1]) == [0.25, 0.0]  # only the hard prompt is guided
    assert sel.metrics()["selector/guided_frac"] == 0.5 and sel.metrics()["selector/prefix_mean"] == 0.25
    sel.update([0, 1], [[0.0] * 4, [0.0] * 4])  # guided visit solved nothing: the prefix grows; 1 turns hard
    assert sel.prefix[0] == 0.5 and sel.is_hard(1)
    assert sel.hint_fractions([0, 1]) == [0.0, 0.25]  # 0 alternates back to unguided, 1 gets its first prefix
    sel.update([0, 1], [[0.0] * 4, [1.0] * 4])  # 0 still hard unguided; 1 solved under guidance: its prefix stays
    assert sel.is_hard(0) and sel.prefix.get(1, 0.25) == 0.25
    assert sel.hint_fractions([0]) == [0.5]
    sel.update([0], [[0.0] * 4])  # guided at 0.5, still nothing: 0.5 + 0.25 capped at max_prefix 0.6
    assert sel.prefix[0] == 0.6
    assert sel.hint_fractions([0]) == [0.0]
    sel.update([0], [[1.0, 0, 0, 0]])  # solved without guidance: no longer hard, never guided again
    assert not sel.is_hard(0) and sel.hint_fractions([0]) == [0.0] and sel.hint_fractions([0]) == [0.0]
    # checkpoint round trip: a hard prompt whose last visit was unguided resumes with a guided one
    sel.update([3], [[0.0] * 4])
    s2 = SELECTORS.get("pope")(4, 2, seed=0)
    s2.load_state_dict(sel.state_dict())
    assert s2.prefix == {0: 0.6} and s2.is_hard(3) and s2.hint_fractions([3]) == [0.25]


@pytest.mark.parametrize("bad", [dict(prefix_frac=0.0), dict(prefix_frac=0.8, max_prefix=0.5), dict(prefix_step=-0.1)])
def test_pope_rejects_bad_parameters(bad):
    with pytest.raises(ValueError, match="pope"):
        SELECTORS.get("pope")(4, 2, seed=0, **bad)


def test_pope_guided_rows_condition_on_the_oracle_prefix_and_carry_loss_only_on_the_sampled_suffix():
    # the engine never answers "1..." by itself; the oracle solution "1abcdefgh" (9 chars) starts with the answer
    eng = FakeEngine({100: 0.0, 101: 0.0}, resp_len=6)
    enc, score = (lambda i: [i + 100, 7]), scorer()
    tok = CharTok()
    hint = make_hint_fn([None, None], tok, solution=lambda e: "1abcdefgh")
    sel = SELECTORS.get("pope")(2, 2, seed=0, prefix_frac=0.25)
    out = collect_rollouts(sel, SAMPLERS.get("group")(3), eng, PARAMS, step=0, encode=enc, score=score, hint=hint)
    assert out.rewards.tolist() == [0.0] * 6 and all(len(p) == 2 for p in eng.calls[0])  # unguided first
    out.update_selector(sel)
    out = collect_rollouts(sel, SAMPLERS.get("group")(3), eng, PARAMS, step=1, encode=enc, score=score, hint=hint)
    g = out.result.generation
    # prefix length: round(0.25 * 9) = 2 characters "1a" -> token ids [3, 4], appended to the prompt
    assert all(p[2:] == [3, 4] and len(p) == 4 for p in eng.calls[-1])
    for b in range(g.response_ids.shape[0]):
        prompt = g.prompt_ids[b][g.prompt_mask[b] > 0].tolist()
        resp = g.response_ids[b][g.response_mask[b] > 0].tolist()
        assert prompt[-2:] == [3, 4]  # the oracle prefix is context ...
        assert int(g.response_mask[b].sum()) == len(resp) == 6  # ... and the loss mask covers only the 6 sampled tokens
        assert g.texts[b] == "1a" + tok.decode(resp)  # scored as prefix + completion
    assert out.rewards.tolist() == [1.0] * 6  # guided rollouts earn reward the unguided ones never did
    assert sel.metrics()["selector/guided_frac"] == 1.0 and sel.metrics()["selector/prefix_mean"] == 0.25
