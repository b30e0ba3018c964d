"""QUADS, trainer side: weight-only fake quantisation through the rollout copy's own quantise-dequantise path.

QUADS ("QUADS: QUantization-error Alignment across Dual Sides", NVFP4 RL of MoE models; we could
read only its abstract) splits the rollout-trainer gap of 4-bit rollouts into a weight part and
an activation part. The weight part is removed by construction: the trainer's forward uses the
*same* quantise-dequantise function of its weights as the rollout engine's copy ("asymmetric QAT":
weights only, activations stay full precision in the trainer), so both sides multiply identical
weights and the weight error cancels. The activation part is repaired on the rollout side by
residual activation compensation of the worst channels
(:func:`rlpost.rollout.precision.w4a4_activation`, ``compensation="quads"``, ``precision.rollout_dtype=fp4_w4a4_quads_sim``).

``precision.trainer_weight_quant``: ``none`` (default) | ``fp4`` (e2m1 blocks of 32, the
function :func:`rlpost.rollout.precision.fake_quant_fp4_e2m1` that ``fp4_*`` rollout copies apply)
| ``hif4`` (:func:`rlpost.rollout.hif4.fake_quant_hif4`, for ``hif4_*`` copies). Each decoder
linear of the trained policy computes ``x @ (w + sg(Q(w) - w))^T``: the forward sees ``Q(w)``, the
gradient reaches the full-precision master weight unchanged (straight-through estimator; our
choice of estimator, the abstract does not name one). The LM head stays full precision, as on the
rollout side. Since both quantisers are idempotent (``Q(Q(w)) = Q(w)``), a rollout copy built from
the patched policy holds exactly the weights the trainer multiplies.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict

import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.hif4 import fake_quant_hif4
from rlpost.rollout.precision import _decoder_linears, fake_quant_fp4_e2m1


def _quantisers() -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:

    return {"fp4": fake_quant_fp4_e2m1, "hif4": fake_quant_hif4}


def ste_weight(w: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``w + (Q(w) - w).detach()``: equals ``Q(w)`` in value, has the gradient of ``w`` (straight-through)."""
    return w + (quant(w) - w).detach()


def _qlinear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, ste_weight(self.weight, self._rlpost_wquant).to(x.dtype),
                                      None if self.bias is None else self.bias.to(x.dtype))


def attach_weight_fake_quant(model: torch.nn.Module, fmt: str) -> int:
    """Make every decoder ``nn.Linear`` of ``model`` (not the LM head) multiply ``Q(w)`` with a straight-through gradient.

    The module's forward is replaced by a bound method (a deep copy rebinds it to the copy's
    own weights); ``state_dict`` keys and values are unchanged (the master weights stay full
    precision). Returns the number of patched layers.

    Raises:
        ConfigError: unknown ``fmt``.
    """
    qs = _quantisers()
    if fmt not in qs:
        raise ConfigError(f"precision.trainer_weight_quant={fmt!r}; valid: none, {', '.join(qs)}")

    n = 0
    for _, lin in list(_decoder_linears(model)):
        lin._rlpost_wquant = qs[fmt]
        lin.forward = types.MethodType(_qlinear_forward, lin)
        n += 1
    return n


def apply_trainer_weight_quant(cfg: Any, policy: torch.nn.Module) -> int:
    """``precision.trainer_weight_quant`` applied to the trainer's policy (0 layers when ``none``).

    Raises:
        ConfigError: unknown format, or a rollout precision whose weights use another quantiser
            (``fp4`` needs an ``fp4_*`` rollout dtype, ``hif4`` a ``hif4_*`` one), since the point
            is one shared quantise-dequantise path.
    """
    fmt = str(cfg.precision.get("trainer_weight_quant", "none") or "none")
    if fmt == "none":
        return 0
    rd = str(cfg.precision.rollout_dtype)
    if not rd.startswith(fmt + "_"):
        raise ConfigError(f"precision.trainer_weight_quant={fmt} shares its weight quantiser with a {fmt}_* rollout "
                          f"copy, but precision.rollout_dtype={rd}; set e.g. precision.rollout_dtype={fmt}_w4a4_"
                          f"{'quads' if fmt == 'fp4' else 'resq'}_sim")
    return attach_weight_fake_quant(policy, fmt)
