"""``trainer=torch``: a plain single-process policy (and critic) update loop.

AdamW with warm-up and a schedule, gradient clipping, micro-batches with exact
gradient accumulation, log-probs computed only at response positions in
checkpointed chunks, optional reference model (KL) and critic (values), and
bf16 autocast. A non-finite loss or gradient skips the optimizer step; more than
``max_bad_steps`` in a row raise :class:`rlpost.errors.TrainingDiverged`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Dict, List, Optional

import torch

from rlpost.algos.aggregation import agg_count, aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.regularizers import kl_penalty, value_loss
from rlpost.algos.utils import masked_mean
from rlpost.batch import RolloutBatch
from rlpost.errors import TrainingDiverged
from rlpost.models.critic import ValueModel
from rlpost.models.logprobs import eval_mode, response_logprobs

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


def trim_batch(batch: RolloutBatch, trim_response: bool = True) -> RolloutBatch:
    """``batch`` cut to its own widths: prompt columns that are padding in every row (left) and, with
    ``trim_response``, response columns after the last token any row reads (right; ``[B, R]`` extras too).

    Exact: positions come from the attention mask, so removing all-padding
    columns changes no log-prob, and responses are causal, so columns after a
    row's end never reach it.
    """
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    pl, rl = row_lengths(batch)
    p = max(1, max(pl, default=1))
    r = max(1, max(rl, default=1)) if trim_response else R
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


class TorchTrainer:
    """Owns the policy, its optimizer, and optionally a reference model and a critic.

    Args:
        policy: the causal LM being trained (fp32 master weights).
        cfg: the full run config (reads ``algo``, ``trainer``, ``precision``,
            ``rollout``, ``steps``).
        device: training device.
    """

    def __init__(self, policy: torch.nn.Module, cfg: Any, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.algo = cfg.algo
        self.tcfg = cfg.trainer
        self.device = torch.device(device)
        self.policy = policy.to(self.device)
        self.policy.train()
        # The module the policy loss differentiates; DeepSpeed ZeRO-3 trains a partitioned one while
        # ``policy`` stays a full-weight copy for rollouts and checkpoints.
        self.train_module: torch.nn.Module = self.policy
        self.dtype = DTYPES[cfg.precision.trainer_dtype]
        self.opt = self._make_optimizer(self.policy.parameters(), self.tcfg.lr)
        total = max(1, cfg.steps * self.algo.ppo_epochs * self.algo.mini_batches)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(self.tcfg.lr_schedule, self.tcfg.warmup_steps, total)
        )
        from rlpost.models.lora import is_lora

        # LoRA: the optimizer holds only the adapters (the only parameters requiring grad), and the KL
        # reference is the same module with its adapters disabled (no second copy of the weights).
        self.lora = is_lora(self.policy)
        self.ref: Optional[torch.nn.Module] = None
        if self.wants_ref and not self.lora:
            import copy

            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.critic: Optional[ValueModel] = None
        self.critic_opt = None
        if self.algo.critic.enabled:
            shared = bool(self.algo.critic.get("shared_backbone", False))
            if shared and (self.lora or type(self).__name__ != "TorchTrainer"):
                from rlpost.errors import ConfigError

                raise ConfigError("algo.critic.shared_backbone=true needs trainer.engine=torch without LoRA (the critic's "
                                  "optimizer updates the policy's own backbone). Fix: algo.critic.shared_backbone=false.")
            self.critic = ValueModel(self.policy, shared=shared).to(self.device)
            self.critic_opt = self._make_optimizer(self.critic.parameters(), self.algo.critic.lr)
        # MoE routing replay (model.routing_replay; rlpost.models.moe_replay.attach_routing sets it)
        self.routing: Optional[Any] = None
        self.bad_steps = 0
        self.version = 0  # number of policy optimizer steps taken
        self.updates = 0  # number of policy_update calls (the entropy metric's interval counts these)
        self.loss_state: Dict[str, Any] = {}  # losses' cross-step state (r2vpo's multiplier, capo's shadow Adam; tag after_step)

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
        ``trainer.max_tokens_per_micro_batch > 0``, else consecutive slices of ``micro_batch_size`` rows."""
        n = len(batch)
        if self.token_budget <= 0:
            return [(list(range(n))[sl], batch.select(list(range(n))[sl])) for sl in self._micro_slices(n)]
        pl, rl = row_lengths(batch)
        if not trim_response:
            rl = [batch.response_ids.shape[1]] * n
        return [(rows, trim_batch(batch.select(rows), trim_response))
                for rows in token_budget_micro_batches(pl, rl, self.token_budget)]

    def _temperature(self, batch: RolloutBatch):
        t = batch.extras.get("temperatures")
        return t if t is not None else float(self.cfg.rollout.temperature)

    def _truncation(self) -> Dict[str, Any]:
        """The sampler's top-k/top-p, so trainer log-probs are those of the distribution rollouts came from.

        Off for losses trained on reference responses (``sft``): those tokens were
        not sampled, and truncation would cut the gradient of every reference
        token outside the model's nucleus. See docs/ALGORITHMS.md ("Sampling
        distribution parity").
        """
        if POLICY_LOSSES.tag(self.algo.loss, "needs_reference_responses", False):
            return {"top_k": 0, "top_p": 1.0}
        r = self.cfg.rollout
        return {"top_k": int(r.top_k or 0), "top_p": float(r.top_p if r.top_p is not None else 1.0)}

    def _logprobs(self, model, batch: RolloutBatch, with_entropy: bool = False, entropy_grad: bool = False):
        attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
        T = self._temperature(batch)
        replay = (self.routing.context(batch.prompt_ids, batch.prompt_mask, batch.response_ids, attn)
                  if self.routing is not None and model is not self.ref else nullcontext())
        with self.autocast(), replay:
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

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
        with self.autocast():
            return self.critic(
                batch.prompt_ids.to(self.device),
                batch.prompt_mask.to(self.device),
                batch.response_ids.to(self.device),
                attn.to(self.device),
            )

    def _region_support_pass(self, mb: RolloutBatch, with_entropy: bool, entropy_grad: bool):
        """Sampled log-probs (with grad) and the current policy's log-probs on the anchor's recorded top-K support.

        Returns ``(logprobs [b, R], entropy or None, loss-input fields)``; the fields are
        ``region_support_logprobs`` (detached) and ``region_anchor_logprobs`` for
        :func:`rlpost.algos.losses.dppo_loss`'s predictive direction.
        Raises:
            ConfigError: an entropy bonus with gradient (not differentiated on this path).
        """
        from rlpost.errors import ConfigError
        from rlpost.models.teacher import support_logprobs

        if entropy_grad:
            raise ConfigError("algo.entropy_coef != 0 with dppo direction=predictive: the entropy bonus's gradient is "
                              "not computed on this path. Fix: algo.entropy_coef=0.")
        attn = mb.extras.get("response_attn", (mb.response_mask > 0).long())
        dev = self.device
        with self.autocast():
            lp, ent, sup, _ = support_logprobs(
                self.train_module, mb.prompt_ids.to(dev), mb.prompt_mask.to(dev), mb.response_ids.to(dev), attn.to(dev),
                temperature=self._temperature(mb), support_ids=mb.extras["old_topk_ids"],
                chunk_size=self.tcfg.logprob_chunk_size, with_entropy=with_entropy, **self._truncation())
        R = lp.shape[1]
        return lp, ent, {"region_support_logprobs": sup.detach().float(),
                         "region_anchor_logprobs": mb.extras["old_topk_logprobs"][:, :R].to(dev).float()}

    def _first_log_normaliser(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B]`` log-normaliser of the first response position's logits (TBRM's ``V(s_1) / beta``), with grad."""
        from rlpost.algos.tbrm import first_position_log_normaliser

        with self.autocast():
            return first_position_log_normaliser(self.train_module, batch.prompt_ids.to(self.device),
                                                 batch.prompt_mask.to(self.device), self._temperature(batch))

    @property
    def wants_ref(self) -> bool:
        """A reference policy is needed: KL to it (``algo.kl.coef > 0``), a loss tagged ``needs_ref`` (EXO,
        A*-PO) or an estimator tagged ``needs_reference_rewards`` (A*-PO's V* samples the reference)."""
        from rlpost.algos.registries import ADV_ESTIMATORS

        return (self.algo.kl.coef > 0 or bool(POLICY_LOSSES.tag(self.algo.loss, "needs_ref", False))
                or bool(ADV_ESTIMATORS.tag(self.algo.adv_estimator, "needs_reference_rewards", None)))

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
        from rlpost.models.lora import adapters_disabled

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
        """Critic values ``[B, R]`` at rollout time."""
        out = torch.zeros(len(batch), batch.response_ids.shape[1])
        for rows, mb in self._split(batch):
            v = self._values(mb).float().cpu()
            out[torch.tensor(rows, dtype=torch.long), : v.shape[1]] = v
        return out * batch.response_mask

    # ---------------------------------------------------------------- updates
    def _correction_weights(self, old_lp: torch.Tensor, batch: RolloutBatch):
        name = self.cfg.precision.correction
        if name in (None, "none"):
            return None, {}
        from rlpost.algos.corrections import compute_correction

        return compute_correction(
            name, old_lp, batch.rollout_logprobs.to(old_lp.device), batch.response_mask.to(old_lp.device),
            **dict(self.cfg.precision.correction_params or {}),
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
    def _entropy_need(self) -> tuple:
        """``(compute, with_grad)`` for this update's entropy.

        With gradient only for an entropy bonus (``algo.entropy_coef != 0``); as
        a constant for losses tagged ``needs_entropy`` and for the ``actor/entropy``
        metric every ``trainer.entropy_every`` updates; otherwise not at all.
        """
        from rlpost.algos.registries import POLICY_LOSSES

        grad = bool(self.algo.entropy_coef)
        every = int(self.tcfg.get("entropy_every", 1))
        metric = every > 0 and self.updates % every == 0
        return (grad or metric or bool(POLICY_LOSSES.tag(self.algo.loss, "needs_entropy", False))), grad

    def _offpolicy_params(self) -> Dict[str, Any]:
        from rlpost.algos.validate import trainer_loss_params

        tp = trainer_loss_params(self.algo)  # defaults: rlpost.algos.validate.TrainerLossParams
        return {"proximal": str(tp.proximal), "vcpo": bool(tp.vcpo_lr),
                "vcpo_power": float(tp.vcpo_power), "vcpo_min_scale": float(tp.vcpo_min_scale)}

    def _old_logprobs(self, mb: RolloutBatch, lp: torch.Tensor, v_start: int) -> torch.Tensor:
        """The proximal log-probs ``[b, R]`` of micro-batch ``mb`` given its current log-probs ``lp``."""
        from rlpost.algos.offpolicy import a3po_proximal_logprobs

        old = mb.extras.get("old_logprobs")
        if old is not None:
            return old.to(self.device)
        if self._offpolicy_params()["proximal"] == "a3po" and mb.policy_version is not None:
            bv = mb.extras.get("token_version", mb.policy_version)  # per token for partial rollouts
            return a3po_proximal_logprobs(mb.rollout_logprobs.to(self.device), lp, bv, v_start, self.version)
        return lp.detach()

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
            segment_ids=mini.extras["segment_ids"].to(self.device) if "segment_ids" in mini.extras else None,
            ref_logprobs=mini.extras["ref_logprobs"].to(self.device) if "ref_logprobs" in mini.extras else None,
        )

    def policy_update(self, batch: RolloutBatch, rng: Optional[torch.Generator] = None) -> Dict[str, float]:
        """PPO-style update over ``algo.ppo_epochs`` x ``algo.mini_batches`` optimizer steps.

        Reads ``batch.extras['advantages']`` ``[B, R]`` and, when present,
        ``old_logprobs`` and ``ref_logprobs``. When absent (single on-policy
        pass) the old log-probs are the current ones detached, so the importance
        ratio is exactly 1 on the first micro-batch. With
        ``algo.loss_params.proximal=a3po`` and no ``old_logprobs``, the proximal
        log-probs are A-3PO's interpolation between the rollout log-probs and the
        current ones (:func:`rlpost.algos.offpolicy.a3po_proximal_logprobs`; per
        token from ``extras['token_version']`` for partial rollouts), so
        multi-mini-batch updates need no extra forward pass. With
        ``algo.loss_params.vcpo_lr=true`` each optimizer step's learning rate is
        scaled by :func:`rlpost.algos.offpolicy.vcpo_lr_scale` of the mini-batch's
        importance-weight ESS (``pi_old / pi_rollout``).

        Returns:
            metrics averaged over micro-batches: ``loss/policy``, ``actor/entropy``,
            ``actor/clip_frac``, ``actor/ratio_mean``, ``actor/grad_norm``,
            ``actor/kl_ref``, ``rollout/logprob_gap``, ``actor/lr``, and the
            rollout/trainer mismatch ``mismatch/*`` of
            :func:`rlpost.rollout.precision.mismatch_metrics` (trainer side: the
            old log-probs) ...
        Raises:
            TrainingDiverged: too many consecutive non-finite steps.
        """
        from rlpost.algos.offpolicy import vcpo_lr_scale
        from rlpost.algos.validate import loss_kwargs
        from rlpost.rollout.precision import mismatch_metrics

        a = self.algo
        acc = _MetricAcc()
        B = len(batch)
        params = [p for p in self.train_module.parameters() if p.requires_grad]
        loss_params = loss_kwargs(a)  # the loss's declared defaults + algo.loss_params / algo.clip
        norm_const = a.loss_agg_norm or self.cfg.rollout.max_new_tokens
        offp = self._offpolicy_params()
        v_start = self.version
        need_entropy, entropy_grad = self._entropy_need()
        self.updates += 1
        batch_stats = bool(POLICY_LOSSES.tag(a.loss, "batch_statistics", False))
        first_lognorm = bool(POLICY_LOSSES.tag(a.loss, "needs_first_log_normaliser", False))
        if self.routing is not None:
            self.routing.begin_update()  # PR2: snapshot the routers its predictor is refitted from
        mm_rows: List[List[torch.Tensor]] = [[], [], []]  # rollout lp, old lp, mask (first epoch)
        pad_acc = [0.0, 0.0]  # real and padded tokens of this process's micro-batches (first epoch)
        for epoch in range(a.ppo_epochs):
            order = torch.randperm(B, generator=rng) if (rng is not None and a.mini_batches > 1) else torch.arange(B)
            minis = [order[i :: a.mini_batches] if a.mini_batches > 1 else order for i in range(a.mini_batches)]
            for mini_no, mini_idx in enumerate(minis):
                mini = batch.select(mini_idx)
                denom = agg_count(a.loss_agg, mini.response_mask)
                bad = False
                ess_sums = [0.0, 0.0, 0.0]
                mini.extras["_row"] = torch.arange(len(mini))
                # losses with batch statistics index the whole mini-batch: keep its response width
                micro = self._micro_batches(mini, trim_response=not batch_stats)
                for mb in micro:
                    if epoch == 0:
                        real, padded = padded_tokens(mb)
                        pad_acc[0] += real
                        pad_acc[1] += padded
                whole = self._whole_batch_input(mini, v_start) if (len(micro) > 1 and batch_stats) else None
                # One seed per mini-batch, shared by its micro-batches (and by every process, so a
                # distributed engine draws the same tokens everywhere), for losses that sample tokens.
                mini_seed = int(self.cfg.seed) * 1_000_003 + self.version * 1009 + epoch * 31 + mini_no
                seed = mini_seed if batch_stats else None
                for mb in micro:
                    m = mb.response_mask.to(self.device)
                    if "teacher_topk_ids" in mb.extras:  # distillation on the teacher's top-K (rlpost.algos.distill)
                        from rlpost.models.teacher import student_support_pass

                        lp, ent, teacher_in = student_support_pass(self, self.train_module, mb, need_entropy, entropy_grad)
                    elif "old_topk_ids" in mb.extras:  # DPPO's predictive direction (rlpost.algos.predictive_mask)
                        lp, ent, teacher_in = self._region_support_pass(mb, need_entropy, entropy_grad)
                    elif POLICY_LOSSES.tag(a.loss, "one_token_rollout", False):  # OTR (rlpost.algos.otr)
                        from rlpost.algos.otr import otr_forward

                        lp, ent, teacher_in = otr_forward(self, self.train_module, mb, need_entropy, entropy_grad,
                                                          loss_params, mini_seed)
                    elif POLICY_LOSSES.tag(a.loss, "capo_forward", False):  # CAPO (rlpost.algos.capo)
                        from rlpost.algos.capo import capo_forward

                        lp, ent, teacher_in = capo_forward(self, self.train_module, mb, need_entropy, entropy_grad,
                                                           loss_params, mini_seed)
                    else:
                        lp, ent = self._logprobs(self.train_module, mb, with_entropy=need_entropy, entropy_grad=entropy_grad)
                        teacher_in = {"teacher_logprobs": mb.extras["teacher_logprobs"].to(self.device)
                                      if "teacher_logprobs" in mb.extras else None}
                    rollout_lp = mb.rollout_logprobs.to(self.device)
                    old = self._old_logprobs(mb, lp, v_start)
                    if epoch == 0:
                        mm_rows[0].append(mb.rollout_logprobs.cpu())
                        mm_rows[1].append(old.detach().cpu())
                        mm_rows[2].append(mb.response_mask.cpu())
                    adv = mb.extras["advantages"].to(self.device)
                    inp = PolicyLossInput(
                        logprobs=lp,
                        old_logprobs=old,
                        advantages=adv,
                        response_mask=m,
                        rollout_logprobs=rollout_lp,
                        entropy=None if ent is None else ent.detach(),
                        batch=whole,
                        rows=mb.extras["_row"].to(self.device) if whole is not None else None,
                        seed=seed,
                        group_index=mb.group_index.to(self.device),
                        segment_ids=mb.extras["segment_ids"].to(self.device) if "segment_ids" in mb.extras else None,
                        step=self.updates - 1,
                        old_entropy=mb.extras["old_entropy"].to(self.device) if "old_entropy" in mb.extras else None,
                        ref_logprobs=mb.extras["ref_logprobs"].to(self.device) if "ref_logprobs" in mb.extras else None,
                        loss_state=self.loss_state,
                        first_log_normaliser=self._first_log_normaliser(mb) if first_lognorm else None,
                        **teacher_in,
                    )
                    loss_mat, lm = compute_policy_loss(a.loss, inp, **loss_params)
                    w, wm = self._correction_weights(old, mb)
                    if w is not None:
                        loss_mat = loss_mat * w.to(loss_mat.device)
                        lm.update({f"correction/{k}": v for k, v in wm.items()})
                    if offp["vcpo"]:
                        with torch.no_grad():
                            iw = torch.exp((old.float() - rollout_lp.float()).clamp(-20, 20)) * m
                            ess_sums = [ess_sums[0] + float(iw.sum()), ess_sums[1] + float((iw * iw).sum()),
                                        ess_sums[2] + float(m.sum())]
                    loss = aggregate(a.loss_agg, loss_mat, m, denom=denom, norm_const=norm_const)
                    # Logged loss: the micro-batch's own aggregate, weighted by its share of the
                    # mini-batch denominator, so the weighted mean is the mini-batch loss whatever
                    # trainer.micro_batch_size is (a token-count weight was wrong for seq-* modes).
                    n_agg = agg_count(a.loss_agg, m)
                    acc.add({"loss/policy": loss.detach() * (max(denom, 1.0) / max(n_agg, 1.0))}, n_agg)
                    metrics: Dict[str, Any] = {}
                    if self.has_ref and "ref_logprobs" in mb.extras and not a.kl.in_reward:
                        kl = kl_penalty(a.kl.estimator, lp, mb.extras["ref_logprobs"].to(self.device))
                        loss = loss + a.kl.coef * aggregate(a.loss_agg, kl, m, denom=denom, norm_const=norm_const)
                        metrics["actor/kl_ref"] = masked_mean(kl.detach(), m)
                    if ent is not None:
                        if a.entropy_coef:
                            loss = loss - a.entropy_coef * aggregate(a.loss_agg, ent, m, denom=denom, norm_const=norm_const)
                        metrics["actor/entropy"] = masked_mean(ent.detach(), m)
                    if not torch.isfinite(loss):
                        bad = True
                        if not self.lockstep:
                            break
                        loss = lp.sum() * 0.0  # keep collective backward passes in step; the step is skipped
                    self._backward(loss)
                    with torch.no_grad():
                        metrics["rollout/logprob_gap"] = masked_mean((lp.detach() - inp.rollout_logprobs).abs(), m)
                    seq_metrics = {}
                    for k, v in lm.items():
                        (seq_metrics if k.startswith("seq_") else metrics)[k if "/" in k else f"actor/{k}"] = v
                    acc.add(metrics, float(m.sum()))  # token means, weighted by tokens
                    acc.add(seq_metrics, float((m.sum(-1) > 0).sum()))  # sequence means, weighted by sequences
                scale = 1.0
                if offp["vcpo"]:
                    s1, s2, n = ess_sums
                    ef = (s1 * s1 / (s2 * n)) if (s2 > 0 and n > 0) else 1.0
                    scale = vcpo_lr_scale(ef, offp["vcpo_power"], offp["vcpo_min_scale"])
                    acc.add({"offpolicy/vcpo_lr_scale": scale, "offpolicy/ess_frac": ef}, 1.0)
                if self._any(bad):
                    self._skip_policy_step()
                    gn = float("nan")
                else:
                    base_lrs = [g["lr"] for g in self.opt.param_groups]
                    for g in self.opt.param_groups:
                        g["lr"] = g["lr"] * scale
                    try:
                        gn = self._policy_step(params)
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
                    after = POLICY_LOSSES.tag(a.loss, "after_step", None)
                    if after is not None:  # e.g. r2vpo's dual ascent on its multiplier (mini-batch statistics)
                        after(self.loss_state, lm, **loss_params)
                self.sched.step()
        out = self._reduce_metrics(acc).means()
        real, padded = (sum(x) for x in zip(*self._gather([torch.tensor(pad_acc)])))
        out["bench/padding_frac"] = float(1.0 - real / padded) if padded > 0 else 0.0
        if mm_rows[0]:
            rl, ol, mk = (_cat_padded(self._gather(t)) for t in mm_rows)
            out.update(mismatch_metrics(rl, ol, mk))
        out["actor/lr"] = float(self.sched.get_last_lr()[0])
        if self.routing is not None:
            self.routing.end_update()
            out.update(self.routing.metrics())
        return out

    def critic_update(self, batch: RolloutBatch) -> Dict[str, float]:
        """Regress the critic on ``batch.extras['returns']`` (token-mean clipped value loss)."""
        a = self.algo
        acc = _MetricAcc()
        params = [p for p in self.critic.parameters() if p.requires_grad]
        self.critic.train()
        from rlpost.algos.sp3o import with_critic_mask

        # SP3O (algo.critic.supervised_states > 0): the value loss at a few states per response, drawn once
        # per critic update for the whole batch so every micro-batch (and process) uses the same positions
        batch = with_critic_mask(batch, a.critic, int(self.cfg.seed) * 1_000_003 + self.version)
        for _ in range(max(1, a.critic.epochs)):
            denom = float(batch.extras["_critic_mask"].sum())
            for mb in self._micro_batches(batch):
                m = mb.extras["_critic_mask"].to(self.device)
                v = self._values(mb)
                old_v = mb.extras.get("values", v.detach()).to(self.device)
                loss_mat, vm = value_loss(v, old_v, mb.extras["returns"].to(self.device), m, a.critic.clip_range)
                loss = a.critic.coef * aggregate("token-mean", loss_mat, m, denom=denom)
                if not torch.isfinite(loss):
                    continue
                loss.backward()
                acc.add({"critic/value_loss": (loss_mat.detach() * m).sum() / m.sum().clamp(min=1), **{f"critic/{k}": x for k, x in vm.items()},
                         "critic/value_mean": masked_mean(v.detach(), m)}, float(m.sum()))
            gn = self._finite_step(self.critic_opt, params, self.tcfg.grad_clip)
            acc.add({"critic/grad_norm": gn}, 1.0)
        return acc.means()

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
            sd["routing"] = routing  # PR2's predictor
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the policy weights were loaded)."""
        self.opt.load_state_dict(sd["opt"])
        self.sched.load_state_dict(sd["sched"])
        self.bad_steps = int(sd.get("bad_steps", 0))
        self.version = int(sd.get("version", 0))
        self.updates = int(sd.get("updates", 0))
        # numbers (r2vpo's multiplier) as floats; structured state (capo's shadow Adam moments) as saved
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
