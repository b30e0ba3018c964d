"""The run graph and its executor: one readable training loop.

A config becomes an explicit list of stages (:func:`build_graph`), which
``rlpost config --graph`` prints and the runner executes, each enabled stage
through its own callable:

    produce (Run.collect):  select -> rollout -> reward
    learn (Run.learn):      algo_inputs -> old_logprobs -> ref_logprobs -> teacher_logprobs -> values
                            -> advantages -> critic_update -> policy_update -> sync
    finish (train):         evaluate -> log -> checkpoint

Disabled stages (no critic, no KL, ...) are printed as skipped and never run;
:attr:`Run.executed` records what ran for each step.

Everything algorithmic is a registered pure function in :mod:`rlpost.algos`, or
a method's hooks in :mod:`rlpost.methods` (called here through one
:class:`rlpost.methods.base.MethodSet`); this module names no method and only
moves tensors between stages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.regularizers import kl_penalty
from rlpost.algos.validate import adv_overrides, old_shaping_spelling, teacher_top_k
from rlpost.config.compose import validate_config
from rlpost.core.autoprecision import resolve_precision
from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError, Interrupted
from rlpost.core.partial import PartialRolloutProducer
from rlpost.core.tracking import RunLogger, eval_line, format_summary, log, step_line, step_seconds
from rlpost.distributed import gather_rows, sharded_rows, world_size
from rlpost.eval.evaluate import build_eval_tasks, evaluate, evaluate_tasks, scalar_metrics
from rlpost.methods.base import MethodSet, RunServices
from rlpost.models.loader import load_policy
from rlpost.models.logprobs import prompt_entropy
from rlpost.models.moe_replay import attach_routing
from rlpost.ray_pool import (attach_reward_workers, build_rollout_backend, describe_devices, describe_pool,
                             describe_reward, device_plan)
from rlpost.rewards import RewardFunction, StepScorer
from rlpost.rollout import build_engine
from rlpost.rollout.base import EngineConfig, GenerationResult, SamplingParams
from rlpost.run.checkpoint import (
    DONE_MARKER,
    FAILED_MARKER,
    GeneratorState,
    collect_states,
    describe_checkpoint,
    export_final,
    find_resume_checkpoint,
    load_checkpoint,
    resolve_keep_last,
    save_checkpoint,
)
from rlpost.run.collect import StepRollouts, check_allocation, collect_rollouts, rollout_metrics, row_oldest
from rlpost.run.executor import build_executor, rollouts_overlap_updates
from rlpost.run.interrupts import StopRequest
from rlpost.run.memory import preflight
from rlpost.run.resume import continue_command
from rlpost.samplers import build_sampler
from rlpost.samplers.base import SampleResult, SamplerContext, pad_id_of, runs_episodes, score_rows
from rlpost.selectors import build_selector
from rlpost.selectors.mixture import make_hint_fn
from rlpost.tasks import build_task
from rlpost.tasks.base import task_prompts
from rlpost.trainer.torch_engine import TorchTrainer
from rlpost.trainer.torchrun import local_device


PRODUCE, LEARN, FINISH = "produce", "learn", "finish"
PRODUCER_STAGES = ("select", "rollout", "reward")


@dataclass
class Stage:
    """One node of the run graph.

    Attributes:
        name: stage name (printed by ``rlpost config --graph``, recorded in
            :attr:`Run.executed` when it runs).
        description: what it does under this config.
        enabled: whether this config runs it.
        phase: ``produce`` (select -> rollout -> reward: one call,
            :meth:`Run.collect`, because the sampler driver interleaves them:
            selectors refill after scoring), ``learn`` (run in order by
            :meth:`Run.learn`) or ``finish`` (run in order by :func:`train` after
            each step: evaluate, log, checkpoint; they decide themselves whether
            this step is one of theirs).
        fn: the callable that runs it (bound by :func:`build_graph` from ``fns``);
            ``learn`` stages take a :class:`LearnContext`, ``finish`` stages a
            step's metrics dict and return whether they ran.
    """

    name: str
    description: str
    enabled: bool = True
    phase: str = LEARN
    fn: Optional[Callable[..., Any]] = None


def build_graph(cfg: DictConfig) -> List[Stage]:
    """The stages a config runs each step, in order (disabled ones are listed too).

    This list is both what ``rlpost config --graph`` prints and what the runner
    executes: :class:`Run` binds the learn stages' callables and :meth:`Run.learn`
    iterates them, :func:`train` binds and runs the finish stages
    (:func:`bind_stages`), the executor runs the producer stages.
    """
    a = cfg.algo
    methods = MethodSet.for_config(cfg)
    inputs = methods.describe()
    async_ex = cfg.executor.name == "async"
    ev = [w for w, on in (("before the first step", cfg.eval.at_start), (f"every {cfg.eval.every} steps", cfg.eval.every > 0),
                          ("after the last step", cfg.eval.at_end)) if on]
    graph = [
        Stage("select", f"selector={cfg.selector.name}: choose {cfg.selector.prompts_per_step} prompts of task={cfg.task.name}",
              phase=PRODUCE),
        Stage("rollout", f"sampler={cfg.sampler.name} x{a.n_samples_per_prompt} via rollout={cfg.rollout.engine} "
              f"({cfg.precision.rollout_dtype}, T={cfg.rollout.temperature}, max_new_tokens={cfg.rollout.max_new_tokens})"
              + (f"; partial rollouts: chunks of {cfg.executor.partial_chunk_tokens} tokens, "
                 f"over_provision {cfg.executor.over_provision}, unfinished groups carried over"
                 + (" (a window per step: one chunk, cut responses trained and continued)"
                    if cfg.executor.get("partial_train_unfinished", False) else "")
                 if cfg.executor.get("partial_rollout", False) else "")
              + ("; " + describe_pool(cfg)
                 if cfg.get("launcher") is not None and cfg.launcher.name == "ray" else ""), phase=PRODUCE),
        Stage("reward", f"task verifier (timeout {cfg.task.reward.timeout_s}s, failures -> 0) + shaping"
              + describe_reward(cfg), phase=PRODUCE),
        Stage("algo_inputs", "algorithm inputs: " + (", ".join(inputs) or "none"), bool(inputs)),
        Stage("old_logprobs", "trainer log-probs of the rollouts before the update (else: current, detached)",
              needs_old_logprobs(a, methods)),
        Stage("ref_logprobs", f"reference-model log-probs for KL ({a.kl.estimator}, coef {a.kl.coef})"
              if not loss_needs_ref(a) else f"reference-model log-probs for loss={a.loss}",
              a.kl.coef > 0 or loss_needs_ref(a)),
        teacher_stage(cfg),
        Stage("values", "critic values V(s_t)", a.critic.enabled),
        Stage("advantages", f"adv_estimator={a.adv_estimator}"
              + (f" (baseline={(a.adv_params or {}).get('baseline')})" if (a.adv_params or {}).get("baseline") else "")
              + (f"; KL penalty in the reward ({a.kl.estimator})" if a.kl.coef > 0 and a.kl.in_reward else "")),
        Stage("critic_update", f"value-loss regression on returns (policy frozen for {a.critic.warmup_steps} warm-up steps)",
              a.critic.enabled),
        Stage("policy_update", f"loss={a.loss} agg={a.loss_agg} epochs={a.ppo_epochs} mini_batches={a.mini_batches} "
              f"trainer={cfg.trainer.engine} ({cfg.precision.trainer_dtype})"
              + (f" correction={cfg.precision.correction}" if cfg.precision.correction != "none" else "")),
        Stage("sync", ("the producer loads the newest weights before its next step (executor=async)" if async_ex
                       else "push updated weights to the rollout engine")
              + (" (Ray workers: via the object store or a broadcast, launcher.weight_sync)"
                 if cfg.get("launcher") is not None and cfg.launcher.name == "ray" else "")),
        Stage("evaluate", f"greedy accuracy on {cfg.eval.limit} held-out prompts " + (", ".join(ev) or "never"),
              bool(ev), phase=FINISH),
        Stage("log", f"metrics.jsonl + logger={cfg.logger.backend}", phase=FINISH),
        Stage("checkpoint", (f"every {cfg.checkpoint.every} steps and " if cfg.checkpoint.every > 0 else "")
              + "after the last step or an interrupt, keep the last "
              + (str(cfg.checkpoint.keep_last) if cfg.checkpoint.keep_last is not None
                 else "1 (CPU, full fine-tuning) or 2 (checkpoint.keep_last=null)"), phase=FINISH),
    ]
    for st in graph:  # launcher.device_mapping: where each stage's model runs
        st.description += describe_devices(cfg, st.name)
    return graph


def loss_needs_ref(a: Any) -> bool:
    """``algo.loss`` is tagged ``needs_ref``: it reads the reference policy's log-probs itself."""
    return bool(POLICY_LOSSES.tag(str(a.loss), "needs_ref", False))


def teacher_stage(cfg: DictConfig) -> "Stage":
    """The ``teacher_logprobs`` stage: the frozen ``model.teacher`` scores the rollouts (:mod:`rlpost.models.teacher`)."""
    spec = cfg.model.get("teacher", None)
    routed = dict(cfg.model.get("teachers", None) or {})
    if not spec and not routed:
        return Stage("teacher_logprobs", "teacher log-probs (no model.teacher)", False)

    k = teacher_top_k(cfg.algo)
    who = (f"frozen teacher model.teacher={spec}" if spec else
           "frozen teachers routed by the prompt's domain (" + ", ".join(f"{d}={t}" for d, t in sorted(routed.items())) + ")")
    return Stage("teacher_logprobs", f"{who}: log-probs of the sampled tokens"
                 + (f" and its top-{k} support per position" if k else ""), True)


def needs_old_logprobs(a: Any, methods: MethodSet) -> bool:
    """Whether the update needs a forward pass for the pre-update log-probs.

    Several optimizer steps per batch anchor their ratios to them, unless a
    method supplies the proximal log-probs itself (``Needs.skip_old_logprobs``);
    KL-in-reward reads them too, and so does any method that asks
    (``Needs.old_logprobs``).
    """
    n = methods.needs()
    return ((a.ppo_epochs * a.mini_batches > 1 and not n.skip_old_logprobs) or (a.kl.coef > 0 and a.kl.in_reward)
            or n.old_logprobs)


@dataclass
class Collected:
    """What the producer half of a step hands to the learner half (see :meth:`Run.collect`)."""

    step: int
    batch: RolloutBatch
    examples: List[Any]
    per_prompt: List[List[float]]
    reward_metrics: Dict[str, Any]
    step_out: Any
    t_start: float
    t_rollout: float
    t_reward: float
    weights_step: int = -1  # RL steps completed by the engine weights of this collect
    cpu_rollout: float = 0.0  # CPU seconds (user + system, this process) of this collect


# the stages whose seconds make up ``time/update_s`` (log-probs, values, advantages and the updates)
UPDATE_STAGES = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "advantages", "critic_update", "policy_update")


@dataclass
class LearnContext:
    """What the learn-phase stages of one step share: the collected step, its batch, its metrics."""

    c: Collected
    batch: RolloutBatch
    metrics: Dict[str, Any]
    sync_engine: bool = True
    seconds: Dict[str, float] = field(default_factory=dict)
    cpu_learn: float = 0.0  # CPU seconds of this process in the learn stages


def format_graph(cfg: DictConfig) -> str:
    """Human-readable run graph: one numbered line per stage, ``(skipped)`` when this config does not run it."""
    lines = []
    for i, s in enumerate(build_graph(cfg)):
        mark = "" if s.enabled else "  (skipped)"
        lines.append(f"{i + 1:2d}. {s.name:<14} {s.description}{mark}")
    return "\n".join(lines)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, salt: str = "rollout") -> int:
    """A deterministic 63-bit seed for (run seed, step, purpose): rollouts reproduce on resume."""
    h = hashlib.sha256(f"{seed}:{step}:{salt}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; on CUDA the local rank's GPU, made current
    (:func:`rlpost.trainer.torchrun.local_device`)."""

    return local_device(name)


def is_main_process() -> bool:
    """True for the only process, or rank 0 of a ``trainer.num_procs > 1`` launch: it writes logs and files."""
    return int(os.environ.get("RANK", "0")) == 0


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Run:
    """All live components of one training run (built once, then stepped).

    Args:
        cfg: resolved config.
        run_dir: the run directory (outputs go here).
    """

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:

        validate_config(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.devices = device_plan(cfg)  # launcher.device_mapping resolved (rlpost.ray_pool.device_mapping), or None
        self.device = pick_device(self.devices.device("actor") if self.devices is not None else cfg.device)

        resolve_precision(cfg, self.device)  # precision=auto -> concrete dtypes, printed once

        resolve_keep_last(cfg, self.device)  # checkpoint.keep_last=null -> 1 on CPU with full fine-tuning, else 2
        seed_everything(cfg.seed)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.task = build_task(cfg.task)
        self.train_examples = self.task.train_examples()
        self.eval_examples = self.task.eval_examples()
        # selector and sampler first: their config errors stop the run before the model loads
        self.selector = build_selector(cfg.selector, len(self.train_examples), cfg.seed, cfg.algo.n_samples_per_prompt)
        self.selector.attach(examples=self.train_examples, prompt_entropy=self.prompt_entropy)
        self.sampler = build_sampler(cfg.sampler, cfg.algo.n_samples_per_prompt)
        check_allocation(self.selector, self.sampler, cfg.selector.name, cfg.sampler.name)
        if hasattr(self.sampler, "attach"):  # sampler=episode: environments reset on examples, transcripts
            self.sampler.attach(task=self.task, examples=self.train_examples, run_dir=self.run_dir)
        if runs_episodes(cfg.sampler.name):  # sampler=episode and the samplers built on it (trace_tree)
            _check_episode_rewards(cfg)
        # the run's hook-using methods (rlpost.methods): their config errors stop the run before any weights load
        self.methods = MethodSet.for_config(cfg)
        # all reward shaping lives here (task.reward: e.g. algo=dapo's overlong window); its config errors stop the run early too
        self.reward_fn = RewardFunction.from_config(self.task, cfg.task.reward, max_len=cfg.rollout.max_new_tokens,
                                                    old_spelling=old_shaping_spelling(cfg.algo))
        self.reward_fn.check_estimator(cfg.algo.adv_estimator)  # a PRM's token rewards need an estimator that reads them

        preflight(cfg, self.device)  # per-GPU memory budget: stop with the cheapest fix before loading 8B weights
        self.policy, self.tokenizer = load_policy(cfg.model, torch.float32, seed=cfg.seed)
        self.trainer = self._build_trainer()
        self.reward_fn.attach(self.tokenizer, getattr(self.trainer, "dtype", torch.float32),  # the trainer's dtype
                              (self.devices.device("reward") if self.devices is not None and "reward" in self.devices.stages
                               else getattr(self.trainer, "device", self.device)))
        self.methods.attach_trainer(self.trainer.policy)  # before any copy of the weights is made
        self.teacher = None  # the frozen distillation teacher (model.teacher): owns its parameters
        if cfg.model.get("teacher", None):
            from rlpost.models.teacher import load_teacher

            self.teacher = load_teacher(str(cfg.model.teacher), self.tokenizer, self.trainer.dtype,
                                        self.trainer.device, seed=cfg.seed)
        elif cfg.model.get("teachers", None):  # several teachers, each row scored by its prompt's domain's
            from rlpost.models.teacher import load_teachers
            from rlpost.tasks.base import example_domain

            self.teacher = load_teachers(dict(cfg.model.teachers), self.tokenizer, self.trainer.dtype,
                                         self.trainer.device, [example_domain(e) for e in self.train_examples],
                                         seed=cfg.seed)

        # run_dir and prompts: rollout.speculative.drafter=mtp_head fits its head on training prompts, keeps it there
        # the engines see their own sections only (EngineConfig); the executor decides whether weights may be shared
        self.engine_cfg = EngineConfig.of(cfg, share_weights=not rollouts_overlap_updates(cfg.executor))
        self.local_engine = build_engine(self.engine_cfg, self.trainer.policy, self.tokenizer, self.device,
                                         run_dir=self.run_dir,
                                         prompts=task_prompts(self.task, self.tokenizer, cfg.seed, self.train_examples))

        self.local_engine = attach_routing(cfg.model, self.trainer, self.local_engine)  # model.routing_replay
        # a method whose rollouts sample the frozen reference (Needs.frozen_rollouts, DRIFT): the step's engine holds
        # the reference copy and gets no weights; evaluation keeps local_engine over the trained policy
        self.frozen_rollouts = bool(self.methods.needs().frozen_rollouts)
        rollout_engine = (build_engine(self.engine_cfg, self.trainer.ref, self.tokenizer, self.device)
                          if self.frozen_rollouts else self.local_engine)
        self.shard = self._rollout_sharding()
        if self.shard:  # data-parallel rollouts: every generate call is split across ranks and gathered
            from rlpost.distributed import ShardedEngine

            self.engine = ShardedEngine(rollout_engine)
        else:
            self.engine = rollout_engine

        # launcher=ray: generation in a pool of Ray actors behind the same engine interface (rlpost.ray_pool)
        self.engine = build_rollout_backend(cfg.get("launcher"), self.engine_cfg, self.engine, self.trainer.policy,
                                            cfg=cfg)
        attach_reward_workers(cfg.get("launcher"), self.reward_fn, self.task)  # launcher.reward_workers > 0: Ray verifiers
        self._prompt_cache: Dict[int, List[int]] = {}
        self._eval_tasks: Optional[Dict[str, Any]] = None
        self.services = self._services()
        self.methods.setup(self.services)
        if hasattr(self.sampler, "setup"):  # a sampler that reads the run's models (e.g. the frozen reference policy)
            self.sampler.setup(self.services)
        self.step = 0
        self.update_rng = torch.Generator().manual_seed(cfg.seed)
        self.partial = self._build_partial()
        self.graph = build_graph(cfg)  # what `rlpost config --graph` prints; train() binds the finish stages
        bind_stages(self.graph, LEARN, self.stage_fns())
        self.executed: Dict[int, List[str]] = {}  # step -> names of the stages that ran for it, in order

    def _build_partial(self):
        """The partial-rollout producer (:mod:`rlpost.core.partial`) when ``executor.partial_rollout=true``, else None."""
        ex = self.cfg.executor
        if not bool(ex.get("partial_rollout", False)):
            return None

        if self.cfg.sampler.name == "episode":  # whole episodes (ids, masks, turn count, environment) carried over
            from rlpost.samplers.episode_partial import EpisodePartialProducer

            return EpisodePartialProducer(self.sampler, self.sampler.counts(1, SamplerContext())[0],
                                          over_provision=float(ex.over_provision), pad_id=pad_id_of(self.engine))
        return PartialRolloutProducer(
            int(self.cfg.rollout.max_new_tokens), group_size=self.sampler.counts(1, SamplerContext())[0],
            over_provision=float(ex.over_provision), chunk_tokens=int(ex.partial_chunk_tokens),
            pad_id=pad_id_of(self.engine), train_unfinished=bool(ex.get("partial_train_unfinished", False)),
        )

    def _rollout_sharding(self) -> bool:
        """Whether this run splits rollouts, scoring and no-grad passes across ranks (:mod:`rlpost.distributed`).

        On when several processes run and ``trainer.shard_rollouts`` is not false,
        unless the run uses something that cannot be split (then off, or a
        ConfigError when ``trainer.shard_rollouts=true`` asked for it).

        Raises:
            ConfigError: ``trainer.shard_rollouts=true`` with the asynchronous
                executor, partial rollouts, multi-turn episodes or the
                adaptive-temperature sampler.
        """

        want = self.cfg.trainer.get("shard_rollouts", None)
        if world_size() == 1 or want is False:
            return False
        ex = self.cfg.executor
        blockers = [why for why, on in (
            ("executor=async (its producer thread would interleave collectives with the update's)", ex.name == "async"),
            ("executor.partial_rollout=true (the carry-over buffer is per process)", bool(ex.get("partial_rollout", False))),
            (f"sampler={self.cfg.sampler.name} (environments step per process)", runs_episodes(self.cfg.sampler.name)),
            ("sampler=adaptive_temperature (its temperature hook keeps entropy statistics of the rows it sees)",
             self.cfg.sampler.name == "adaptive_temperature"),
        ) if on]
        if blockers and want is True:
            raise ConfigError(f"trainer.shard_rollouts=true cannot split this run's rollouts across ranks: "
                              f"{'; '.join(blockers)}. Fix: trainer.shard_rollouts=null (every rank then repeats "
                              f"the rollouts) or change what is named.")
        return not blockers

    def _build_trainer(self):
        if self.cfg.trainer.engine == "deepspeed":
            from rlpost.trainer.deepspeed_engine import DeepSpeedTrainer

            return DeepSpeedTrainer.from_config(self.policy, self.cfg, self.device, self.methods, run_dir=self.run_dir,
                                                keep_last=self.cfg.checkpoint.keep_last)

        return TorchTrainer.from_config(self.policy, self.cfg, self.device, self.methods)

    def _services(self) -> RunServices:
        """What the run lends its methods' hooks (:class:`rlpost.methods.base.RunServices`)."""

        t = self.trainer
        return RunServices(
            cfg=self.cfg, logprobs=t.compute_logprobs, forward_pass=t.forward_pass, policy=t.policy,
            reference_policy=t.ref, snapshot=t.snapshot, restore=t.restore, policy_update=t.policy_update,
            engine=self.engine, local_engine=self.local_engine, tokenizer=self.tokenizer, task=self.task,
            examples=self.train_examples, prompt_ids=self.prompt_ids, sampling_params=self.sampling_params,
            reward=lambda texts, examples, lengths: self.reward_fn(texts, examples, lengths)[0],
            build_engine=lambda policy: build_engine(self.engine_cfg, policy, self.tokenizer, self.device),
            rows_pass=self._rows_pass,
        )

    # ------------------------------------------------------------- resume
    def stateful(self) -> Dict[str, Any]:
        """Every component with cross-step state, by checkpoint key (None: not built by this config).

        :func:`rlpost.run.checkpoint.save_checkpoint` and
        :func:`rlpost.run.checkpoint.load_checkpoint` walk this map; a new stateful
        component is one line here. The policy weights and the global RNG
        states are saved beside it.
        """

        return {
            "trainer": self.trainer,  # optimizer, scheduler, critic, reference (trainer.pt)
            "selector": self.selector,
            "sampler": self.sampler,
            "algo_state": self.methods,  # the methods' cross-step state (rlpost.methods.base.Method.state_dict)
            "update_rng": GeneratorState(self.update_rng),
            "partial": self.partial,  # the partial-rollout carry-over buffer
            "reward": self.reward_fn if self.reward_fn.models else None,  # model rewards: running score statistics
        }

    def restore(self, ckpt: Path) -> None:
        """Load a checkpoint written by :meth:`checkpoint` and continue after its step."""

        self.step = load_checkpoint(ckpt, self.trainer.policy, self.stateful())
        self._trained_engine().sync_weights(self.trainer.policy)

    def checkpoint(self) -> Optional[Path]:
        """Write an atomic checkpoint of the current step (files from rank 0 only; None on other ranks)."""

        states = collect_states(self.stateful())  # collective for trainer=deepspeed: every rank calls it
        if not is_main_process():
            return None
        return save_checkpoint(self.run_dir, self.step, self.trainer.policy, self.tokenizer, states,
                               keep_last=self.cfg.checkpoint.keep_last)

    # --------------------------------------------------------------- stages
    def prompt_ids(self, i: int) -> List[int]:
        """Rendered (chat-templated) prompt token ids of training example ``i`` (cached)."""
        if i not in self._prompt_cache:
            self._prompt_cache[i] = self.task.render_prompt(self.train_examples[i], self.tokenizer)
        return self._prompt_cache[i]

    def prompt_entropy(self, indices: List[int]) -> List[float]:
        """The prompt entropy of training examples ``indices`` under the current policy (for selectors).

        The mean next-token entropy (nats, temperature 1) over each rendered
        prompt's tokens, one no-grad prefill per prompt, ``trainer.micro_batch_size``
        prompts per pass and ``trainer.logprob_chunk_size`` positions per LM-head
        chunk (:func:`rlpost.models.logprobs.prompt_entropy`). Passed to the
        selector by :meth:`rlpost.selectors.base.Selector.attach`; a selector that
        reads it calls it from :meth:`select`, before the step's rollouts.

        Weights: the trainer's current policy (under the trainer's autocast). With
        ``executor=async`` and ``max_staleness > 0`` the learner updates that policy
        while the producer selects, so the engine's private copy (the weights this
        step's rollouts are generated with) is used instead.

        Returns:
            one entropy per index, in nats.
        Raises:
            ConfigError: async with staleness and an engine without a torch model (vLLM).
        """

        ex = self.cfg.executor
        autocast = None
        if ex.name == "async" and int(ex.get("max_staleness", 0)) > 0:
            model = getattr(self.engine, "model", None)
            if not isinstance(model, torch.nn.Module):
                raise ConfigError("a selector reading prompt entropy with executor=async max_staleness>0 computes it on the "
                                  "rollout engine's weights, which rollout.engine=vllm does not expose. Fix: use "
                                  "rollout.engine=hf, executor.max_staleness=0 or another selector.")
        else:
            model, autocast = self.trainer.policy, self.trainer.autocast
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return prompt_entropy(
            model, [self.prompt_ids(int(i)) for i in indices], int(pad or 0),
            batch_size=self.cfg.trainer.micro_batch_size, chunk_size=self.cfg.trainer.logprob_chunk_size,
            autocast=autocast,
        )

    def sampling_params(self, step: int) -> SamplingParams:
        """The rollout sampling parameters of ``step`` (seeded for exact resume)."""
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop=list(r.stop), seed=step_seed(self.cfg.seed, step),
        )  # per-token temperature is the sampler's (sampler=adaptive_temperature), never set here

    def train_step(self) -> Dict[str, Any]:
        """Run every stage once (synchronously); returns the step's metrics."""
        return self.learn(self.collect(self.step + 1, self.trainer.version, self.step))

    def collect(self, step: int, version: int, weights_step: int) -> "Collected":
        """Producer half of step ``step``: select -> rollout -> score (each rollout once) -> selector update.

        Every producer (the sampler driver, the partial-rollout producer; the
        async executor calls this method from its thread) returns the same
        scored :class:`rlpost.run.collect.StepRollouts`, scored by one
        :class:`rlpost.rewards.StepScorer`; the selector learns from exactly the
        rewards the batch trains on.

        Args:
            step: the RL step these rollouts are for (seeds derive from it).
            version: trainer version (optimizer steps) of the engine's weights.
            weights_step: RL steps completed by those weights (staleness unit).
        """

        t_step, cpu0 = time.perf_counter(), cpu_seconds()
        scorer: Any = StepScorer(self.reward_fn, self.train_examples)
        if self.shard:  # each rank scores its share of every scoring call; rewards are gathered
            from rlpost.distributed import ShardedScorer

            scorer = ShardedScorer(scorer)
        if self.partial is not None:
            out = self._partial_rollouts(step, version, weights_step, scorer)
        else:
            out = collect_rollouts(
                self.selector, self.sampler, self.engine, self.sampling_params(step), step=step, encode=self.prompt_ids,
                score=scorer, hint=make_hint_fn(self.train_examples, self.tokenizer, self.task.reference_solution),
                seed=step_seed(self.cfg.seed, step, "sampler"),
            )
        out.finish(scorer.metrics()).update_selector(self.selector)
        if hasattr(self.engine, "step_metrics"):  # launcher=ray: worker CPU, weight pushes, failures (ray/...)
            out.metrics.update(self.engine.step_metrics())
        examples = [self.train_examples[int(i)] for i in out.row_prompt_index]
        batch = out.to_batch([e.answer for e in examples], version, weights_step)
        t_rollout = time.perf_counter() - t_step - scorer.seconds
        self.mark(step, *PRODUCER_STAGES)
        return Collected(step, batch, examples, out.group_rewards(), out.reward_metrics, out, t_step, t_rollout,
                         scorer.seconds, weights_step, cpu_seconds() - cpu0)

    def _partial_rollouts(self, step: int, version: int, weights_step: int, score: Any) -> Any:
        """The step's rollouts through the partial-rollout producer (:mod:`rlpost.core.partial`).

        Returns the same :class:`rlpost.run.collect.StepRollouts` as
        :func:`rlpost.run.collect.collect_rollouts` (rows grouped by prompt,
        compact group ids, every row scored once by ``score`` with its generated
        token count, the same ``rollout/...`` metrics) plus ``partial/...``
        metrics and, in ``result.extras``, the per-token ``token_version`` /
        ``token_policy_step`` ``[B, R]`` (-1 on padding) and the per-row
        ``policy_step`` of the oldest token ``[B]``. The stitched per-token
        behaviour log-probs become ``rollout_logprobs``.
        """

        skipped = [0]

        def select() -> List[int]:
            out = list(self.selector.select(step))
            skipped[0] += int(self.selector.skipped)
            return out

        ps = self.partial.produce(int(self.cfg.selector.prompts_per_step), select, self.prompt_ids, self.engine,
                                  self.sampling_params(step), version, weights_step)
        sb = ps.batch
        gmap: Dict[int, int] = {}
        gi = torch.tensor([gmap.setdefault(int(g), len(gmap)) for g in sb.group.tolist()], dtype=torch.long)
        first_row = {int(g): r for r, g in reversed(list(enumerate(gi.tolist())))}
        prompt_indices = [ps.prompt_index[first_row[g]] for g in range(len(gmap))]
        texts = getattr(ps, "texts", None) or [  # episodes: the final turn's text, which the verifier scores
            self.tokenizer.decode(sb.response_ids[b][sb.response_mask[b] > 0].tolist(), skip_special_tokens=True)
            for b in range(len(gi))]
        temps = sb.temperatures if sb.temperatures is not None else float(self.cfg.rollout.temperature) * sb.response_mask
        gen = GenerationResult(sb.prompt_ids, sb.prompt_mask, sb.response_ids, sb.response_mask, sb.rollout_logprobs,
                               temps, sb.finished, texts)
        extras = {"token_version": sb.token_version, "token_policy_step": ps.token_step,
                  "policy_step": row_oldest(ps.token_step, sb.response_mask), **getattr(ps, "extras", {})}
        res = SampleResult(gen, gi, ps.new_groups * self.partial.group_size, extras, {})
        # rows are positions in prompt_indices (one group per prompt position)
        score_rows(SamplerContext(score=lambda rows, t, n, **kw: score([prompt_indices[r] for r in rows], t, n, **kw)), res)
        rewards = res.rewards
        if getattr(ps, "episodes", None):  # RUN_DIR/transcripts/step_NNNNNN.json, as the per-step sampler writes
            self.sampler._write_transcript(SamplerContext(step=step, prompt_indices=ps.prompt_index), ps.episodes, res)
        done = ~ps.extras["window_truncated"] if "window_truncated" in ps.extras else torch.ones(len(gi), dtype=torch.bool)
        # the selector learns only from complete responses (a window-cut row has no outcome yet)
        observed = [(prompt_indices[g], rewards[(gi == g) & done].tolist()) for g in range(len(gmap))
                    if bool(((gi == g) & done).any())]
        out = StepRollouts(res, prompt_indices, rewards, observed)
        out.metrics = {**rollout_metrics(out, res.rollouts_spent, ps.rounds, skipped[0]), **ps.metrics}
        try:
            out.metrics.update(self.selector.metrics())
        except Exception:  # pragma: no cover - metrics must never break a step
            pass
        return out

    def mark(self, step: int, *names: str) -> None:
        """Record that stages ``names`` ran for ``step`` (:attr:`executed`; read by tests and the summary)."""
        self.executed.setdefault(step, []).extend(names)

    def stage_fns(self) -> Dict[str, Callable[["LearnContext"], None]]:
        """The callables of the learn-phase stages of :func:`build_graph`, by stage name."""
        return {"algo_inputs": self._algo_inputs, "old_logprobs": self._old_logprobs, "ref_logprobs": self._ref_logprobs,
                "teacher_logprobs": self._teacher_logprobs,
                "values": self._values, "advantages": self._advantages, "critic_update": self._critic_update,
                "policy_update": self._policy_update, "sync": self._sync}

    def learn(self, c: "Collected", sync_engine: bool = True) -> Dict[str, Any]:
        """Learner half of a step: the enabled ``learn`` stages of :attr:`graph`, in order; returns metrics.

        Args:
            c: the producer half's output.
            sync_engine: load the updated weights into the rollout engine (the
                asynchronous executor loads its engine itself).
        """
        ctx = LearnContext(c, c.batch, {"step": c.step}, sync_engine)
        cpu0 = cpu_seconds()
        for st in self.graph:
            if st.phase == LEARN and st.enabled:
                t0 = time.perf_counter()
                st.fn(ctx)
                ctx.seconds[st.name] = time.perf_counter() - t0
                self.mark(c.step, st.name)
        self.step = c.step
        ctx.cpu_learn = cpu_seconds() - cpu0
        return self._step_metrics(ctx)

    # learn-phase stages: each reads and extends ctx.batch.extras / ctx.metrics
    def _algo_inputs(self, ctx: "LearnContext") -> None:
        """The methods' inputs (:meth:`rlpost.methods.base.Method.prepare`), in their declared order."""
        self.services.step = ctx.c.step
        ctx.metrics.update(self.methods.prepare(ctx.batch, self.services))

    def _rows_pass(self, batch: RolloutBatch, fn: Callable[[RolloutBatch], torch.Tensor],
                   collective_model: bool = False) -> torch.Tensor:
        """``fn(batch)`` ``[B, R]``; with sharded rollouts each rank computes its groups' rows and they are gathered.

        ``collective_model``: the pass runs a ZeRO-3-partitioned module, whose
        forward is itself collective; ranks then compute the whole batch in step.
        """
        if not self.shard or collective_model:
            return fn(batch)

        rows = sharded_rows(batch.group_index)
        local = fn(batch.select(rows)) if rows else None
        return gather_rows(local, rows, len(batch), batch.response_mask.shape[1])

    def _old_logprobs(self, ctx: "LearnContext") -> None:
        ctx.batch.extras["old_logprobs"] = self._rows_pass(ctx.batch, lambda b: self.trainer.compute_logprobs(b)[0])
        self.services.step = ctx.c.step
        ctx.metrics.update(self.methods.after_old_logprobs(ctx.batch, self.services))

    def _ref_logprobs(self, ctx: "LearnContext") -> None:
        ctx.batch.extras["ref_logprobs"] = self._rows_pass(ctx.batch,
                                                           lambda b: self.trainer.compute_logprobs(b, "ref")[0])

    def _teacher_logprobs(self, ctx: "LearnContext") -> None:
        """``extras['teacher_logprobs']`` ``[B, R]`` (+ top-K ids / log-probs ``[B, R, K]``) from the frozen teacher."""

        k = teacher_top_k(self.cfg.algo)
        out = self.teacher.score(ctx.batch, self.trainer, top_k=k)
        ctx.batch.extras.update(out)
        m = ctx.batch.response_mask
        gap = (ctx.batch.rollout_logprobs - out["teacher_logprobs"]) * m
        ctx.metrics["teacher/logprob_gap"] = float(gap.sum() / m.sum().clamp(min=1))  # sampled-token reverse-KL estimate

    def _values(self, ctx: "LearnContext") -> None:
        zero3 = self.cfg.trainer.engine == "deepspeed" and int(self.cfg.trainer.zero_stage) == 3
        ctx.batch.extras["values"] = self._rows_pass(ctx.batch, self.trainer.compute_values, collective_model=zero3)

    def _advantages(self, ctx: "LearnContext") -> None:
        a, batch = self.cfg.algo, ctx.batch
        token_rewards = None
        if a.kl.coef > 0 and a.kl.in_reward:
            kl = kl_penalty(a.kl.estimator, batch.extras["old_logprobs"], batch.extras["ref_logprobs"])
            token_rewards = -a.kl.coef * kl * batch.response_mask
            ctx.metrics["actor/kl_ref"] = float((kl * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))
        if "turn_rewards" in batch.extras:  # multi-turn episodes: per-turn rewards on each turn's last model token
            token_rewards = batch.extras["turn_rewards"] if token_rewards is None else token_rewards + batch.extras["turn_rewards"]
        out = compute_advantages(
            a.adv_estimator, AdvantageInput.from_batch(batch, token_rewards),
            **adv_overrides(a),  # the estimator's own parameters; shaping keys went to the reward function
        )
        batch.extras["advantages"] = out.advantages
        batch.extras.update(out.extras)  # per-row inputs the estimator computed over the whole batch for the loss
        if out.loss_mask is not None:  # tokens the estimator takes out of the update (e.g. a group's pivot)
            n_before = batch.response_mask.sum().clamp(min=1)
            batch.response_mask = batch.response_mask * out.loss_mask
            ctx.metrics["adv/loss_mask_dropped_frac"] = float(1 - batch.response_mask.sum() / n_before)
        if getattr(self.sampler, "token_level", False):  # a sampler that selects loss tokens from |A| and entropy
            from rlpost.samplers.prune import apply_loss_token_mask

            ent = batch.extras.get("entropy")
            if ent is None:
                ent = self._rows_pass(batch, lambda b: self.trainer.compute_logprobs(b, with_entropy=True)[1])
            ctx.metrics.update(apply_loss_token_mask(self.sampler, batch, ent, ctx.c.step))
        if out.returns is not None:
            batch.extras["returns"] = out.returns
        if out.value_mask is not None:  # the critic regresses only there (e.g. turn starts)
            batch.extras["value_mask"] = out.value_mask
        self.services.step = ctx.c.step
        ctx.metrics.update(self.methods.after_advantages(batch, self.services))  # e.g. a learned mix of critics

    def _critic_update(self, ctx: "LearnContext") -> None:
        ctx.metrics.update(self.trainer.critic_update(ctx.batch))

    def _policy_update(self, ctx: "LearnContext") -> None:
        a = self.cfg.algo
        if ctx.c.step > a.critic.warmup_steps or not a.critic.enabled:
            # a method may run the update its own way (e.g. accept or roll back the candidate)
            ctx.metrics.update(self.methods.wrap_update(lambda: self.trainer.policy_update(ctx.batch, self.update_rng),
                                                        self.services, ctx.batch))
        else:
            ctx.metrics["actor/frozen_for_critic_warmup"] = 1.0

    def _sync(self, ctx: "LearnContext") -> None:
        if ctx.sync_engine:  # else the asynchronous executor's producer loads the weights itself
            self._trained_engine().sync_weights(self.trainer.policy)

    def _trained_engine(self) -> Any:
        """The engine that follows the trained weights: the rollout engine, or the evaluation engine when the
        rollouts sample the frozen reference (``Needs.frozen_rollouts``)."""
        return self.local_engine if self.frozen_rollouts else self.engine

    def _step_metrics(self, ctx: "LearnContext") -> Dict[str, Any]:
        """The step's logged metrics from the producer's output and the learn stages' results."""
        c, batch, m = ctx.c, ctx.batch, ctx.metrics
        step, per_prompt, step_out = c.step, c.per_prompt, c.step_out
        sres, gen = step_out.result, step_out.result.generation
        rewards, lengths = batch.rewards, batch.response_mask.sum(-1)
        adv = batch.extras["advantages"]
        t_update = sum(ctx.seconds.get(n, 0.0) for n in UPDATE_STAGES)
        ntok = gen.num_tokens
        zero_var = sum(1 for g in per_prompt if len(g) > 1 and max(g) == min(g))
        m.update({
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            **c.reward_metrics,
            "response/length_mean": float(lengths.float().mean()),
            "response/truncated_frac": float((~gen.finished).float().mean()),
            "rollout/rollouts_spent": float(sres.rollouts_spent),
            "rollout/zero_var_group_frac": zero_var / max(1, len(per_prompt)),
            "rollout/policy_version": float(batch.policy_version.float().mean()),
            "adv/mean": float((adv * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)),
            "time/rollout_s": c.t_rollout,
            "time/reward_s": c.t_reward,
            "time/update_s": t_update,
            "throughput/rollout_tokens_per_s": ntok / max(c.t_rollout, 1e-9),
            **step_out.metrics,
        })
        if "token_policy_step" in batch.extras:  # partial rollouts: per-token staleness in RL steps
            tm = batch.response_mask > 0
            st = ((step - 1) - batch.extras["token_policy_step"])[tm].float()
            m["partial/token_staleness_mean"] = float(st.mean()) if st.numel() else 0.0
            m["partial/token_staleness_max"] = float(st.max()) if st.numel() else 0.0
        m["bench/update_tokens"] = float(batch.prompt_mask.sum() + batch.response_mask.sum())
        pop = getattr(self.local_engine, "pop_metrics", None)  # engine counters (rollout.speculative: spec/...)
        if pop is not None:
            m.update(pop())
        m["time/step_s"] = time.perf_counter() - c.t_start
        cpu = [(c.cpu_rollout, ctx.cpu_learn)]
        if self.shard:  # every rank runs this step's learn stages in step: add up the work of all ranks
            from rlpost.distributed import all_gather_object

            cpu = all_gather_object(cpu[0])
        # every process's rollout work: the ranks' (gathered above) and launcher=ray's workers'
        m["time/rollout_cpu_s"] = float(sum(x for x, _ in cpu)) + float(m.get("ray/worker_cpu_s", 0.0))
        m["time/learn_cpu_s"] = float(sum(y for _, y in cpu))
        m["memory/peak_rss_mb"] = peak_rss_mb()
        return m

    def evaluate(self, progress: Optional[str] = None, leave: bool = True):
        """Greedy evaluation on the task's held-out split and on every ``eval.tasks`` entry.

        ``progress`` labels a console progress bar over the training task's responses (None: no
        bar); ``leave=False`` removes it when done (an evaluation inside training's own bar).

        Returns:
            ``(metrics, result)``: flat ``eval/...`` scalars (``eval/accuracy`` is the
            training task's) and the training task's full result dict.
        """

        name = self.cfg.task.name
        # a sampler that conditions its prompts renders the held-out prompts too (Sampler.eval_task; default: the task)
        cond = getattr(self.sampler, "eval_task", lambda t: t)
        if runs_episodes(self.cfg.sampler.name):  # multi-turn: evaluate episodes with the training environment
            from rlpost.eval.episodes import evaluate_episodes

            res = evaluate_episodes(self.sampler, self.local_engine, self.tokenizer, self.task, self.reward_fn,
                                    self.cfg.eval, seed=self.cfg.seed, progress=progress, leave=leave)
            out = {"eval/accuracy": res["accuracy"],
                   **{f"eval/{name}/{k}": res[k] for k in ("tool_call_frac", "turns_mean", "truncated_frac")}}
        else:
            res = evaluate(self.local_engine, self.tokenizer, cond(self.task), self.cfg.eval, seed=self.cfg.seed,
                           rollout_cfg=self.cfg.rollout, progress=progress, leave=leave)
            out = {"eval/accuracy": res["accuracy"], **scalar_metrics(res, f"eval/{name}")}
        if self.cfg.eval.get("tasks"):
            if self._eval_tasks is None:
                self._eval_tasks = build_eval_tasks(list(self.cfg.eval.tasks))
            out.update(evaluate_tasks(self.local_engine, self.tokenizer, {k: cond(t) for k, t in self._eval_tasks.items()},
                                      self.cfg.eval, seed=self.cfg.seed)["metrics"])
        return out, res

    def close(self) -> None:
        """Stop worker processes and engines."""
        self.reward_fn.close()
        self.engine.close()


def bind_stages(graph: List[Stage], phase: str, fns: Dict[str, Callable[..., Any]]) -> List[Stage]:
    """Give every enabled stage of ``phase`` its callable from ``fns``; returns those stages in order.

    Raises:
        KeyError: an enabled stage of ``phase`` has no callable in ``fns``.
    """
    out = []
    for st in graph:
        if st.phase == phase and st.enabled:
            st.fn = fns[st.name]
            out.append(st)
    return out


def train(cfg: DictConfig, run_dir: Path) -> Dict[str, Any]:
    """Train per ``cfg`` in ``run_dir``; returns the last step's metrics.

    Resumes from ``cfg.resume`` (see :func:`rlpost.run.checkpoint.find_resume_checkpoint`)
    and says from which step, or that it starts fresh; when that checkpoint
    belongs to another run directory, the run continues there. Each step runs
    the producer stages (:meth:`Run.collect`, via the executor), the learn
    stages (:meth:`Run.learn`) and then the finish stages of the run graph
    (evaluate, log, checkpoint). Writes ``config.yaml``, ``metrics.jsonl``,
    checkpoints, ``eval_start.json`` (``eval.at_start``), ``eval.json``,
    ``final/`` (the trained policy in Hugging Face format; LoRA: merged, the adapter
    in ``final/adapter/``, :func:`rlpost.run.checkpoint.export_final`) and ``DONE``, and
    logs a closing summary (:func:`rlpost.core.tracking.format_summary`) to the
    ``rlpost`` logger (console and ``cli.log`` under the CLI).

    Raises:
        Interrupted: after SIGINT/SIGTERM: the step in progress was finished and
            checkpointed; the message names the checkpoint and what it holds.
    """

    t_wall = time.time()
    main = is_main_process()  # under trainer.num_procs > 1 only rank 0 logs, evaluates and writes files
    run_dir, ckpt = _resume_point(cfg, Path(run_dir), main)
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    stop = StopRequest()
    with stop:
        run = Run(cfg, run_dir)
        stop.step = lambda: run.step
        if ckpt is not None:
            run.restore(ckpt)
        start_step = run.step
        if main:
            from rlpost.run.checkpoint import disk_line, estimate_disk

            keep = int(cfg.checkpoint.keep_last)
            log.info(disk_line(run_dir, estimate_disk(run.trainer, keep, run.tokenizer), keep))
        logger = RunLogger(
            run_dir, cfg.logger.backend, OmegaConf.to_container(cfg, resolve=True), name=f"{cfg.name}",
            project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode, tags=list(cfg.logger.tags),
            resume_step=run.step if ckpt is not None else None,
        ) if main else _NullLogger()
        executor = build_executor(cfg, run)
        last: Dict[str, Any] = {}
        saved: Dict[str, Any] = {"step": start_step if ckpt is not None else None, "path": ckpt}
        step_log = logging.getLogger("rlpost.step")  # one line per step, to cli.log only
        finish = _bind_finish(run, cfg, executor, logger, saved, stop, main, run_dir)
        progress = None
        try:
            if cfg.eval.at_start and run.step == 0 and main and not stop.requested:
                with executor.paused():
                    em, res0 = run.evaluate(progress="evaluating the base model (step 0)")
                step_log.info(eval_line(res0, "at step 0 (base model)"))
                (run_dir / "eval_start.json").write_text(json.dumps(_eval_summary(res0), indent=1, default=str))
                logger.log({"step": 0, **em})
                run.mark(0, "evaluate", "log")
            # after the base-model evaluation: its time is not in the training bar's elapsed time
            progress = _progress(cfg.steps, run.step, enabled=main)
            while run.step < cfg.steps and not stop.requested:
                m = executor.step()
                for st in finish:
                    if st.fn(m):
                        run.mark(run.step, st.name)
                last = m
                progress.update(m)
            if stop.requested:
                if run.step > start_step and saved["step"] != run.step:
                    with executor.paused():
                        saved["path"], saved["step"] = run.checkpoint(), run.step
                raise Interrupted(_interrupted_message(stop.name, run.step, cfg.steps, start_step, ckpt, saved,
                                                       continue_command(run_dir)))
            if main:
                export_final(run.trainer.policy, run.tokenizer, run_dir / "final", cfg.model)
                (run_dir / DONE_MARKER).write_text(f"{run.step}\n")
                (run_dir / FAILED_MARKER).unlink(missing_ok=True)  # an earlier failure, resumed past
        finally:
            executor.close()
            if progress is not None:
                progress.close()
            logger.close()
            run.close()
    if main:
        log.info(format_summary(run_dir, cfg, wall_s=time.time() - t_wall, peak_mb=peak_memory_mb(run.device),
                                wandb=getattr(logger, "wandb_info", None)))
    return last


def _resume_point(cfg: DictConfig, run_dir: Path, main: bool) -> tuple:
    """``(run directory, checkpoint or None)`` of ``cfg.resume``; says on rank 0 where the run resumes from.

    A checkpoint of another run directory moves the run there.
    """

    ckpt = find_resume_checkpoint(cfg.resume, run_dir)
    if ckpt is not None:
        run_dir = ckpt.parent.parent
    if main and cfg.resume not in (None, "", "none", "null"):
        if ckpt is not None:
            log.info(f"resume={cfg.resume}: resuming from {ckpt} (step {int(ckpt.name.split('_')[-1])} of {cfg.steps})")
        else:
            log.info(f"resume={cfg.resume}: no checkpoint in {run_dir} or an unfinished run beside it; "
                     f"starting fresh from step 0")
    return run_dir, ckpt


def _interrupted_message(signal_name: str, step: int, steps: int, start_step: int, ckpt: Optional[Path],
                         saved: Dict[str, Any], continue_cmd: str) -> str:
    """What an interrupted run says: what it saved (or that nothing was) and how to continue."""
    if saved["path"] is not None and saved["step"] is not None:
        what = (f"saved {describe_checkpoint(saved['path'])}" if saved["step"] > start_step or ckpt is None
                else f"no step finished since the checkpoint it resumed from, {saved['path']}")
        return f"interrupted ({signal_name}) after step {step} of {steps}: {what}. Continue with: {continue_cmd}"
    return (f"interrupted ({signal_name}) before the first step finished: nothing to save "
            f"(no checkpoint exists); the next run starts fresh")


def _bind_finish(run: "Run", cfg: DictConfig, executor: Any, logger: Any, saved: Dict[str, Any], stop: Any,
                 main: bool, run_dir: Path) -> List[Stage]:
    """The finish stages of the run graph bound to their callables; each decides whether a step is one of its own.

    ``saved`` (``{"step", "path"}``) records the newest checkpoint; ``stop`` is the run's
    :class:`rlpost.run.interrupts.StopRequest` (an interrupt forces a checkpoint).
    """

    step_log = logging.getLogger("rlpost.step")  # one line per step, to cli.log only

    def evaluate(m: Dict[str, Any]) -> bool:
        at_end = run.step == cfg.steps and cfg.eval.at_end
        if not main or not (at_end or (cfg.eval.every > 0 and run.step % cfg.eval.every == 0 and run.step < cfg.steps)):
            return False
        with executor.paused():
            em, res = run.evaluate(progress=f"evaluating at step {run.step}", leave=False)
        step_log.info(eval_line(res, f"at step {run.step}"))
        m.update(em)
        if at_end:
            (run_dir / "eval.json").write_text(json.dumps(_eval_summary(res), indent=1, default=str))
        return True

    def log_metrics(m: Dict[str, Any]) -> bool:
        logger.log(m)
        if main:
            step_log.info(step_line(m, cfg.steps))
        return True

    def checkpoint(m: Dict[str, Any]) -> bool:
        if not ((cfg.checkpoint.every > 0 and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps
                or stop.requested):
            return False
        with executor.paused():
            saved["path"], saved["step"] = run.checkpoint(), run.step
        return True

    return bind_stages(run.graph, FINISH, {"evaluate": evaluate, "log": log_metrics, "checkpoint": checkpoint})


def peak_memory_mb(device: torch.device) -> Dict[str, float]:
    """``{"rss": peak resident MiB of this process}``, plus ``"cuda"`` (peak allocated MiB) on a GPU."""
    out = {"rss": peak_rss_mb()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _eval_summary(res: Dict[str, Any]) -> Dict[str, Any]:
    return res


class _NullLogger:
    """Logger of ranks > 0: they compute the same metrics as rank 0, which logs them."""

    def log(self, m: Dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class _progress:
    """Console progress bar (tqdm, on stderr) with live reward, throughput, the step's seconds and the last
    eval accuracy.

    The seconds per step are the step's own ``time/step_s``, formatted by
    :func:`rlpost.core.tracking.step_seconds` as ``cli.log``'s step lines print them; tqdm's own rate
    (elapsed time over bar updates, evaluations and checkpoint writes included) is not shown.
    """

    FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

    def __init__(self, total: int, start: int, enabled: bool = True, file: Any = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="rlpost train", unit="step", dynamic_ncols=True,
                        disable=not enabled, bar_format=self.FORMAT, file=file)

    def update(self, m: Dict[str, Any]) -> None:
        """Advance one step and show ``m``'s figures."""

        post = [f"reward={m.get('reward/mean', 0):.3f}", f"tok/s={m.get('throughput/rollout_tokens_per_s', 0):.0f}"]
        if step_seconds(m) is not None:
            post.append(step_seconds(m))
        if "eval/accuracy" in m:
            post.append(f"eval_acc={m['eval/accuracy']:.3f}")
        self.bar.set_postfix_str(", ".join(post), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _check_episode_rewards(cfg: Any) -> None:
    """``env_reward_at=turn`` puts per-turn rewards in token rewards: the estimator must read them.

    Raises:
        ConfigError: an estimator not tagged ``uses_token_rewards`` (the rewards would be dropped).
    """

    p = cfg.sampler.params or {}
    if str(p.get("env_reward_at", "episode")) == "turn" and float(p.get("env_reward_weight", 0.0) or 0.0):
        if not ADV_ESTIMATORS.entry(cfg.algo.adv_estimator).tags.get("uses_token_rewards"):
            users = ", ".join(e.name for e in ADV_ESTIMATORS if e.tags.get("uses_token_rewards"))
            raise ConfigError(f"sampler.params.env_reward_at=turn gives per-turn token rewards, which "
                              f"algo.adv_estimator={cfg.algo.adv_estimator} ignores. Fix: an estimator that reads "
                              f"them ({users}) or env_reward_at=episode")
