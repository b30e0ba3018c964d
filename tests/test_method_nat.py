"""NAT ("Not all tokens are needed (NAT): token efficient reinforcement learning", arXiv:2603.06619):
the Horvitz-Thompson weights drawn before the update's forward (the loss's ``token_draw`` tag), and the
update forward that computes only the drawn columns (``trainer.drawn_forward``): the same log-probs at
the drawn positions, the same loss and gradient, fewer forward columns."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import tiny_overrides, update_with_gradient

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss, nat_draw, nat_inclusion
from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError
from rlpost.trainer.torch_engine import drawn_widths

_CACHE: dict = {}


def grouped_batch(B: int = 8, P: int = 5, R: int = 10, n: int = 4, seed: int = 0) -> RolloutBatch:
    """Groups of ``n`` rows sharing a prompt (the shared-prefix forward), responses of 2..R tokens, one empty."""
    g = torch.Generator().manual_seed(seed)
    lens = [R, 3, 7, 2, 9, 0, 5, R - 1][:B]
    rm = torch.zeros(B, R)
    for i, L in enumerate(lens):
        rm[i, :L] = 1
    prompts = torch.randint(10, 1000, (B // n, P), generator=g).repeat_interleave(n, 0)
    return RolloutBatch(
        prompt_ids=prompts, prompt_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.randint(10, 1000, (B, R), generator=g), response_mask=rm,
        rollout_logprobs=-torch.rand(B, R, generator=g) * rm, group_index=torch.arange(B) // n,
        prompt_index=torch.arange(B) // n, policy_version=torch.zeros(B, dtype=torch.long),
        extras={"advantages": torch.randn(B, 1, generator=g).expand(B, R) * rm},
    )


def _trainer(compose, *over: str):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=nat", "trainer.grad_clip=0", "algo.kl.coef=0", "algo.entropy_coef=0", *over))
    if "model" not in _CACHE:
        _CACHE["model"] = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    return TorchTrainer.from_config(copy.deepcopy(_CACHE["model"]), cfg, "cpu")


class _Shapes:
    """Records the ``input_ids`` shape of every decoder call (a forward hook on the backbone)."""

    def __init__(self, trainer):
        self.seen = []
        self.h = trainer.policy.base_model.register_forward_hook(
            lambda mod, a, kw, out: self.seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)

    def tokens(self) -> int:
        self.h.remove()
        return sum(b * w for b, w in self.seen)


def _update(compose, *over: str, old: bool = True):
    """One policy_update of nat on the grouped batch; returns (metrics, gradient, decoder input shapes)."""
    t = _trainer(compose, *over)
    b = grouped_batch()
    if old:  # a second-epoch-like update: the ratio moves away from 1
        lp, _ = t.compute_logprobs(b)
        g = torch.Generator().manual_seed(1)
        b.extras["old_logprobs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * b.response_mask
    rec = _Shapes(t)
    m, grad = update_with_gradient(t, b)
    return m, grad, rec


# --- the draw, by hand -----------------------------------------------------------------------------

def test_rpc_and_urs_weights_by_hand():
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    for seed in range(6):
        w = nat_draw(m, torch.Generator().manual_seed(seed), selector="rpc", keep_prob=0.5)
        # a prefix of each row, weights L / (L - k): row 0 (L = 4) 1, 4/3, 2, 4; row 1 (L = 2) 1, 2
        c0, c1 = int((w[0] > 0).sum()), int((w[1] > 0).sum())
        assert 1 <= c0 <= 4 and 1 <= c1 <= 2
        assert torch.allclose(w[0], torch.tensor([1.0, 4 / 3, 2.0, 4.0]) * (torch.arange(4) < c0))
        assert torch.allclose(w[1], torch.tensor([1.0, 2.0, 0.0, 0.0]) * (torch.arange(4) < c1))
        keep, pi = nat_inclusion(m, "rpc", 0.5, torch.Generator().manual_seed(seed))
        assert torch.equal(w, keep.float() / pi)  # the same draw as the selector
    u = nat_draw(m, torch.Generator().manual_seed(0), selector="urs", keep_prob=0.25)
    assert set(u[m > 0].tolist()) <= {0.0, 4.0} and float(u[m == 0].abs().sum()) == 0.0
    assert drawn_widths(torch.tensor([[1.0, 2.0, 0, 0], [0, 0, 0, 0], [1.0, 0, 3.0, 0]]),
                        torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])) == [2, 0, 1]  # 3.0 on padding


def test_loss_reads_the_drawn_weights_and_its_own_draw_is_the_same():
    """HT weights unchanged: the loss on the trainer's ``token_weights`` equals the loss drawing with the seed."""
    g = torch.Generator().manual_seed(4)
    m = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1.0] * 5 + [0.0]])
    lp = (-torch.rand(3, 6, generator=g)).requires_grad_()
    base = dict(old_logprobs=lp.detach() + 0.1 * torch.randn(3, 6, generator=g),
                advantages=torch.randn(3, 1, generator=g).expand(3, 6), response_mask=m)
    for sel in ("rpc", "urs"):
        a, _ = compute_policy_loss("nat", PolicyLossInput(logprobs=lp, seed=11, **base), selector=sel)
        w = nat_draw(m, torch.Generator().manual_seed(11), selector=sel, keep_prob=0.5)
        b, met = compute_policy_loss("nat", PolicyLossInput(logprobs=lp, extras={"token_weights": w}, **base),
                                     selector=sel)
        assert torch.equal(a, b)
        assert float(a.detach()[w == 0].abs().sum()) == 0.0  # an undrawn token carries nothing
        # clip metrics are over the drawn tokens: the undrawn ones may not have gone forward
        r = torch.exp(lp.detach() - base["old_logprobs"])
        assert float(met["ratio_mean"]) == pytest.approx(float(r[w > 0].mean()), rel=1e-6)


# --- the truncated forward -------------------------------------------------------------------------

@pytest.mark.usefixtures("one_thread")
def test_drawn_forward_logprobs_equal_full_at_needed_positions_and_columns_shrink(compose):
    t = _trainer(compose)
    b = grouped_batch()
    need = torch.zeros(8, 10, dtype=torch.bool)
    need[0, :2] = True
    need[2, 3] = True  # last needed column: 3
    need[6, 1] = True
    full = _Shapes(t)
    lp_full, ent_full = t._logprobs(t.policy, b, with_entropy=True)
    n_full = full.tokens()
    cut = _Shapes(t)
    lp, ent, computed, (done, whole) = t._drawn_logprobs(t.policy, b, need, with_entropy=True)
    cut.tokens()
    # rows 0, 2, 6 (prompts of two groups: the shared-prefix pass runs them once each), columns 0..3
    assert cut.seen == [(2, 5), (3, 4)], cut.seen
    assert full.seen[-1] == (8, 10) and n_full > 2 * 5 + 3 * 4
    assert (done, whole) == (3 * (5 + 4), 8 * (5 + 10))
    assert bool(computed[need].all()) and not bool(computed[[1, 3, 4, 5, 7]].any())
    assert float((lp - lp_full)[need].abs().max()) <= 1e-6
    assert float((ent - ent_full)[need].abs().max()) <= 1e-5
    assert torch.equal(lp[~computed], b.rollout_logprobs[~computed])  # not computed: a constant fill
    # nothing needed: one column of row 0 goes forward, so the loss stays on the autograd graph
    lp0, _, c0, _ = t._drawn_logprobs(t.policy, b, torch.zeros(8, 10, dtype=torch.bool))
    assert lp0.requires_grad and int(c0.sum()) == 1


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("over", [("trainer.micro_batch_size=8",), ("trainer.micro_batch_size=3",),
                                  ("trainer.max_tokens_per_micro_batch=40",)], ids=["mb8", "mb3", "budget"])
def test_rpc_update_same_loss_and_gradient_as_full_forward_with_fewer_columns(compose, over):
    m_d, g_d, s_d = _update(compose, "algo.loss_params.selector=rpc", *over)
    m_f, g_f, s_f = _update(compose, "algo.loss_params.selector=rpc", "trainer.drawn_forward=false", *over)
    assert g_f.norm() > 0
    assert torch.allclose(g_d, g_f, rtol=1e-5, atol=1e-6 * float(g_f.abs().max())), float((g_d - g_f).abs().max())
    for k, v in m_f.items():
        if not k.startswith("bench/") and k != "actor/lr":
            assert m_d[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, m_d[k], v)
    assert s_d.tokens() < s_f.tokens()  # the decoder saw fewer tokens
    assert m_d["bench/update_forward_frac"] < 1.0 and "bench/update_forward_frac" not in m_f
    assert 0 < m_d["actor/drawn_frac"] < 1


@pytest.mark.usefixtures("one_thread")
def test_urs_unchanged_and_rpc_micro_batch_invariant(compose):
    m_d, g_d, _ = _update(compose, "algo.loss_params.selector=urs")
    m_f, g_f, _ = _update(compose, "algo.loss_params.selector=urs", "trainer.drawn_forward=false")
    assert torch.allclose(g_d, g_f, rtol=1e-5, atol=1e-6 * float(g_f.abs().max()))
    assert m_d["loss/policy"] == pytest.approx(m_f["loss/policy"], rel=1e-6)
    runs = {mb: _update(compose, "algo.loss_params.selector=rpc", f"trainer.micro_batch_size={mb}")[:2]
            for mb in (1, 3, 8)}
    m8, g8 = runs[8]
    for mb in (1, 3):
        m, g = runs[mb]
        assert torch.allclose(g, g8, rtol=1e-4, atol=1e-5 * float(g8.abs().max())), mb
        for k, v in m8.items():
            if not k.startswith("bench/") and k != "actor/lr":
                assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (mb, k)


def test_drawn_forward_off_when_another_term_reads_every_position(compose):
    assert _trainer(compose)._drawn_forward_ok()
    assert not _trainer(compose, "trainer.drawn_forward=false")._drawn_forward_ok()
    assert not _trainer(compose, "algo.entropy_coef=0.01")._drawn_forward_ok()  # entropy bonus on every token
    assert not _trainer(compose, "algo.kl.coef=0.1")._drawn_forward_ok()  # KL penalty on every token
    assert not _trainer(compose, "algo=grpo")._drawn_forward_ok()  # a loss without a draw


def test_config_errors(compose):
    from rlpost.config.compose import validate_config

    validate_config(compose(["model=tiny", "logger=none", "algo=nat", "algo.loss_params.selector=rpc"]))
    for bad in (["algo=nat", "+algo.loss_params.keep_prb=0.3"], ["algo=nat", "algo.loss_params.selector=prefix"],
                ["algo=nat", "trainer.drawn_fwd=false"]):
        with pytest.raises(ConfigError):
            validate_config(compose(["model=tiny", "logger=none", *bad]))
    with pytest.raises(ValueError, match="keep_prob"):
        nat_draw(torch.ones(1, 3), None, selector="urs", keep_prob=0.0)
    with pytest.raises(ValueError, match="selector"):
        nat_draw(torch.ones(1, 3), None, selector="prefix", keep_prob=0.5)


@pytest.mark.usefixtures("one_thread")
def test_recipe_one_step_on_tiny_with_rpc(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=nat", "model=tiny", "algo.loss_params.selector=rpc", "steps=1", "logger=jsonl",
                          "selector.prompts_per_step=2", "rollout.max_new_tokens=8", "eval.at_end=false",
                          "eval.at_start=false", "checkpoint.every=0", "precision=fp32"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"])
    assert 0 < r["actor/drawn_frac"] <= 1 and 0 < r["bench/update_forward_frac"] <= 1
