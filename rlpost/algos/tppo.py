"""T-PPO's Extended GAE: advantages for responses cut by the rollout window, bootstrapped from the critic.

"Truncated Proximal Policy Optimization" (T-PPO, Fan et al., ByteDance Seed, arXiv:2506.15050)
generates responses in length-limited windows: each step every active response is extended by at
most one window of tokens, the policy is updated on what was generated, responses that finished
leave the batch and new prompts take their place, and unfinished ones continue in the next step.
Extended Generalized Advantage Estimation (EGAE) gives advantages for an incomplete response; the
policy and the value model are optimised independently, the value model on completed responses
only ("selectively filtering prompt and truncated tokens").

What could be read here: the abstract, and the four public reviews of the paper, which state the
method's core assumption ``V(s_l) = V(s_{l-1})`` for a response cut after ``l`` tokens and that
"the policy is updated frequently on partial data, while the value function is updated less
frequently on completed trajectories". The full text (its equations, window length, GAE
constants) was not reachable and no code is released; every constant below is our choice.

EGAE, as implemented by :func:`egae_advantage` (``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``,
``A_t = sum_k (gamma lam)^k delta_{t+k}``, ``V(s_t)`` the critic's value before token ``t``):

* a complete response (EOS, or the total ``rollout.max_new_tokens`` spent) is ordinary GAE: the
  outcome reward on its last token, ``V`` after it 0;
* a response cut by the window after ``l`` tokens has no outcome yet: its token rewards are only
  the per-token ones (a KL-in-reward penalty), and the unseen next state's value is the value at
  the cut, ``V(s_l) := V(s_{l-1})`` (the paper's assumption; the value pass gives V *before*
  each token, so ``V(s_{l-1})`` is the last one it has). With ``gamma = 1`` the last delta is 0
  and ``A_t = sum_k lam^k delta_{t+k}`` over the observed tokens only.

The policy is updated on the tokens generated in this step's window (``window_mask``: earlier
windows' tokens were trained in the steps that generated them; returned as ``loss_mask``). The
critic regresses on every token of the rows that are complete (``value_mask``; a cut row has no
return yet), so policy and value updates see different token sets, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, discounted_gae, outcome_token_rewards
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import masked_whiten
from rlpost.core.registry import param

_PAPER = ("Truncated Proximal Policy Optimization (T-PPO, arXiv:2506.15050): Extended GAE bootstraps a "
          "window-truncated response from the critic's value at the cut, V(s_l) = V(s_{l-1})")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long index of each row's last position with ``mask > 0`` (0 for an empty row)."""
    R = mask.shape[1]
    if R == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long)
    return (torch.arange(R) * (mask > 0)).argmax(-1)


@dataclass(frozen=True)
class EGAEParams:
    """EGAE's constants (the paper's values were not readable: PPO-for-LLM defaults, our choice)."""

    gamma: float = param(1.0, "discount per token (our choice: 1, as PPO for LLMs)")
    lam: float = param(0.95, "GAE lambda (our choice: 0.95, the PPO default of this library)")
    whiten: bool = param(True, "whiten the advantages over the policy's tokens (this window's) in the batch")


@ADV_ESTIMATORS.register("egae", paper=_PAPER, params=EGAEParams, needs_critic=True, uses_token_rewards=True,
                         needs_window_rollouts=True,
                         zero_variance="critic baseline (T-PPO's Extended GAE; gae on whole responses)")
def egae_advantage(inp: AdvantageInput, *, gamma: float, lam: float, whiten: bool) -> AdvantageOutput:
    """Extended GAE (T-PPO, arXiv:2506.15050) over complete and window-truncated responses (module docstring).

    Args:
        inp: ``rewards [B]``, ``response_mask [B, R]`` (every token of the response so far),
            ``values [B, R]``, optional ``token_rewards [B, R]``, ``truncated [B]`` (rows cut by
            the window; None: none) and ``window_mask [B, R]`` (this step's tokens; None: all).
        gamma, lam: GAE constants; whiten: whiten over the policy's tokens.
    Returns:
        ``advantages [B, R]`` (0 outside ``response_mask``), ``returns [B, R]`` (= A + V before
        whitening), ``loss_mask`` = ``window_mask`` (None without one) and ``value_mask`` [B, R]
        = the complete rows' response tokens.
    Raises:
        ValueError: no ``values``, ``gamma`` / ``lam`` outside [0, 1], or a ``truncated`` /
            ``window_mask`` whose shape does not match the batch.
    """
    if inp.values is None:
        raise ValueError("egae needs critic values (inp.values): set algo.critic.enabled=true")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"egae: gamma and lam must be in [0, 1], got {gamma}, {lam}")
    mask = inp.response_mask
    B = mask.shape[0]
    cut = torch.zeros(B, dtype=torch.bool) if inp.truncated is None else inp.truncated.bool().reshape(-1)
    if cut.shape[0] != B:
        raise ValueError(f"egae: truncated has {cut.shape[0]} rows, the batch {B}")
    if inp.window_mask is not None and inp.window_mask.shape != mask.shape:
        raise ValueError(f"egae: window_mask {tuple(inp.window_mask.shape)} != response_mask {tuple(mask.shape)}")
    rewards = torch.where(cut, torch.zeros_like(inp.rewards.double()), inp.rewards.double())
    tr = outcome_token_rewards(AdvantageInput(rewards=rewards, response_mask=mask, group_index=inp.group_index,
                                              token_rewards=inp.token_rewards))
    v = inp.values.double() * mask.double()
    v_cut = v.gather(1, last_token_index(mask)[:, None]).squeeze(1) if mask.shape[1] else torch.zeros(B)
    bootstrap = torch.where(cut, v_cut, torch.zeros_like(v_cut))  # V(s_l) := V(s_{l-1}) on a cut row
    adv, ret = discounted_gae(tr, inp.values, mask, gamma, lam, bootstrap=bootstrap)
    policy_mask = mask if inp.window_mask is None else mask * inp.window_mask.to(mask.dtype)
    if whiten:
        adv = masked_whiten(adv, policy_mask) * mask.double()
    value_mask = mask * (~cut).to(mask.dtype)[:, None]
    return AdvantageOutput(advantages=adv.float(), returns=ret.float(),
                           loss_mask=None if inp.window_mask is None else inp.window_mask.to(mask.dtype),
                           value_mask=value_mask)
