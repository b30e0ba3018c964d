"""SP3O: supervise the PPO critic on a few well-separated states of each response, not every token.

"Rethinking Critic Learning in PPO: Understanding and Mitigating Value Flattening"
(SParse Proximal Policy Optimization, SP3O; arXiv:2609.18708). No code was found and
only the abstract could be read from here; it is the source. The finding: Monte Carlo values change sharply between intermediate
states of a response while the critic's predictions stay flat; the paper traces it
to an implicit variance penalty of the token-level value loss and to the redundant,
correlated gradients of neighbouring tokens. The fix: apply the value loss at only a
handful of widely spaced positions per response (three in the paper's experiments).
The policy side (GAE, the clipped surrogate) is unchanged.

Set by ``algo.critic.supervised_states`` (0 = every token, plain PPO) and
``algo.critic.state_spacing``. The abstract does not give the spacing rule; the two
rules here are this library's choices:

* ``even``: positions ``round(k (L - 1) / (n - 1))``, ``k = 0..n-1`` of a response with
  ``L`` loss tokens: always the first state (after the prompt) and the last, the rest
  evenly between (``n = 1``: the first state only);
* ``stratified``: the ``L`` positions cut into ``n`` equal strata, one position drawn
  uniformly in each (well separated on average, a different set every step).

A response with ``L <= n`` loss tokens is supervised on all of them.
"""

from __future__ import annotations

from typing import Optional

import torch


def sparse_state_mask(
    mask: torch.Tensor,
    n_states: int,
    spacing: str = "even",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """``[B, R]`` 0/1 float: the ``n_states`` positions of each row's loss tokens whose value SP3O supervises.

    Positions are counted over the row's loss tokens (``mask > 0``), so a mask with
    holes (tool outputs in a multi-turn episode) is respected.

    Args:
        mask: ``[B, R]`` 0/1 loss mask of the critic (the response mask).
        n_states: states per response (> 0).
        spacing: ``even`` or ``stratified`` (module docstring).
        generator: random source of ``stratified`` (None: torch's global RNG).
    Returns:
        a sub-mask of ``mask`` (same dtype as float32).
    Raises:
        ValueError: ``n_states <= 0`` or an unknown ``spacing``.
    """
    if n_states <= 0:
        raise ValueError(f"sp3o: supervised_states must be > 0, got {n_states}")
    if spacing not in ("even", "stratified"):
        raise ValueError(f"sp3o: state_spacing={spacing!r}: valid choices are even, stratified")
    m = (mask > 0)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    for b in range(mask.shape[0]):
        pos = m[b].nonzero().flatten()
        L = int(pos.numel())
        if L == 0:
            continue
        if L <= n_states:
            out[b, pos] = 1.0
            continue
        n = n_states
        if spacing == "even":
            if n == 1:
                idx = torch.zeros(1, dtype=torch.long)
            else:
                idx = torch.round(torch.arange(n, dtype=torch.float64) * (L - 1) / (n - 1)).long()
        else:
            edges = torch.floor(torch.arange(n + 1, dtype=torch.float64) * L / n).long()
            u = torch.rand(n, generator=generator, dtype=torch.float64)
            idx = edges[:-1] + torch.floor(u * (edges[1:] - edges[:-1]).double()).long()
        out[b, pos[idx.to(pos.device)]] = 1.0
    return out


def critic_loss_mask(response_mask: torch.Tensor, critic_cfg, seed: int = 0,
                     value_mask: "torch.Tensor | None" = None) -> torch.Tensor:
    """The critic's loss mask ``[B, R]`` for ``algo.critic``: the response mask, or SP3O's sparse states.

    ``value_mask`` (an estimator's own value positions: ``sapo_ar``'s turn starts, ``egae``'s
    complete rows), when given, replaces the response mask before SP3O's selection: it is
    not cut by a policy-only ``loss_mask`` (``egae``'s window), which the runner has applied
    to ``response_mask`` by then.

    ``critic_cfg.supervised_states`` 0 (or absent) keeps every token (PPO); ``n > 0``
    selects :func:`sparse_state_mask` with ``critic_cfg.state_spacing``, drawing
    ``stratified`` positions from ``seed`` (the engines pass one per critic update, so
    every micro-batch and process sees the same positions).
    """
    if value_mask is not None:
        response_mask = value_mask.to(response_mask.dtype)
    n = int(getattr(critic_cfg, "supervised_states", 0) or 0)
    if n <= 0:
        return response_mask.float()
    spacing = str(getattr(getattr(critic_cfg, "state_spacing", "even"), "value", getattr(critic_cfg, "state_spacing", "even")))
    return sparse_state_mask(response_mask, n, spacing, torch.Generator().manual_seed(int(seed)))


def with_critic_mask(batch, critic_cfg, seed: int):
    """A shallow copy of ``batch`` whose ``extras['_critic_mask']`` ``[B, R]`` is the critic's loss mask.

    Both trainer engines call this once per critic update, before the micro-batch split,
    so every micro-batch (and every data-parallel process, given the same ``seed``) sees
    the same SP3O states; see :func:`critic_loss_mask` for the mask and
    ``batch.extras['value_mask']`` (an estimator's value positions), which replaces the response mask.
    The caller's batch is not modified.
    """
    out = batch.select(list(range(len(batch))))
    out.extras["_critic_mask"] = critic_loss_mask(out.response_mask, critic_cfg, int(seed), out.extras.get("value_mask"))
    return out
