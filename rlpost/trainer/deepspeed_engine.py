"""``trainer=deepspeed``: the torch trainer's model, loss and batch code in a DeepSpeed ZeRO engine.

:class:`DeepSpeedTrainer` subclasses :class:`rlpost.trainer.torch_engine.TorchTrainer`
and overrides only its engine hooks: which rows this process computes, how a
loss is back-propagated, how the optimizer steps, how metrics are combined.
The loss code is the torch trainer's, line for line.

Data parallelism: every process runs the same run graph with the same seeds,
so each holds the same rollout batch (with several processes the rollouts,
scoring and no-grad passes are split by groups and gathered, see
:mod:`rlpost.distributed`); in the update each process takes the rows
``rank::world`` of every mini-batch and DeepSpeed averages gradients. The loss
of a process is normalised by the *global* mini-batch denominator and scaled by
the world size, so the averaged gradient equals the single-process one and one
step reproduces ``trainer=torch`` (tested for ZeRO-2 and ZeRO-3 on two CPU
processes with gloo).

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", arXiv:1910.02054) stage 0/1/2/3 from ``trainer.zero_stage``;
``trainer.offload_optimizer`` keeps optimizer state on the CPU (ZeRO-Offload,
arXiv:2101.06840) with the same torch AdamW. Precision: fp32; bf16 as torch
autocast over fp32 weights (as ``trainer=torch``); fp16 with DeepSpeed's
dynamic loss scaling (GPU only).

Launch: ``trainer.num_procs > 1`` re-executes the command under ``torchrun``
(:mod:`rlpost.trainer.torchrun`); multi-node runs use DeepSpeed's launcher with a
hostfile (see ``docs/ENGINES.md``).
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError, RlpostError
from rlpost.trainer.torch_engine import TorchTrainer, _MetricAcc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise ``torch.distributed`` through DeepSpeed (gloo on CPU, nccl on GPU).

    Under a launcher (``torchrun``/``deepspeed``) the environment already names
    rank and world; a plain single process becomes rank 0 of a world of 1.

    Raises:
        RlpostError: DeepSpeed is not installed.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:  # pragma: no cover - deepspeed is a dependency
        raise RlpostError(f"trainer=deepspeed needs the deepspeed package ({e}). Fix: pip install deepspeed.") from e
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               auto_mpi_discovery=False, verbose=False)


def rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (and in single-process runs): the process that writes logs and checkpoints."""
    return rank() == 0


def _ds_backward(engine: Any, loss: torch.Tensor) -> None:
    """``engine.backward(loss)`` that accumulates across micro-batches under ZeRO-3.

    rlpost runs forwards through the engine's *module* (its log-prob and value
    code needs the backbone and head separately), which skips
    ``DeepSpeedEngine.forward``, and that forward is where ZeRO-3 advances its
    micro-step counter (``optimizer.clear_backward_seen_flag()``,
    ``deepspeed/runtime/engine.py``; ``DeepSpeedZeroOptimizer_Stage3.clear_backward_seen_flag``
    increments ``micro_step_id``, and ``micro_step_id == 0`` means "copy, don't
    accumulate" in ``stage3.py``). Without it every backward overwrote the
    previous micro-batch's gradient (measured: two-micro-batch critic step,
    gradient norm 0.73 vs 1.127 for trainer=torch). Called here once per backward,
    as the engine's forward would.
    """
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()
    engine.backward(loss, scale_wrt_gas=False)


def gathered_named_parameters(module: torch.nn.Module, clone: bool = True):
    """Yield ``(name, full tensor)`` for every parameter of a ZeRO-3 ``module``, one module's parameters at a time.

    For each submodule, its *own* parameters (``recurse=False``) are gathered with
    ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``
    (read-only; ``deepspeed/runtime/zero/partition_parameters.py``), yielded, and
    re-partitioned when the consumer asks for the next module: the established
    per-layer pattern for pushing ZeRO-3 weights (one decoder layer's worth of
    gathered memory instead of the whole model). Outside ZeRO-3 (no ``ds_id`` on
    the parameters) the parameters are yielded as they are.

    Args:
        module: the DeepSpeed engine's module.
        clone: yield detached clones (safe to keep after the gather ends); False
            yields the gathered tensors themselves, valid only until the next item.
    Yields:
        ``(name, tensor)`` with ``name`` as in ``module.named_parameters()``; tied
        parameters once.
    """
    seen = set()
    for mod_name, mod in module.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        prefix = f"{mod_name}." if mod_name else ""
        if any(hasattr(p, "ds_id") for _, p in own):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                for n, p in own:
                    yield prefix + n, (p.data.detach().clone() if clone else p.data)
        else:
            for n, p in own:
                yield prefix + n, (p.detach().clone() if clone else p.detach())


def build_ds_config(tcfg: Any, precision: Any) -> Dict[str, Any]:
    """The DeepSpeed JSON config for the ``trainer`` and ``precision`` config groups.

    Gradient accumulation is caller-owned (``managed_gradient_accumulation``
    false): every ``backward`` accumulates and ``step`` is the boundary, since
    the number of micro-batches per mini-batch depends on the batch.

    Raises:
        ConfigError: ``trainer.zero_stage`` not in 0..3.
    """
    t = tcfg
    if int(t.zero_stage) not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.zero_stage={t.zero_stage} is invalid. Valid choices: 0, 1, 2, 3.")
    zero: Dict[str, Any] = {"stage": int(t.zero_stage)}
    if t.offload_optimizer:
        if int(t.zero_stage) == 0:
            raise ConfigError("trainer.offload_optimizer=true needs trainer.zero_stage >= 1.")
        zero["offload_optimizer"] = {"device": "cpu"}
    ds: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(t.micro_batch_size),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(t.grad_clip or 0.0),
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision.trainer_dtype == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return ds


class DeepSpeedTrainer(TorchTrainer):
    """:class:`TorchTrainer` whose policy update runs in a DeepSpeed engine.

    Args:
        policy, tcfg, algo, device: as :class:`TorchTrainer` (``tcfg``: ``trainer.zero_stage``,
            ``trainer.offload_optimizer``, ``trainer.grad_clip``, ``trainer.micro_batch_size``...);
            ``device`` is ``cpu`` or a CUDA device (the local rank's).
        run_dir: where DeepSpeed checkpoints live (``<run_dir>/deepspeed/<tag>``);
            None: a temporary directory of rank 0 (checkpoints then do not resume
            across runs).
    Attributes:
        engine: the ``deepspeed.DeepSpeedEngine``.
        policy: full-weight module used for rollouts, log-prob passes and
            Hugging Face checkpoints (the engine's own module for ZeRO 0-2, a
            gathered copy refreshed after every update for ZeRO-3).
    Raises:
        ConfigError: invalid ZeRO settings; fp16 on CPU.
        RlpostError: DeepSpeed is not installed.
    """

    lockstep = True
    fused_adamw = False  # DeepSpeed's ZeRO optimizer wraps the torch AdamW; keep its usual (foreach) form

    def __init__(self, policy: torch.nn.Module, tcfg: Any, algo: Any, device: torch.device | str = "cpu", *,
                 run_dir: Optional[Path] = None, keep_last: Optional[int] = None, **kw: Any) -> None:
        import deepspeed

        init_distributed()
        precision = kw["precision"]
        if precision.trainer_dtype == "fp16" and torch.device(device).type == "cpu":
            raise ConfigError("trainer=deepspeed with precision.trainer_dtype=fp16 needs a GPU (loss-scaled fp16). "
                              "Fix: use precision=fp32 or precision=bf16 on CPU.")
        super().__init__(policy, tcfg, algo, device, **kw)
        self.rank, self.world = rank(), world_size()
        self.zero_stage = int(tcfg.zero_stage)
        module = self.policy
        if self.zero_stage == 3:
            # ZeRO-3 partitions ``module`` in place; keep a full copy for rollouts and checkpoints.
            self.policy = copy.deepcopy(module)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=self.opt, config=build_ds_config(tcfg, precision))
        self.train_module = self.engine.module
        self.train_module.train()
        # The critic (SAO, PPO) gets its own DeepSpeed engine with the same ZeRO config, so its weights,
        # gradients and AdamW state are partitioned like the policy's instead of a full fp32 copy plus
        # plain AdamW on every GPU (DeepSpeed-Chat's actor/critic engines follow the same pattern).
        self.critic_engine = None
        if self.critic is not None:
            self.critic_engine, self.critic_opt, _, _ = deepspeed.initialize(
                model=self.critic, optimizer=self.critic_opt, config=build_ds_config(tcfg, precision))
            self.critic = self.critic_engine.module
        self._ds_dir = self._resolve_dir(run_dir)
        self._keep = int(keep_last or 2)

    def _resolve_dir(self, run_dir: Optional[Path]) -> Path:
        import tempfile

        import torch.distributed as dist

        if run_dir is not None:
            return Path(run_dir) / "deepspeed"
        obj = [tempfile.mkdtemp(prefix="rlpost_ds_") if self.rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        return Path(obj[0])

    # ------------------------------------------------------------ engine hooks
    def _micro_batches(self, mini: RolloutBatch, trim_response: bool = True) -> List[RolloutBatch]:
        """Rows ``rank::world`` of ``mini`` in micro-batches; every process gets the same count.

        Micro-batches hold ``trainer.micro_batch_size`` rows, or are packed by
        ``trainer.max_tokens_per_micro_batch`` (:meth:`TorchTrainer._split`). A
        process with fewer micro-batches gets all-masked copies of row 0, so ZeRO's
        collectives (one per forward/backward) stay in step; they add nothing to
        the loss.
        """
        import torch.distributed as dist

        n = len(mini)
        local = list(range(self.rank, n, self.world))
        out = [mb for _, mb in self._split(mini.select(local), trim_response)] if local else []
        count = torch.tensor([len(out)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(out) < max(1, int(count.item())):
            dummy = mini.select([0])
            dummy.response_mask = torch.zeros_like(dummy.response_mask)
            out.append(dummy)
        return out

    def _backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over processes; each loss is a partial sum of the global one.
        _ds_backward(self.engine, loss * self.world)

    def _policy_step(self, params) -> float:
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        gn = 0.0 if gn is None else float(gn)
        if self.zero_stage == 3:
            self._refresh_full_policy()
        return gn

    def _skip_policy_step(self) -> None:
        self.engine.zero_grad()

    def _any(self, flag: bool) -> bool:
        import torch.distributed as dist

        # on the trainer's device: NCCL (the GPU backend) has no CPU tensors ("No backend type associated
        # with device type cpu", seen on the H200 check); gloo on CPU takes CPU tensors
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def _gather(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        import torch.distributed as dist

        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, [t.cpu() for t in tensors])
        return [t for part in out for t in part]

    def _reduce_metrics(self, acc: _MetricAcc) -> _MetricAcc:
        import torch.distributed as dist

        parts: List[Any] = [None] * self.world
        dist.all_gather_object(parts, (acc.sums, acc.weights))
        merged = _MetricAcc()
        for sums, weights in parts:
            for k, v in sums.items():
                if k.endswith("_max"):
                    merged.sums[k] = max(merged.sums.get(k, -float("inf")), v)
                    merged.weights[k] = 1.0
                elif k in ("actor/grad_norm", "actor/skipped_steps") or k.startswith("offpolicy/"):
                    # per-step values, identical on every process: keep one copy
                    if k not in merged.sums:
                        merged.sums[k], merged.weights[k] = v, weights[k]
                else:
                    merged.sums[k] = merged.sums.get(k, 0.0) + v
                    merged.weights[k] = merged.weights.get(k, 0.0) + weights[k]
        return merged

    def _refresh_full_policy(self) -> None:
        """Copy the ZeRO-3 partitioned weights into the full-weight ``policy``, one module at a time (collective).

        Each module's own parameters are gathered with
        ``deepspeed.zero.GatheredParameters(module.parameters(recurse=False))``
        (``deepspeed/runtime/zero/partition_parameters.py``), copied, and released
        before the next module is gathered, so the transient extra memory is one
        layer's weights, not a second full copy of the model.
        """
        full = dict(self.policy.named_parameters())
        with torch.no_grad():
            for name, t in gathered_named_parameters(self.train_module, clone=False):
                full[name].copy_(t.to(full[name].dtype))

    def _critic_backward(self, loss: torch.Tensor) -> None:
        """The critic's backward inside its DeepSpeed engine (collective): rows ``rank::world`` per process,
        the loss scaled by the world size so DeepSpeed's gradient average equals the single-process gradient."""
        _ds_backward(self.critic_engine, loss * self.world)

    def _critic_step(self) -> float:
        """``engine.step()`` of the critic: clipping (``trainer.grad_clip``) and AdamW on the partitioned state."""
        self.critic_engine.step()
        gn = self.critic_engine.get_global_grad_norm()
        return 0.0 if gn is None else float(gn)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Write a DeepSpeed checkpoint (collective: every process calls this) and return what resumes it.

        The engine's module and (partitioned) optimizer state go to
        ``<run_dir>/deepspeed/v<version>``; the returned dict holds that
        location, the scheduler, counters, critic and reference. Older tags
        beyond ``checkpoint.keep_last`` are pruned.
        """
        import torch.distributed as dist

        tag = f"v{self.version:08d}"
        self._ds_dir.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(self._ds_dir), tag=tag)
        if self.critic_engine is not None:
            self.critic_engine.save_checkpoint(str(self._ds_dir / "critic"), tag=tag)
        dist.barrier()
        if self.rank == 0:
            for root in (self._ds_dir, self._ds_dir / "critic"):
                tags = sorted(p for p in root.glob("v*") if p.is_dir())
                for old in tags[: max(0, len(tags) - self._keep)]:
                    shutil.rmtree(old, ignore_errors=True)
        sd = super().state_dict()
        sd.pop("opt", None)
        sd.pop("critic", None)  # in the critic engine's own DeepSpeed checkpoint
        sd.pop("critic_opt", None)
        sd["deepspeed"] = {"dir": str(self._ds_dir.resolve()), "tag": tag, "zero_stage": self.zero_stage,
                           "world_size": self.world}
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (collective).

        Raises:
            RlpostError: the checkpoint was not written by ``trainer=deepspeed``,
                or its DeepSpeed directory is gone.
        """
        info = sd.get("deepspeed")
        if info is None:
            raise RlpostError("This checkpoint was written by trainer=torch; it cannot resume trainer=deepspeed. "
                              "Fix: resume with trainer=torch, or start a fresh run.")
        path = Path(info["dir"]) / info["tag"]
        if not path.exists():
            raise RlpostError(f"DeepSpeed checkpoint {path} is missing. Fix: resume from a run directory whose "
                              f"deepspeed/ folder is intact, or start a fresh run.")
        self.engine.load_checkpoint(info["dir"], tag=info["tag"], load_optimizer_states=True,
                                    load_lr_scheduler_states=False)
        rest = {k: v for k, v in sd.items() if k != "deepspeed"}
        self.sched.load_state_dict(rest["sched"])
        self.bad_steps = int(rest.get("bad_steps", 0))
        self.version = int(rest.get("version", 0))
        if self.critic_engine is not None:
            self.critic_engine.load_checkpoint(str(Path(info["dir"]) / "critic"), tag=info["tag"],
                                               load_optimizer_states=True, load_lr_scheduler_states=False)
        if self.ref is not None and "ref" in rest:
            self.ref.load_state_dict(rest["ref"])
        if self.zero_stage == 3:
            self._refresh_full_policy()
