"""Value model (critic) for PPO-style and single-rollout algorithms."""

from __future__ import annotations

import copy

import torch

from rlpost.models.logprobs import backbone_and_head, build_inputs


class ValueModel(torch.nn.Module):
    """A causal-LM backbone with a scalar head: ``V(s_t)`` for every response position.

    Initialised from the policy's backbone (a separate copy, as in PPO for LMs,
    InstructGPT arXiv:2203.02155) and a zero-initialised linear head, so initial
    values are 0.

    With ``shared=True`` the backbone is the policy's own module (not a copy): one
    autoregressive backbone for policy and value, as single-rollout autoregressive
    policy optimisation (``algo=sapo_ar``) does; the critic's optimizer then updates the
    shared weights too (the value objective is optimised separately from the policy's).

    With ``num_heads=N > 1`` the backbone carries N zero-initialised scalar heads (one linear
    layer with N outputs), N critics that share the backbone; they differ by the returns each
    is regressed on (e.g. T^5's twin critics, :mod:`rlpost.algos.t5`).

    Args:
        policy: the policy model to copy (or share) the backbone from.
        shared: use the policy's backbone itself.
        num_heads: number of value heads (>= 1).

    Raises:
        ValueError: ``num_heads < 1``.
    """

    def __init__(self, policy: torch.nn.Module, shared: bool = False, num_heads: int = 1) -> None:
        super().__init__()
        if int(num_heads) < 1:
            raise ValueError(f"num_heads={num_heads} must be >= 1")
        self.num_heads = int(num_heads)
        base, _ = backbone_and_head(policy)
        self.backbone = base if shared else copy.deepcopy(base)
        hidden = self.backbone.config.hidden_size
        self.head = torch.nn.Linear(hidden, self.num_heads)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_attn: torch.Tensor,
    ) -> torch.Tensor:
        """Values ``[B, R]`` (``[B, R, N]`` with N heads): position t holds V of the state before
        response token t.

        Shapes as :func:`rlpost.models.logprobs.response_logprobs`.
        """
        ids, attn, pos = build_inputs(prompt_ids, prompt_mask, response_ids, response_attn)
        P, R = prompt_ids.shape[1], response_ids.shape[1]
        hidden = self.backbone(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        v = self.head(hidden[:, P - 1 : P + R - 1]).float()
        return v.squeeze(-1) if self.num_heads == 1 else v
