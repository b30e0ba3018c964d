"""``trainer=torch``: a plain single-process policy (and critic) update loop.

AdamW with warm-up and a schedule, gradient clipping, micro-batches with exact
gradient accumulation, log-probs computed only at response positions in
checkpointed chunks, optional reference model (KL) and critic (values), and
bf16 autocast. A non-finite loss or gradient skips the optimizer step; more than
``max_bad_steps`` in a row raise :class:`rlpost.core.errors.TrainingDiverged`.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.algos.aggregation import agg_count, aggregate
from rlpost.algos.corrections import compute_correction
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss, loss_extras, loss_token_draw
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.regularizers import kl_penalty, value_loss
from rlpost.algos.utils import masked_mean
from rlpost.algos.validate import loss_kwargs
from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError, TrainingDiverged
from rlpost.methods.base import ForwardPass, MethodSet
from rlpost.models.critic import ValueModel
from rlpost.models.logprobs import eval_mode, response_logprobs
from rlpost.models.lora import adapters_disabled, is_lora
from rlpost.rollout.precision import mismatch_metrics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_lambda(schedule: str, warmup: int, total: int):
    """Multiplier of the base learning rate at optimizer step ``s``.

    Linear warm-up over ``warmup`` steps, then ``constant``, ``linear`` decay to
    0 or ``cosine`` decay to 0 at ``total`` steps.

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr_schedule {schedule!r}; valid: constant, linear, cosine")

    def f(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (s - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - frac
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def token_budget_micro_batches(prompt_lens: List[int], response_lens: List[int], budget: int) -> List[List[int]]:
    """Pack rows into micro-batches whose padded size ``rows x (longest prompt + longest response)`` fits ``budget``.

    First-fit decreasing: rows in order of decreasing ``prompt + response``
    length (ties: lower row first), each into the first micro-batch it fits in,
    else a new one. Similar lengths end up together, so a long response no
    longer sets the width, and the memory, of a micro-batch of short ones; a row
    longer than the budget alone gets a micro-batch of its own. (Packing several
    sequences into one padding-free row needs variable-length attention kernels;
    with left-padded prompts and right-padded responses, sorting by length is
    what removes padding here.)

    Args:
        prompt_lens, response_lens: ``[B]`` real token counts of each row.
        budget: padded tokens per micro-batch (> 0).
    Returns:
        row indices of each micro-batch (ascending within one), every row exactly once.
    Raises:
        ValueError: ``budget <= 0`` or lengths of different sizes.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be > 0, got {budget}")
    if len(prompt_lens) != len(response_lens):
        raise ValueError("prompt_lens and response_lens differ in length")
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    bins: List[List[int]] = []
    shape: List[List[int]] = []  # per micro-batch: [rows, longest prompt, longest response]
    for i in order:
        p, r = int(prompt_lens[i]), int(response_lens[i])
        for b, (n, bp, br) in enumerate(shape):
            if (n + 1) * (max(bp, p) + max(br, r)) <= budget:
                bins[b].append(i)
                shape[b] = [n + 1, max(bp, p), max(br, r)]
                break
        else:
            bins.append([i])
            shape.append([1, p, r])
    return [sorted(b) for b in bins]


def row_lengths(batch: RolloutBatch) -> tuple:
    """``(prompt lengths, response widths)`` ``[B]`` lists: real prompt tokens, and the position after the
    last response token the model reads (``extras['response_attn']``, else the response mask)."""
    attn = batch.extras.get("response_attn", batch.response_mask)
    R = attn.shape[1]
    nz = (attn > 0).float()
    last = torch.where(nz.any(-1), R - nz.flip(-1).argmax(-1), torch.zeros(len(batch), dtype=torch.long))
    return [int(x) for x in batch.prompt_mask.sum(-1)], [int(x) for x in last]


def trim_batch(batch: RolloutBatch, trim_response: bool = True, width: Optional[int] = None) -> RolloutBatch:
    """``batch`` cut to its own widths: prompt columns that are padding in every row (left) and, with
    ``trim_response``, response columns after the last token any row reads (right; ``[B, R]`` extras too).

    Exact: positions come from the attention mask, so removing all-padding
    columns changes no log-prob, and responses are causal, so columns after a
    row's end never reach it. ``width`` (>= 1) also cuts the responses after
    their first ``width`` columns, real tokens included: the log-probs of the
    columns kept are unchanged (causality), those cut are not computed.
    """
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    pl, rl = row_lengths(batch)
    p = max(1, max(pl, default=1))
    r = max(1, max(rl, default=1)) if trim_response else R
    if width is not None:
        r = max(1, min(r, int(width)))
    if p == P and r == R:
        return batch
    out = RolloutBatch(**{**{k: getattr(batch, k) for k in ("group_index", "prompt_index", "policy_version", "rewards",
                                                            "response_texts", "answers", "meta")},
                          "prompt_ids": batch.prompt_ids[:, P - p:], "prompt_mask": batch.prompt_mask[:, P - p:],
                          "response_ids": batch.response_ids[:, :r], "response_mask": batch.response_mask[:, :r],
                          "rollout_logprobs": batch.rollout_logprobs[:, :r],
                          "extras": {k: (v[:, :r] if v.dim() == 2 and v.shape[1] == R else v)
                                     for k, v in batch.extras.items()}})
    return out


def drawn_widths(weights: torch.Tensor, mask: torch.Tensor) -> List[int]:
    """Per row ``[B]``: the position after the last response column whose drawn weight is non-zero on a
    response token (0 for a row with none): the columns the update's forward must compute for it."""
    need = (weights > 0) & (mask > 0)
    R = need.shape[1]
    last = torch.where(need.any(-1), R - need.flip(-1).long().argmax(-1), torch.zeros(need.shape[0], dtype=torch.long))
    return [int(x) for x in last]


def padded_tokens(batch: RolloutBatch) -> tuple:
    """``(real, padded)`` token counts of one micro-batch as the model sees it (prompt + response)."""
    attn = batch.extras.get("response_attn", batch.response_mask)
    real = float(batch.prompt_mask.sum() + (attn > 0).sum())
    return real, float(len(batch) * (batch.prompt_ids.shape[1] + batch.response_ids.shape[1]))


class _MetricAcc:
    """Weighted running means of scalar metrics over micro-batches."""

    def __init__(self) -> None:
        self.sums: Dict[str, float] = {}
        self.weights: Dict[str, float] = {}

    def add(self, metrics: Dict[str, Any], weight: float) -> None:
        for k, v in metrics.items():
            v = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
            if k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
                self.weights[k] = 1.0
                continue
            self.sums[k] = self.sums.get(k, 0.0) + v * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def means(self) -> Dict[str, float]:
        return {k: self.sums[k] / max(self.weights[k], 1e-12) for k in self.sums}


@dataclass
class _Update:
    """What the mini-batch steps of one :meth:`TorchTrainer.policy_update` share."""

    loss_params: Dict[str, Any]
    v_start: int
    need_entropy: bool
    entropy_grad: bool
    batch_stats: bool = False
    drawn_forward: bool = False  # the update's forward computes only the columns a token_draw needs
    fwd: List[float] = field(default_factory=lambda: [0.0, 0.0])  # update-forward tokens: computed, full
    pad: List[float] = field(default_factory=lambda: [0.0, 0.0])  # real, padded tokens (first epoch)
    mismatch: List[List[torch.Tensor]] = field(default_factory=lambda: [[], [], []])  # rollout lp, old lp, mask

    @staticmethod
    def norm_const(algo: Any, sampling: "SamplingSpec") -> float:
        return algo.loss_agg_norm or sampling.max_new_tokens


@dataclass(frozen=True)
class SamplingSpec:
    """The rollouts' sampling distribution, which the trainer's log-probs reproduce.

    Attributes:
        temperature: the sampling temperature (a per-token one comes in ``extras['temperatures']``).
        top_k: 0 = off.
        top_p: 1.0 = off.
        max_new_tokens: the response budget (the default ``algo.loss_agg_norm``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256

    @classmethod
    def of(cls, rollout_cfg: Any) -> "SamplingSpec":
        """From the ``rollout`` config group."""
        r = rollout_cfg
        return cls(float(r.temperature), int(r.top_k or 0), float(r.top_p if r.top_p is not None else 1.0),
                   int(r.max_new_tokens))


def reference_needed(algo_cfg: Any, methods: MethodSet) -> bool:
    """A frozen reference policy is needed: KL to it (``algo.kl.coef > 0``), a loss tagged ``needs_ref``
    or a method asking for one (:class:`rlpost.methods.base.Needs`)."""
    return (float(algo_cfg.kl.coef) > 0 or bool(POLICY_LOSSES.tag(str(algo_cfg.loss), "needs_ref", False))
            or methods.needs().reference_policy)


class TorchTrainer:
    """Owns the policy, its optimizer, and optionally a reference model and a critic.

    Args:
        policy: the causal LM being trained (fp32 master weights).
        tcfg: the ``trainer`` config group (optimizer, micro-batching, log-prob chunks).
        algo: the ``algo`` config group (loss, aggregation, epochs, KL, critic).
        device: training device.
        precision: the ``precision`` config group (``trainer_dtype``, ``correction``).
        sampling: the rollouts' distribution (:class:`SamplingSpec`).
        steps: RL steps of the run (the schedule's length).
        seed: the run seed (the seeds of a loss's random draws derive from it).
        methods: the run's hook-using methods (:class:`rlpost.methods.base.MethodSet`).
    Use :meth:`from_config` to build one from a whole run config.
    """

    def __init__(self, policy: torch.nn.Module, tcfg: Any, algo: Any, device: torch.device | str = "cpu", *,
                 precision: Any, sampling: SamplingSpec = SamplingSpec(), steps: int = 1, seed: int = 0,
                 methods: Optional[MethodSet] = None) -> None:
        self.algo = algo
        self.tcfg = tcfg
        self.precision = precision
        self.sampling = sampling
        self.seed = int(seed)
        self.methods = methods if methods is not None else MethodSet()
        self.device = torch.device(device)
        self.policy = policy.to(self.device)
        self.policy.train()
        # The module the policy loss differentiates; DeepSpeed ZeRO-3 trains a partitioned one while
        # ``policy`` stays a full-weight copy for rollouts and checkpoints.
        self.train_module: torch.nn.Module = self.policy
        self.dtype = DTYPES[precision.trainer_dtype]
        self.opt = self._make_optimizer(self.policy.parameters(), self.tcfg.lr)
        total = max(1, int(steps) * self.algo.ppo_epochs * self.algo.mini_batches)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(self.tcfg.lr_schedule, self.tcfg.warmup_steps, total)
        )
        # LoRA: the optimizer holds only the adapters (the only parameters requiring grad), and the KL
        # reference is the same module with its adapters disabled (no second copy of the weights).
        self.lora = is_lora(self.policy)
        self.wants_ref = reference_needed(algo, self.methods)
        self.ref: Optional[torch.nn.Module] = None
        if self.wants_ref and not self.lora:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.critic: Optional[ValueModel] = None
        self.critic_opt = None
        if self.algo.critic.enabled:
            shared = bool(self.algo.critic.get("shared_backbone", False))
            if shared and (self.lora or type(self).__name__ != "TorchTrainer"):
                raise ConfigError("algo.critic.shared_backbone=true needs trainer.engine=torch without LoRA (the critic's "
                                  "optimizer updates the policy's own backbone). Fix: algo.critic.shared_backbone=false.")
            self.critic = ValueModel(self.policy, shared=shared,
                                     num_heads=int(self.algo.critic.get("num_heads", 1) or 1)).to(self.device)
            self.critic_opt = self._make_optimizer(self.critic.parameters(), self.algo.critic.lr)
        # MoE routing replay (model.routing_replay; rlpost.models.moe_replay.attach_routing sets it)
        self.routing: Optional[Any] = None
        self.bad_steps = 0
        self.version = 0  # number of policy optimizer steps taken
        self.updates = 0  # number of policy_update calls (the entropy metric's interval counts these)
        self.loss_state: Dict[str, Any] = {}  # losses' cross-step state (extras key loss_state; tag after_step)

    @classmethod
    def from_config(cls, policy: torch.nn.Module, cfg: Any, device: torch.device | str = "cpu",
                    methods: Optional[MethodSet] = None, **kw: Any) -> "TorchTrainer":
        """A trainer from a whole run config: each group handed to its owner (``methods``: the config's own)."""
        return cls(policy, cfg.trainer, cfg.algo, device, precision=cfg.precision, sampling=SamplingSpec.of(cfg.rollout),
                   steps=int(cfg.steps), seed=int(cfg.seed),
                   methods=methods if methods is not None else MethodSet.for_config(cfg), **kw)

    # ----------------------------------------------------------------- helpers
    #: torch's fused AdamW kernel (CPU and CUDA): one pass over each parameter's weight, gradient and
    #: moments instead of the multi-tensor (foreach) implementation's sequence of whole-list ops and
    #: their full-size temporaries. Same update up to float rounding (tests/test_trainer_speed.py).
    #: Engines that hand the optimizer to another library (DeepSpeed) turn it off.
    fused_adamw = True

    def _make_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        fused = (self.fused_adamw and bool(params) and self.device.type in ("cpu", "cuda")
                 and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params))
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=tuple(self.tcfg.betas),
            weight_decay=self.tcfg.weight_decay,
            **({"fused": True} if fused else {}),
        )

    def autocast(self):
        """bf16/fp16 autocast context for forward passes (no-op for fp32)."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _micro_slices(self, n: int) -> List[slice]:
        mb = max(1, int(self.tcfg.micro_batch_size))
        return [slice(i, min(n, i + mb)) for i in range(0, n, mb)]

    @property
    def token_budget(self) -> int:
        """``trainer.max_tokens_per_micro_batch`` (0: micro-batches of ``trainer.micro_batch_size`` rows)."""
        return int(self.tcfg.get("max_tokens_per_micro_batch", 0) or 0)

    def _split(self, batch: RolloutBatch, trim_response: bool = True) -> List[tuple]:
        """``(rows, micro-batch)`` pairs covering ``batch``: by token budget (cut to their own widths) when
        ``trainer.max_tokens_per_micro_batch > 0``, else consecutive slices of ``micro_batch_size`` rows.
        A mini-batch carrying a loss's drawn ``token_weights`` whose update forward computes only the drawn
        columns (:meth:`_drawn_forward_ok`) is split by those widths (:func:`drawn_widths`): rows in order of
        decreasing drawn width, or packed by it under a token budget (the gradient does not depend on the split)."""
        n = len(batch)
        drawn = trim_response and "token_weights" in batch.extras and self._drawn_forward_ok()
        widths = drawn_widths(batch.extras["token_weights"], batch.response_mask) if drawn else None
        if self.token_budget <= 0:
            # drawn subset: rows of similar drawn width together, so each micro-batch's forward is cut short
            order = sorted(range(n), key=lambda i: (-widths[i], i)) if widths is not None else list(range(n))
            return [(sorted(order[sl]), batch.select(sorted(order[sl]))) for sl in self._micro_slices(n)]
        pl, rl = row_lengths(batch)
        if not trim_response:
            rl = [batch.response_ids.shape[1]] * n
        elif widths is not None:
            rl = [min(a, b) for a, b in zip(rl, widths)]
        return [(rows, trim_batch(batch.select(rows), trim_response))
                for rows in token_budget_micro_batches(pl, rl, self.token_budget)]

    def _temperature(self, batch: RolloutBatch):
        t = batch.extras.get("temperatures")
        return t if t is not None else float(self.sampling.temperature)

    def _truncation(self) -> Dict[str, Any]:
        """The sampler's top-k/top-p, so trainer log-probs are those of the distribution rollouts came from.

        Off when a method trains on tokens that were not sampled (``Needs.untruncated``):
        truncation would cut the gradient of every such token outside the model's
        nucleus. See docs/ALGORITHMS.md ("Sampling distribution parity").
        """
        if self.methods.needs().untruncated:
            return {"top_k": 0, "top_p": 1.0}
        return {"top_k": self.sampling.top_k, "top_p": self.sampling.top_p}

    def forward_pass(self, model: Optional[torch.nn.Module] = None, seed: Optional[int] = None) -> ForwardPass:
        """This trainer's forward machinery for a method's hooks (:class:`rlpost.methods.base.ForwardPass`)."""
        return ForwardPass(model=model if model is not None else self.train_module, policy=self.policy,
                           device=self.device, autocast=self.autocast, temperature=self._temperature,
                           truncation=self._truncation(), chunk_size=int(self.tcfg.logprob_chunk_size),
                           logprobs=self._logprobs, betas=tuple(float(b) for b in self.tcfg.betas),
                           lr=lambda: float(self.sched.get_last_lr()[0]), loss_state=self.loss_state, seed=seed,
                           multi_process=self.lockstep)

    def _logprobs(self, model, batch: RolloutBatch, with_entropy: bool = False, entropy_grad: bool = False):
        attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
        T = self._temperature(batch)
        replay = (self.routing.context(batch.prompt_ids, batch.prompt_mask, batch.response_ids, attn)
                  if self.routing is not None and model is not self.ref else nullcontext())
        with self.autocast(), replay, self.methods.logprob_context(model, batch):
            return response_logprobs(
                model,
                batch.prompt_ids.to(self.device),
                batch.prompt_mask.to(self.device),
                batch.response_ids.to(self.device),
                attn.to(self.device),
                temperature=T,
                chunk_size=self.tcfg.logprob_chunk_size,
                with_entropy=with_entropy,
                **self._truncation(),
                entropy_grad=entropy_grad,
                # routing replay maps routes onto one full [B, P + R] forward: no shared-prompt pass
                **({"share_prefix": False} if self.routing is not None else {}),
            )

    def _drawn_logprobs(self, model, mb: RolloutBatch, need: torch.Tensor, with_entropy: bool = False,
                        entropy_grad: bool = False):
        """The update's log-probs of micro-batch ``mb`` computed only where a drawn subset needs them.

        The forward runs on the rows with at least one needed position, cut after
        the micro-batch's last needed response column (prompt-padding columns
        trimmed): a causal LM's log-prob at a kept position does not depend on
        later tokens, so the values there are those of the full forward (up to
        float summation order). With no needed position the forward runs on row
        0's first response column, so the loss stays on the autograd graph.

        Args:
            need: ``[b, R]`` bool, the positions the loss reads.
        Returns:
            ``(logprobs [b, R], entropy [b, R] or None, computed [b, R] bool, (forward tokens, full tokens))``:
            the positions not computed hold the micro-batch's ``old_logprobs``
            (else its rollout log-probs), detached, and entropy 0; the last pair
            counts padded prompt + response tokens of the forward run and of ``mb``.
        """
        b, R = mb.response_ids.shape
        rows = need.any(-1).nonzero().squeeze(-1)
        if rows.numel() == 0:
            rows, width = torch.zeros(1, dtype=torch.long), 1
        else:
            width = max(drawn_widths(need[rows].float(), mb.response_mask[rows]))
        sub = trim_batch(mb.select(rows), True, width)
        lp_s, ent_s = self._logprobs(model, sub, with_entropy=with_entropy, entropy_grad=entropy_grad)
        r = lp_s.shape[1]
        attn = sub.extras.get("response_attn", (sub.response_mask > 0).long())[:, :r] > 0
        rows_d = rows.to(self.device)
        computed = torch.zeros(b, R, dtype=torch.bool, device=self.device)
        computed[rows_d, :r] = attn.to(self.device)
        fill = mb.extras.get("old_logprobs", mb.rollout_logprobs)[:, :R].to(self.device).float()

        def scatter(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
            wide = torch.nn.functional.pad(x.float(), (0, R - r))
            return torch.where(computed, torch.zeros(b, R, device=self.device).index_copy(0, rows_d, wide), base)

        lp = scatter(lp_s, fill)
        ent = None if ent_s is None else scatter(ent_s, torch.zeros(b, R, device=self.device))
        full = float(len(mb) * (mb.prompt_ids.shape[1] + R))
        return lp, ent, computed, (float(sub.prompt_ids.numel() + sub.response_ids.numel()), full)

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
        with self.autocast():
            return self.critic(
                batch.prompt_ids.to(self.device),
                batch.prompt_mask.to(self.device),
                batch.response_ids.to(self.device),
                attn.to(self.device),
            )

    @property
    def has_ref(self) -> bool:
        """Whether a KL reference policy exists: a frozen copy, or (LoRA) the base model under the adapters."""
        return self.ref is not None or (self.lora and self.wants_ref)

    # -------------------------------------------------------- no-grad passes
    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, which: str = "policy", with_entropy: bool = False):
        """Log-probs ``[B, R]`` (and entropy) of the batch's responses under ``policy`` or ``ref``.

        With LoRA the reference is the policy module with its adapters disabled
        (:func:`rlpost.models.lora.adapters_disabled`): exactly the base model's log-probs.

        Raises:
            ValueError: ``which="ref"`` without a reference policy (``algo.kl.coef == 0``).
        """
        if which != "policy" and not self.has_ref:
            raise ValueError(f"no {which} model (set algo.kl.coef > 0 for a reference model)")
        model = self.policy if (which == "policy" or self.ref is None) else self.ref
        base = adapters_disabled(model) if (which != "policy" and self.ref is None) else nullcontext()
        B, R = len(batch), batch.response_ids.shape[1]
        lps, ents = torch.zeros(B, R), None
        with eval_mode(model), base:
            for rows, mb in self._split(batch):
                lp, ent = self._logprobs(model, mb, with_entropy)
                idx = torch.tensor(rows, dtype=torch.long)
                lps[idx, : lp.shape[1]] = lp.float().cpu()
                if ent is not None:
                    ents = torch.zeros(B, R) if ents is None else ents
                    ents[idx, : ent.shape[1]] = ent.float().cpu()
        return lps, ents

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Critic values ``[B, R]`` at rollout time (``[B, R, N]`` with ``algo.critic.num_heads=N > 1``)."""
        n = self.critic.num_heads
        out = torch.zeros(len(batch), batch.response_ids.shape[1], *((n,) if n > 1 else ()))
        for rows, mb in self._split(batch):
            v = self._values(mb).float().cpu()
            out[torch.tensor(rows, dtype=torch.long), : v.shape[1]] = v
        return out * (batch.response_mask.unsqueeze(-1) if n > 1 else batch.response_mask)

    # ---------------------------------------------------------------- updates
    def _correction_weights(self, old_lp: torch.Tensor, batch: RolloutBatch):
        name = self.precision.correction
        if name in (None, "none"):
            return None, {}
        return compute_correction(
            name, old_lp, batch.rollout_logprobs.to(old_lp.device), batch.response_mask.to(old_lp.device),
            **dict(self.precision.correction_params or {}),
        )

    def _finite_step(self, opt, params, max_norm: float) -> float:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        if max_norm and max_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        gn = float(gn)
        if not math.isfinite(gn):
            opt.zero_grad(set_to_none=True)
            return gn
        opt.step()
        opt.zero_grad(set_to_none=True)
        return gn

    # ------------------------------------------------ engine hooks (DeepSpeed overrides)
    def _micro_batches(self, mini: RolloutBatch, trim_response: bool = True) -> List[RolloutBatch]:
        """The micro-batches of ``mini`` this process computes (all of them here; see :meth:`_split`)."""
        return [mb for _, mb in self._split(mini, trim_response)]

    def _backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (already divided by the mini-batch denominator)."""
        loss.backward()

    def _policy_step(self, params) -> float:
        """Clip, apply and zero the accumulated policy gradient; returns its norm (non-finite: skipped)."""
        return self._finite_step(self.opt, params, self.tcfg.grad_clip)

    def _skip_policy_step(self) -> None:
        """Drop the accumulated policy gradient without stepping."""
        self.opt.zero_grad(set_to_none=True)

    def _any(self, flag: bool) -> bool:
        """True if ``flag`` is true on any process (one process here)."""
        return flag

    def _gather(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Every process's tensors (one process here)."""
        return tensors

    def _reduce_metrics(self, acc: "_MetricAcc") -> "_MetricAcc":
        """Combine metric accumulators across processes (one process here)."""
        return acc

    # Processes must run the same forward/backward passes (DeepSpeed ZeRO's collectives).
    lockstep = False

    # ---------------------------------------------------------------- updates
    def _drawn_forward_ok(self) -> bool:
        """Whether the update's forward may leave out the positions a loss's ``token_draw`` did not draw.

        ``trainer.drawn_forward`` (default on), a loss tagged ``token_draw``, and nothing
        else in the update reading the other positions: no entropy bonus
        (``algo.entropy_coef``), no KL penalty in the loss, no rollout/trainer
        ``precision.correction``, no MoE routing replay (it maps routes onto one full
        forward) and no hook-using method (its forward, proximal log-probs or
        observed weights may read any position). Otherwise every position goes
        forward: the same loss and gradient, without the saving.
        """
        a = self.algo
        kl_in_loss = float(a.kl.coef) > 0 and not bool(a.kl.in_reward)
        return (bool(self.tcfg.get("drawn_forward", True)) and loss_token_draw(str(a.loss)) is not None
                and not a.entropy_coef and not kl_in_loss and self.routing is None and not self.methods.names
                and self.precision.correction in (None, "none"))

    def _entropy_need(self) -> tuple:
        """``(compute, with_grad)`` for this update's entropy.

        With gradient only for an entropy bonus (``algo.entropy_coef != 0``); as
        a constant for losses tagged ``needs_entropy`` and for the ``actor/entropy``
        metric every ``trainer.entropy_every`` updates; otherwise not at all.
        """
        grad = bool(self.algo.entropy_coef)
        every = int(self.tcfg.get("entropy_every", 1))
        metric = every > 0 and self.updates % every == 0
        return (grad or metric or bool(POLICY_LOSSES.tag(self.algo.loss, "needs_entropy", False))), grad

    def _old_logprobs(self, mb: RolloutBatch, lp: torch.Tensor, v_start: int) -> torch.Tensor:
        """The proximal log-probs ``[b, R]`` of micro-batch ``mb`` given its current log-probs ``lp``: the
        recorded ``old_logprobs``, else a method's (:meth:`rlpost.methods.base.Method.proximal`), else ``lp``
        detached."""
        old = mb.extras.get("old_logprobs")
        if old is not None:
            return old.to(self.device)
        prox = self.methods.proximal(mb, lp, v_start, self.version)
        return prox if prox is not None else lp.detach()

    def _extras(self, mb: RolloutBatch, keys: Tuple[str, ...], given: Dict[str, Any]) -> Dict[str, Any]:
        """The loss's declared extra inputs of ``mb``: from ``given`` (its forward and the methods'
        ``loss_extras``), else ``mb.extras`` (on the device), ``loss_state`` from the trainer."""
        out: Dict[str, Any] = {}
        R = mb.response_ids.shape[1]
        for k in keys:
            if k in given:
                out[k] = given[k]
            elif k == "loss_state":
                out[k] = self.loss_state
            elif k in mb.extras:
                v = mb.extras[k]
                out[k] = (v[:, :R] if v.dim() >= 2 and v.shape[1] > R else v).to(self.device)
        return out

    @torch.no_grad()
    def _whole_batch_input(self, mini: RolloutBatch, v_start: int) -> PolicyLossInput:
        """The detached whole mini-batch for losses with batch statistics (:func:`rlpost.algos.losses.batch_view`).

        One extra no-grad forward over ``mini`` under the current weights, which
        are those of every micro-batch's forward until the optimizer step, run
        only when the loss is tagged ``batch_statistics`` and ``mini`` spans
        more than one micro-batch.
        """
        lps, ents, olds = [], [], []
        for sl in self._micro_slices(len(mini)):
            part = mini.select(list(range(len(mini)))[sl])
            lp, ent = self._logprobs(self.train_module, part, with_entropy=True)
            lps.append(lp.float())
            ents.append(ent.float())
            olds.append(self._old_logprobs(part, lp, v_start).float())
        return PolicyLossInput(
            logprobs=torch.cat(lps), old_logprobs=torch.cat(olds), entropy=torch.cat(ents),
            advantages=mini.extras["advantages"].to(self.device), response_mask=mini.response_mask.to(self.device),
            group_index=mini.group_index.to(self.device),
            extras=self._extras(mini, tuple(k for k in self.loss_keys if k in mini.extras), {}),
        )

    @property
    def loss_keys(self) -> Tuple[str, ...]:
        """The extra input keys the loss declares (:func:`rlpost.algos.losses.loss_extras`)."""
        return loss_extras(str(self.algo.loss))

    def policy_update(self, batch: RolloutBatch, rng: Optional[torch.Generator] = None) -> Dict[str, float]:
        """PPO-style update over ``algo.ppo_epochs`` x ``algo.mini_batches`` optimizer steps.

        Reads ``batch.extras['advantages']`` ``[B, R]`` and, when present,
        ``old_logprobs`` and ``ref_logprobs``. When absent (single on-policy
        pass) the old log-probs are a method's proximal ones or the current ones
        detached, so the importance ratio is exactly 1 on the first micro-batch.
        The run's methods may replace the forward pass of a micro-batch, add
        loss inputs and scale a step's learning rate (:mod:`rlpost.methods.base`).

        Returns:
            metrics averaged over micro-batches: ``loss/policy``, ``actor/entropy``,
            ``actor/clip_frac``, ``actor/ratio_mean``, ``actor/grad_norm``,
            ``actor/kl_ref``, ``rollout/logprob_gap``, ``actor/lr``, ``bench/padding_frac``
            and the rollout/trainer mismatch ``mismatch/*`` of
            :func:`rlpost.rollout.precision.mismatch_metrics` (trainer side: the
            old log-probs) ...
        Raises:
            TrainingDiverged: too many consecutive non-finite steps.
        """
        a = self.algo
        acc = _MetricAcc()
        u = _Update(loss_kwargs(a), self.version, *self._entropy_need(),
                    batch_stats=bool(POLICY_LOSSES.tag(a.loss, "batch_statistics", False)),
                    drawn_forward=self._drawn_forward_ok())
        self.updates += 1
        if self.routing is not None:
            self.routing.begin_update()  # snapshot the routers its predictor is refitted from
        B = len(batch)
        for epoch in range(a.ppo_epochs):
            order = torch.randperm(B, generator=rng) if (rng is not None and a.mini_batches > 1) else torch.arange(B)
            minis = [order[i :: a.mini_batches] if a.mini_batches > 1 else order for i in range(a.mini_batches)]
            for mini_no, mini_idx in enumerate(minis):
                self._mini_batch_step(batch.select(mini_idx), u, acc, epoch, mini_no)
        out = self._reduce_metrics(acc).means()
        real, padded = (sum(x) for x in zip(*self._gather([torch.tensor(u.pad)])))
        out["bench/padding_frac"] = float(1.0 - real / padded) if padded > 0 else 0.0
        if u.drawn_forward:  # padded tokens the update's forward ran, as a share of the micro-batches' own
            done, full = (sum(x) for x in zip(*self._gather([torch.tensor(u.fwd)])))
            out["bench/update_forward_frac"] = float(done / full) if full > 0 else 1.0
        if u.mismatch[0]:
            rl, ol, mk = (_cat_padded(self._gather(t)) for t in u.mismatch)
            out.update(mismatch_metrics(rl, ol, mk))
        out["actor/lr"] = float(self.sched.get_last_lr()[0])
        if self.routing is not None:
            self.routing.end_update()
            out.update(self.routing.metrics())
        return out

    def _mini_batch_step(self, mini: RolloutBatch, u: "_Update", acc: "_MetricAcc", epoch: int, mini_no: int) -> None:
        """Accumulate the gradient of one mini-batch over its micro-batches, then one optimizer step."""
        denom = agg_count(self.algo.loss_agg, mini.response_mask)
        mini.extras["_row"] = torch.arange(len(mini))
        # One seed per mini-batch, shared by its micro-batches (and by every process, so a
        # distributed engine draws the same tokens everywhere), for losses that sample tokens.
        mini_seed = self.seed * 1_000_003 + self.version * 1009 + epoch * 31 + mini_no
        draw = loss_token_draw(str(self.algo.loss))
        if draw is not None:  # the loss's token subset, drawn before any forward (loss_token_draw)
            m_all = (mini.response_mask > 0).float()
            w = draw(m_all.cpu(), torch.Generator(device="cpu").manual_seed(mini_seed), **u.loss_params).float()
            mini.extras["token_weights"] = w
            acc.add({"actor/drawn_frac": masked_mean(((w > 0).float() * m_all), m_all)}, float(m_all.sum()))
        # losses with batch statistics index the whole mini-batch: keep its response width
        micro = self._micro_batches(mini, trim_response=not u.batch_stats)
        if epoch == 0:
            for mb in micro:
                real, padded = padded_tokens(mb)
                u.pad[0] += real
                u.pad[1] += padded
        whole = self._whole_batch_input(mini, u.v_start) if (len(micro) > 1 and u.batch_stats) else None
        fwd = self.forward_pass(self.train_module, mini_seed)
        bad, lm = False, {}
        for mb in micro:
            loss, lp, lm, metrics = self._micro_loss(mb, fwd, u, acc, denom, whole, epoch)
            if not torch.isfinite(loss):
                bad = True
                if not self.lockstep:
                    break
                loss = lp.sum() * 0.0  # keep collective backward passes in step; the step is skipped
            self._backward(loss)
            m = mb.response_mask
            acc.add(metrics[0], metrics[2])  # token means, weighted by their tokens
            acc.add(metrics[1], float((m.sum(-1) > 0).sum()))  # sequence means, weighted by sequences
        self._optimizer_step(bad, lm, u, acc)

    def _micro_loss(self, mb: RolloutBatch, fwd: ForwardPass, u: "_Update", acc: "_MetricAcc", denom: float,
                    whole: Optional[PolicyLossInput], epoch: int) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any], tuple]:
        """The aggregated loss of one micro-batch (its share of the mini-batch's), its log-probs, the loss's
        metrics and ``(token metrics, sequence metrics, tokens the token metrics average over)`` to log once its
        backward ran. With a loss's drawn ``token_weights`` the token metrics average over the drawn tokens, and
        the forward computes only the columns they need when :meth:`_drawn_forward_ok`."""
        a = self.algo
        m = mb.response_mask.to(self.device)
        out = self.methods.forward(fwd, mb, u.need_entropy, u.entropy_grad)
        # a loss's drawn token subset: the token metrics are means over it (the positions it reads)
        tw = mb.extras.get("token_weights")
        mm = m if tw is None else ((tw.to(self.device) > 0) & (m > 0)).to(m.dtype)
        if out is None and tw is not None and u.drawn_forward:
            lp, ent, _computed, (done, full) = self._drawn_logprobs(
                self.train_module, mb, mm > 0, with_entropy=u.need_entropy, entropy_grad=u.entropy_grad)
            u.fwd[0] += done
            u.fwd[1] += full
            given: Dict[str, Any] = {}
        elif out is None:
            lp, ent = self._logprobs(self.train_module, mb, with_entropy=u.need_entropy, entropy_grad=u.entropy_grad)
            given = {}
        else:
            lp, ent, given = out
        given = {**given, **self.methods.loss_extras(fwd, mb)}
        old = self._old_logprobs(mb, lp, u.v_start)
        self.methods.observe_weights(mb, old)
        if epoch == 0:
            for rows, t in zip(u.mismatch, (mb.rollout_logprobs, old.detach(), mm.cpu())):
                rows.append(t.cpu())
        inp = PolicyLossInput(
            logprobs=lp, old_logprobs=old, advantages=mb.extras["advantages"].to(self.device), response_mask=m,
            rollout_logprobs=mb.rollout_logprobs.to(self.device), entropy=None if ent is None else ent.detach(),
            group_index=mb.group_index.to(self.device), step=self.updates - 1,
            seed=fwd.seed if u.batch_stats else None, batch=whole,
            rows=mb.extras["_row"].to(self.device) if whole is not None else None,
            extras=self._extras(mb, self.loss_keys, given),
        )
        loss_mat, lm = compute_policy_loss(a.loss, inp, **u.loss_params)
        w, wm = self._correction_weights(old, mb)
        if w is not None:
            loss_mat = loss_mat * w.to(loss_mat.device)
            lm.update({f"correction/{k}": v for k, v in wm.items()})
        loss = aggregate(a.loss_agg, loss_mat, m, denom=denom, norm_const=u.norm_const(a, self.sampling))
        # Logged loss: the micro-batch's own aggregate, weighted by its share of the mini-batch
        # denominator, so the weighted mean is the mini-batch loss whatever trainer.micro_batch_size
        # is (a token-count weight was wrong for seq-* modes).
        n_agg = agg_count(a.loss_agg, m)
        acc.add({"loss/policy": loss.detach() * (max(denom, 1.0) / max(n_agg, 1.0))}, n_agg)
        metrics: Dict[str, Any] = {}
        if self.has_ref and "ref_logprobs" in mb.extras and not a.kl.in_reward:
            kl = kl_penalty(a.kl.estimator, lp, mb.extras["ref_logprobs"].to(self.device))
            loss = loss + a.kl.coef * aggregate(a.loss_agg, kl, m, denom=denom, norm_const=u.norm_const(a, self.sampling))
            metrics["actor/kl_ref"] = masked_mean(kl.detach(), mm)
        if ent is not None:
            if a.entropy_coef:
                loss = loss - a.entropy_coef * aggregate(a.loss_agg, ent, m, denom=denom,
                                                         norm_const=u.norm_const(a, self.sampling))
            metrics["actor/entropy"] = masked_mean(ent.detach(), mm)
        with torch.no_grad():
            metrics["rollout/logprob_gap"] = masked_mean((lp.detach() - inp.rollout_logprobs).abs(), mm)
        seq_metrics: Dict[str, Any] = {}
        for k, v in lm.items():
            (seq_metrics if k.startswith("seq_") else metrics)[k if "/" in k else f"actor/{k}"] = v
        return loss, lp, lm, (metrics, seq_metrics, float(mm.sum()))

    def _optimizer_step(self, bad: bool, lm: Dict[str, Any], u: "_Update", acc: "_MetricAcc") -> None:
        """Step on the accumulated gradient (a method may scale its learning rate), or skip a non-finite one."""
        scale, sm = self.methods.lr_scale()
        if sm:
            acc.add(sm, 1.0)
        if self._any(bad):
            self._skip_policy_step()
            gn = float("nan")
        else:
            base_lrs = [g["lr"] for g in self.opt.param_groups]
            for g in self.opt.param_groups:
                g["lr"] = g["lr"] * scale
            try:
                gn = self._policy_step([p for p in self.train_module.parameters() if p.requires_grad])
            finally:
                for g, lr0 in zip(self.opt.param_groups, base_lrs):
                    g["lr"] = lr0
        if not math.isfinite(gn):
            self.bad_steps += 1
            acc.add({"actor/skipped_steps": 1.0}, 1.0)
            if self.bad_steps > self.tcfg.max_bad_steps:
                raise TrainingDiverged(
                    f"{self.bad_steps} consecutive optimizer steps had a non-finite loss or gradient; "
                    "the last checkpoint is intact. Fix: lower trainer.lr, enable trainer.grad_clip, "
                    "or use precision=fp32."
                )
        else:
            self.bad_steps = 0
            self.version += 1
            acc.add({"actor/grad_norm": gn, "actor/skipped_steps": 0.0}, 1.0)
            after = POLICY_LOSSES.tag(self.algo.loss, "after_step", None)
            if after is not None:  # a loss's cross-step state, from the last micro-batch's statistics
                after(self.loss_state, lm, **u.loss_params)
        self.sched.step()

    def critic_update(self, batch: RolloutBatch) -> Dict[str, float]:
        """Regress the critic on ``batch.extras['returns']`` (token-mean clipped value loss).

        The loss mask is ``extras['value_mask']`` (an estimator's value positions) or
        the response mask, unless a method chooses the states
        (:meth:`rlpost.methods.base.Method.critic_batch`, once per update for the
        whole batch, so every micro-batch and process uses the same ones). A
        micro-batch whose loss is non-finite on any process is skipped. With N value heads
        (``algo.critic.num_heads``) values and returns are ``[B, R, N]``: each head is regressed on
        its own returns under the same mask and the heads' token-mean losses are summed.
        """
        a = self.algo
        acc = _MetricAcc()
        self.critic.train()
        batch = batch.select(list(range(len(batch))))  # the caller's batch is not modified
        vm0 = batch.extras.get("value_mask")
        batch.extras["_critic_mask"] = (batch.response_mask if vm0 is None else vm0).float()
        batch = self.methods.critic_batch(batch, self.seed * 1_000_003 + self.version)
        for _ in range(max(1, a.critic.epochs)):
            denom = float(batch.extras["_critic_mask"].sum())
            for mb in self._micro_batches(batch):
                m = mb.extras["_critic_mask"].to(self.device)
                v = self._values(mb)
                old_v = mb.extras.get("values", v.detach()).to(self.device)
                mh = m.unsqueeze(-1).expand_as(v) if v.dim() == 3 else m  # N heads: one mask per head
                loss_mat, vm = value_loss(v, old_v, mb.extras["returns"].to(self.device), mh, a.critic.clip_range)
                if v.dim() == 3:
                    loss_mat = loss_mat.sum(-1)  # the heads' losses add up; metrics below are per head-token
                loss = a.critic.coef * aggregate("token-mean", loss_mat, m, denom=denom)
                if self._any(not bool(torch.isfinite(loss))):
                    continue
                self._critic_backward(loss)
                if float(m.sum()) > 0:
                    nh = v.shape[-1] if v.dim() == 3 else 1
                    acc.add({"critic/value_loss": (loss_mat.detach() * m).sum() / m.sum().clamp(min=1) / nh,
                             **{f"critic/{k}": x for k, x in vm.items()},
                             "critic/value_mean": masked_mean(v.detach(), mh)}, float(m.sum()))
            acc.add({"critic/grad_norm": self._critic_step()}, 1.0)
        return self._reduce_metrics(acc).means()

    def _critic_backward(self, loss: torch.Tensor) -> None:
        """Accumulate the critic's gradient of ``loss`` (DeepSpeed overrides)."""
        loss.backward()

    def _critic_step(self) -> float:
        """Apply the critic's accumulated gradient; returns its norm (DeepSpeed overrides)."""
        return self._finite_step(self.critic_opt, [p for p in self.critic.parameters() if p.requires_grad],
                                 self.tcfg.grad_clip)

    # ------------------------------------------------------------ snapshots
    def snapshot(self) -> Dict[str, Any]:
        """An exact copy of the policy weights, optimizer state and schedule (:meth:`restore` puts it back)."""
        return {"weights": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
                "opt": copy.deepcopy(self.opt.state_dict()), "sched": copy.deepcopy(self.sched.state_dict())}

    def restore(self, snap: Dict[str, Any]) -> None:
        """Put a :meth:`snapshot` back: weights in place, optimizer state and schedule."""
        with torch.no_grad():
            sd = self.policy.state_dict()
            for k, v in snap["weights"].items():
                sd[k].copy_(v)
        self.opt.load_state_dict(copy.deepcopy(snap["opt"]))
        self.sched.load_state_dict(copy.deepcopy(snap["sched"]))

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Optimizer, scheduler, critic and counters (the policy is saved in HF format separately)."""
        sd: Dict[str, Any] = {
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "bad_steps": self.bad_steps,
            "version": self.version,
            "updates": self.updates,
            "loss_state": dict(self.loss_state),
        }
        if self.critic is not None:
            sd["critic"] = self.critic.state_dict()
            sd["critic_opt"] = self.critic_opt.state_dict()
        if self.ref is not None:
            sd["ref"] = self.ref.state_dict()
        routing = self.routing.state_dict() if self.routing is not None else {}
        if routing:
            sd["routing"] = routing  # the routing predictor's state
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the policy weights were loaded)."""
        self.opt.load_state_dict(sd["opt"])
        self.sched.load_state_dict(sd["sched"])
        self.bad_steps = int(sd.get("bad_steps", 0))
        self.version = int(sd.get("version", 0))
        self.updates = int(sd.get("updates", 0))
        # numbers (a multiplier) as floats; structured state (e.g. shadow optimizer moments) as saved
        self.loss_state = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in sd.get("loss_state", {}).items()}
        if self.critic is not None and "critic" in sd:
            self.critic.load_state_dict(sd["critic"])
            self.critic_opt.load_state_dict(sd["critic_opt"])
        if self.ref is not None and "ref" in sd:
            self.ref.load_state_dict(sd["ref"])
        if self.routing is not None and "routing" in sd:
            self.routing.load_state_dict(sd["routing"])


def _cat_padded(ts: List[torch.Tensor]) -> torch.Tensor:
    R = max(t.shape[1] for t in ts)
    return torch.cat([torch.nn.functional.pad(t, (0, R - t.shape[1])) for t in ts])
