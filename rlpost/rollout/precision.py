"""Rollout precision: weight conversions of the rollout copy, and mismatch metrics.

The rollout engine may run at a different precision from the trainer
(``precision.rollout_dtype``). On GPUs that is bf16 or real fp8 through vLLM;
on this CPU the same *kind* of mismatch is produced by converting the rollout
engine's private copy of the policy:

* ``int8``: PyTorch dynamic quantization (``torch.ao.quantization.quantize_dynamic``)
  of every ``nn.Linear`` of the decoder: int8 weights with per-tensor scales,
  activations quantized on the fly. Real int8 kernels on CPU.
* ``fp8_sim``: weights rounded to the fp8 **e4m3** grid (``torch.float8_e4m3fn``,
  max 448) with one scale per output row (``amax / 448``), then stored back in
  fp32. This is the per-channel weight quantization of fp8 inference stacks,
  simulated ("fake quantization"): the numbers the GPU would multiply, the
  arithmetic of the CPU.
* ``fp4_sim``: weights rounded to the fp4 **e2m1** grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}
  with one scale per block of 32 consecutive weights of a row (``amax / 6``),
  as in the OCP microscaling MXFP4 format (block 32); we keep the block scale
  in fp32 rather than MX's power-of-two e8m0, a documented simplification.

* ``hif4_sim``, ``hif4_w4a4_sim``, ``hif4_w4a4_resq_sim``: the same in HiF4, the three-level
  hierarchically scaled 4-bit format (arXiv:2602.11287, :mod:`rlpost.rollout.hif4`) that
  Rollout-ResQ pairs with its sparse residual.
* ``fp4_w4a4_sim`` and its compensated forms: fp4 weights as ``fp4_sim`` and fp4
  *activations* too (W4A4, the case where QUADS and Rollout-ResQ find the
  rollout-trainer gap comes from); see :func:`w4a4_activation`.

Only the decoder's linear layers are converted; embeddings, norms and the LM
head stay in fp32, as fp8 inference engines (vLLM) keep ``lm_head`` unquantized.

Mismatch metrics (:func:`mismatch_metrics`) compare the rollout engine's
log-probs with the trainer's for the same tokens: the quantity behind
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(Yao et al., 2025) and the FP8-rollout studies: FP8-RL (arXiv:2601.18150), AIS
(arXiv:2605.13907) and CIS (arXiv:2609.32444).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.fp8_stack import blockwise_w8a8_converter
from rlpost.rollout.hif4 import fake_quant_hif4

Converter = Callable[[torch.nn.Module], torch.nn.Module]

FP8_E4M3_MAX = 448.0
FP4_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_BLOCK = 32


def fake_quant_fp8_e4m3(w: torch.Tensor) -> torch.Tensor:
    """Round ``w`` (``[out, in]`` or any ``[out, ...]``) to fp8 e4m3 with one scale per output row.

    ``scale_r = amax_r / 448``; ``q = cast_e4m3(w / scale) * scale``. Rows of
    zeros stay zero. Returns a tensor of ``w``'s shape and dtype. The relative
    rounding error of a normal e4m3 number is at most 2^-4 (3 mantissa bits).
    """
    wf = w.detach().float()
    flat = wf.reshape(wf.shape[0], -1)
    amax = flat.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (flat / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(w.shape).to(w.dtype)


def fake_quant_fp4_e2m1(w: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Round ``w`` ``[out, in]`` to fp4 e2m1 with one fp32 scale per block of ``block`` weights of a row.

    Each block is scaled so that its largest magnitude maps to 6 (the largest
    e2m1 value), every weight is rounded to the nearest of
    ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the lower magnitude), and scaled
    back. Returns a tensor of ``w``'s shape and dtype.

    Raises:
        ValueError: ``block < 1``.
    """
    if block < 1:
        raise ValueError(f"fp4 block size must be >= 1, got {block}")
    wf = w.detach().float()
    flat = wf.reshape(wf.shape[0], -1)
    n = flat.shape[1]
    pad = (-n) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(flat.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 6.0, torch.ones_like(amax))
    x = (blocks / scale).abs()
    grid = FP4_E2M1_GRID.to(x.device)
    idx = (x[..., None] - grid).abs().argmin(dim=-1)
    q = grid[idx] * blocks.sign() * scale
    q = q.reshape(flat.shape[0], -1)[:, :n]
    return q.reshape(w.shape).to(w.dtype)


def _decoder_linears(model: torch.nn.Module):
    """``nn.Linear`` modules of the decoder stack (not the LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            yield name, mod


def _fake_quant_converter(fn: Callable[[torch.Tensor], torch.Tensor]) -> Converter:
    def convert(model: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            for _, lin in _decoder_linears(model):
                lin.weight.copy_(fn(lin.weight))
        return model

    return convert


def _int8_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    from torch.ao.quantization import quantize_dynamic

    model = model.float().eval()
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ConfigError("precision.rollout_dtype=int8 needs a causal LM with a separate decoder (base_model).")
    # Quantize the decoder only; the LM head keeps fp32 (tied to the embeddings in SmolLM2).
    quantize_dynamic(base, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return model


#: QUADS residual activation compensation: share of a layer's input channels kept at full precision (our choice)
QUADS_CHANNEL_FRACTION = 1.0 / 32
#: Rollout-ResQ sparse residual: one residual entry kept per group of this many inputs of a token (our choice)
RESQ_GROUP = 16


def w4a4_activation(x: torch.Tensor, compensation: str = "none", block: int = FP4_BLOCK,
                    quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The activation a simulated W4A4 matmul multiplies: ``x`` ``[..., in]`` fake-quantized to fp4 e2m1.

    Blocks of ``block`` consecutive inputs of each token share a scale (as the
    weights do); ``quant`` replaces that fp4 e2m1 rounding by another 4-bit format's
    ``fn([tokens, in]) -> same`` (HiF4: :func:`rlpost.rollout.hif4.fake_quant_hif4`).
    ``compensation`` adds back part of the residual ``e = x - Q(x)``:

    * ``none``: ``Q(x)`` (plain W4A4).
    * ``quads``: QUADS residual activation compensation ("QUADS: QUantization-error
      Alignment across Dual Sides", NVFP4 MoE RL; abstract: "corrects high-error
      activation channels while preserving native W4A4 GEMMs"): ``e`` is added on
      the ``ceil(in / 32)`` input channels with the largest mean ``|e|`` over the
      call's tokens, i.e. ``y = Q(x) Q(W)^T + e[:, C] Q(W)[:, C]^T``. How the paper picks
      the channels is not in the abstract; the per-call choice is ours.
    * ``resq``: Rollout-ResQ sparse residual (end-to-end FP4 RL with HiF4; abstract:
      "a single residual correction term constrained to a hardware-friendly sparsity
      pattern, added only to the FP4 rollout matmul"): in every group of 16
      consecutive inputs of a token the one entry with the largest ``|e|`` is
      added back (1:16 structured sparsity, our choice of pattern).

    Returns a tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: unknown ``compensation``.
    """
    shape = x.shape
    xf = x.detach().float().reshape(-1, shape[-1])
    q = fake_quant_fp4_e2m1(xf, block) if quant is None else quant(xf)
    if compensation == "none":
        out = q
    elif compensation == "quads":
        e = xf - q
        n = max(1, int(math.ceil(shape[-1] * QUADS_CHANNEL_FRACTION)))
        ch = e.abs().mean(0).topk(n).indices
        out = q.clone()
        out[:, ch] += e[:, ch]
    elif compensation == "resq":
        e = xf - q
        pad = (-shape[-1]) % RESQ_GROUP
        ep = torch.nn.functional.pad(e, (0, pad)).reshape(e.shape[0], -1, RESQ_GROUP)
        keep = torch.zeros_like(ep).scatter_(-1, ep.abs().argmax(-1, keepdim=True), 1.0)
        out = q + (ep * keep).reshape(e.shape[0], -1)[:, : shape[-1]]
    else:
        raise ValueError(f"unknown activation compensation {compensation!r}; valid: none, quads, resq")
    return out.reshape(shape).to(x.dtype)


def _w4a4_converter(compensation: str, fmt: str = "fp4") -> Converter:
    """4-bit weights plus 4-bit activations on every decoder linear (forward pre-hook).

    ``fmt``: ``fp4`` (e2m1, blocks of 32, as ``fp4_sim``) or ``hif4`` (:mod:`rlpost.rollout.hif4`).
    """

    def convert(model: torch.nn.Module) -> torch.nn.Module:
        quant = None
        wq = fake_quant_fp4_e2m1
        if fmt == "hif4":
            from rlpost.rollout.hif4 import fake_quant_hif4

            quant = wq = fake_quant_hif4
        with torch.no_grad():
            for _, lin in _decoder_linears(model):
                lin.weight.copy_(wq(lin.weight))
                lin.register_forward_pre_hook(
                    lambda mod, args: (w4a4_activation(args[0], compensation, quant=quant),) + tuple(args[1:]))
        return model

    return convert


def _hif4_weights(model: torch.nn.Module) -> torch.nn.Module:

    return _fake_quant_converter(fake_quant_hif4)(model)


ROLLOUT_CONVERTERS: Dict[str, Converter] = {
    "int8": _int8_dynamic,
    "fp8_sim": _fake_quant_converter(fake_quant_fp8_e4m3),
    # FP8-RL's blockwise W8A8 at its default blocks; with precision.rollout_params: rlpost.rollout.fp8_stack.precision_converter
    "fp8_blockwise_sim": blockwise_w8a8_converter(),
    "fp4_sim": _fake_quant_converter(fake_quant_fp4_e2m1),
    "fp4_w4a4_sim": _w4a4_converter("none"),
    "fp4_w4a4_quads_sim": _w4a4_converter("quads"),
    "fp4_w4a4_resq_sim": _w4a4_converter("resq"),
    "hif4_sim": _hif4_weights,
    "hif4_w4a4_sim": _w4a4_converter("none", "hif4"),
    "hif4_w4a4_resq_sim": _w4a4_converter("resq", "hif4"),
}


def rollout_converter(name: str) -> Converter:
    """``fn(module) -> module`` that turns the rollout engine's private copy into precision ``name``.

    Args:
        name: ``int8`` (CPU dynamic quantization), ``fp8_sim`` (e4m3 weight
            fake-quantization), ``fp8_blockwise_sim`` (FP8-RL's blockwise W8A8 at 128x128 / 1x128,
            :mod:`rlpost.rollout.fp8_stack`), ``fp4_sim`` (e2m1 block fake-quantization of the weights),
            ``fp4_w4a4_sim`` (fp4 weights and activations), ``fp4_w4a4_quads_sim`` /
            ``fp4_w4a4_resq_sim`` (W4A4 with QUADS channel / Rollout-ResQ sparse residual
            compensation, :func:`w4a4_activation`), ``hif4_sim`` / ``hif4_w4a4_sim`` /
            ``hif4_w4a4_resq_sim`` (the same in the HiF4 format, :mod:`rlpost.rollout.hif4`).
            ``fp32``/``bf16``/``fp16`` are plain casts handled by
            :func:`rlpost.rollout.build_engine`; ``fp8`` is real fp8 in vLLM
            (``rollout=vllm``).
    Returns:
        A converter that modifies the module in place and returns it; it is
        applied to a deep copy, never to the trainer's weights.
    Raises:
        ConfigError: unknown name, or ``fp8`` with the hf engine.
    """
    if name in ("fp8", "fp8_blockwise"):
        sim = "rollout_fp8_sim" if name == "fp8" else "rollout_fp8_blockwise_sim"
        raise ConfigError(
            f"precision.rollout_dtype={name} is real fp8 and needs rollout=vllm on a GPU. "
            f"Fix: add rollout=vllm, or use precision={sim} to simulate it on CPU."
        )
    if name not in ROLLOUT_CONVERTERS:
        raise ConfigError(
            f"Unknown precision.rollout_dtype={name!r}. Valid choices: fp32, bf16, fp16, "
            f"{', '.join(ROLLOUT_CONVERTERS)}, fp8 / fp8_blockwise (rollout=vllm)."
        )
    return ROLLOUT_CONVERTERS[name]


@torch.no_grad()
def mismatch_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> Dict[str, float]:
    """How far the rollout engine's token log-probs are from the trainer's.

    Args:
        rollout_logprobs: ``[B, R]`` log-probs (nats) the rollout engine reported
            for the tokens it sampled.
        trainer_logprobs: ``[B, R]`` the trainer's log-probs of the same tokens
            under its weights at rollout time (``pi_old``).
        mask: ``[B, R]`` 1 on response tokens.
    Returns:
        ``mismatch/logprob_abs_mean`` and ``mismatch/logprob_abs_max`` (nats):
        mean and max ``|rollout - trainer|`` over masked tokens;
        ``mismatch/prob_corr``: Pearson correlation of the token probabilities
        ``exp(lp)`` of the two engines (1 when identical; 1 as well for fewer
        than two tokens or zero variance, where it is undefined);
        ``mismatch/is_ess_frac``: Kish effective sample size of the importance
        weights ``w = pi_trainer / pi_rollout`` divided by the token count, in
        (0, 1] (1 = no mismatch); ``mismatch/is_weight_max``: the largest weight.
        All zeros except ``prob_corr``/``ess`` (1) for an empty mask.
    """
    m = mask.float() > 0
    n = int(m.sum())
    if n == 0:
        return {"mismatch/logprob_abs_mean": 0.0, "mismatch/logprob_abs_max": 0.0, "mismatch/prob_corr": 1.0,
                "mismatch/is_ess_frac": 1.0, "mismatch/is_weight_max": 1.0}
    r = rollout_logprobs.float()[m]
    t = trainer_logprobs.float()[m]
    d = (r - t).abs()
    pr, pt = r.exp(), t.exp()
    corr = 1.0
    if n > 1:
        vr, vt = pr - pr.mean(), pt - pt.mean()
        den = (vr.pow(2).sum() * vt.pow(2).sum()).sqrt()
        if float(den) > 0:
            corr = float((vr * vt).sum() / den)
    w = torch.exp((t - r).clamp(-20, 20))
    ess_frac = float(w.sum() ** 2 / (w.pow(2).sum() * n))
    return {
        "mismatch/logprob_abs_mean": float(d.mean()),
        "mismatch/logprob_abs_max": float(d.max()),
        "mismatch/prob_corr": corr,
        "mismatch/is_ess_frac": ess_frac,
        "mismatch/is_weight_max": float(w.max()),
    }
