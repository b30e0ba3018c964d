"""HiF4 (HiFloat4): a 4-bit block format with a three-level scaling hierarchy, simulated.

"HiFloat4 Format for Language Model Inference" (Luo, Huang, Cheng et al., arXiv:2602.11287), used
for end-to-end FP4 RL together with Rollout-ResQ (the sparse rollout residual,
:func:`rlpost.rollout.precision.w4a4_activation` ``compensation="resq"``). One HiF4 unit is 64
consecutive values of a row with 32 bits of shared metadata (4.5 bits per value):

* level 1: one **E6M2** base scale ``S`` per 64 values (8 bits: ``2^e * (1 + m/4)``);
* level 2: one 1-bit micro-exponent ``e8`` per 8 values (8 bits);
* level 3: one 1-bit micro-exponent ``e16`` per 4 values (16 bits);
* elements: 4 bits, sign + a fixed-point magnitude with one integer and two fraction bits
  ({0, 0.25, ..., 1.75}; the S1E1M2 encoding of Huawei's CANN ``HiFloat4`` type spans the same
  eight magnitudes).

A value decodes as ``sign * q * S * 2^-(e8 + e16)``. Our reading of the encoder (the paper's exact
rounding rules were not available to us): ``S`` is ``amax_64 / 1.75`` rounded *up* to the E6M2 grid
(nothing clips); a micro-exponent is 1 (halve the scale) exactly when its sub-group's amax fits the
halved range (``amax <= 1.75 * scale / 2``); elements round to the nearest multiple of 0.25
(ties to even, ``torch.round``). The E6M2 exponent is clamped to ``[-48, 15]`` (our choice; a
simulated rollout never reaches either end).
"""

from __future__ import annotations

import math

import torch

HIF4_GROUP = 64
HIF4_MAX = 1.75  # largest element magnitude
HIF4_STEP = 0.25  # element resolution


def e6m2_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest E6M2 value ``2^e * (1 + m/4)`` (``m`` in 0..3) that is ``>= x``, elementwise, for ``x > 0``.

    Zeros stay 0 (a zero scale: the unit decodes to zeros). Exponents are clamped to ``[-48, 15]``.
    Returns a float32 tensor of ``x``'s shape.
    """
    xf = x.float()
    pos = xf > 0
    safe = torch.where(pos, xf, torch.ones_like(xf))
    e = torch.floor(torch.log2(safe)).clamp(-48, 15)
    mant = torch.ceil(safe / torch.exp2(e) * 4.0 - 1e-6) / 4.0  # in [1, 2]
    over = mant > 1.75
    e = torch.where(over, e + 1, e)
    mant = torch.where(over, torch.ones_like(mant), mant)
    return torch.where(pos, torch.exp2(e) * mant, torch.zeros_like(xf))


def fake_quant_hif4(w: torch.Tensor, group: int = HIF4_GROUP) -> torch.Tensor:
    """Round ``w`` ``[out, in]`` (or any ``[rows, ...]``) to HiF4, unit by unit along each row; same shape and dtype.

    See the module docstring for the format and our reading of its encoder.

    Raises:
        ValueError: ``group`` not a positive multiple of 8.
    """
    if group < 8 or group % 8:
        raise ValueError(f"HiF4 unit size must be a positive multiple of 8, got {group}")
    wf = w.detach().float()
    flat = wf.reshape(wf.shape[0], -1)
    n = flat.shape[1]
    pad = (-n) % group
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    u = flat.reshape(flat.shape[0], -1, group)  # [rows, units, 64]
    S = e6m2_round_up(u.abs().amax(-1, keepdim=True) / HIF4_MAX)  # level 1
    g8 = u.reshape(*u.shape[:2], group // 8, 8)
    e8 = (g8.abs().amax(-1, keepdim=True) <= HIF4_MAX * S[..., None] / 2).float()  # level 2
    s8 = S[..., None] * torch.exp2(-e8)  # [rows, units, 8, 1]
    g4 = g8.reshape(*g8.shape[:3], 2, 4)
    e16 = (g4.abs().amax(-1, keepdim=True) <= HIF4_MAX * s8[..., None] / 2).float()  # level 3
    s4 = s8[..., None] * torch.exp2(-e16)  # [rows, units, 8, 2, 1]
    safe = torch.where(s4 > 0, s4, torch.ones_like(s4))
    q = (torch.round(g4 / safe / HIF4_STEP) * HIF4_STEP).clamp(-HIF4_MAX, HIF4_MAX) * s4
    out = q.reshape(flat.shape[0], -1)[:, :n]
    return out.reshape(w.shape).to(w.dtype)


def hif4_bits_per_value(group: int = HIF4_GROUP) -> float:
    """Storage cost: 4 bits per element + (8 + group/8 + group/4) metadata bits per unit (4.5 for 64)."""
    return 4.0 + (8 + group / 8 + group / 4) / group


assert math.isclose(hif4_bits_per_value(), 4.5)
