"""The run graph and its executor: one readable training loop.

A config becomes an explicit list of stages (:func:`build_graph`), which
``rlpost config --graph`` prints. :func:`train` runs them every step:

    select -> rollout -> reward -> logprobs -> advantages -> update -> sync -> evaluate -> checkpoint -> log

Everything algorithmic is a registered pure function in :mod:`rlpost.algos`; this
module only moves tensors between stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.regularizers import kl_penalty
from rlpost.batch import RolloutBatch
from rlpost.checkpoint import DONE_MARKER, find_resume_checkpoint, save_checkpoint, set_rng_state
from rlpost.rollout.base import SamplingParams


@dataclass
class Stage:
    """One node of the run graph: a name, what it does, and whether this config runs it."""

    name: str
    description: str
    enabled: bool = True


def build_graph(cfg: DictConfig) -> List[Stage]:
    """The stages a config runs each step, in order (disabled ones are listed too)."""
    a = cfg.algo
    need_old = needs_old_logprobs(a)
    return [
        Stage("select", f"selector={cfg.selector.name}: choose {cfg.selector.prompts_per_step} prompts of task={cfg.task.name}"),
        Stage("rollout", f"sampler={cfg.sampler.name} x{a.n_samples_per_prompt} via rollout={cfg.rollout.engine} "
              f"({cfg.precision.rollout_dtype}, T={cfg.rollout.temperature}, max_new_tokens={cfg.rollout.max_new_tokens})"
              + (f"; partial rollouts: chunks of {cfg.executor.partial_chunk_tokens} tokens, "
                 f"over_provision {cfg.executor.over_provision}, unfinished groups carried over"
                 if cfg.executor.get("partial_rollout", False) else "")),
        Stage("reward", f"task verifier (timeout {cfg.task.reward.timeout_s}s, failures -> 0) + shaping"),
        Stage("old_logprobs", "trainer log-probs of the rollouts before the update (else: current, detached)", need_old),
        Stage("ref_logprobs", f"reference-model log-probs for KL ({a.kl.estimator}, coef {a.kl.coef})", a.kl.coef > 0),
        Stage("values", "critic values V(s_t)", a.critic.enabled),
        Stage("advantages", f"adv_estimator={a.adv_estimator}"
              + (f" (baseline={(a.adv_params or {}).get('baseline')})" if (a.adv_params or {}).get("baseline") else "")),
        Stage("critic_update", "value-loss regression on returns", a.critic.enabled),
        Stage("policy_update", f"loss={a.loss} agg={a.loss_agg} epochs={a.ppo_epochs} mini_batches={a.mini_batches} "
              f"trainer={cfg.trainer.engine} ({cfg.precision.trainer_dtype})"
              + (f" correction={cfg.precision.correction}" if cfg.precision.correction != "none" else "")),
        Stage("sync", "push updated weights to the rollout engine"),
        Stage("evaluate", f"greedy accuracy on {cfg.eval.limit} held-out prompts every {cfg.eval.every} steps"
              + (" and at the end" if cfg.eval.at_end else ""), cfg.eval.every > 0 or cfg.eval.at_end),
        Stage("checkpoint", f"every {cfg.checkpoint.every} steps, keep {cfg.checkpoint.keep_last}"),
        Stage("log", f"metrics.jsonl + logger={cfg.logger.backend}"),
    ]


def needs_old_logprobs(a: Any) -> bool:
    """Whether the update needs a forward pass for the pre-update log-probs.

    Several optimizer steps per batch anchor their ratios to them, unless
    A-3PO's interpolation replaces them (``algo.loss_params.proximal=a3po``,
    arXiv:2512.06547); KL-in-reward reads them too, and so does VCPO's
    minimum-variance baseline (``algo.adv_params.baseline=min_variance``,
    arXiv:2602.17616: sequence weights ``pi_old / pi_behav``).
    """
    a3po = (a.loss_params or {}).get("proximal", "recompute") == "a3po"
    min_var = (a.adv_params or {}).get("baseline", "mean") == "min_variance"
    return (a.ppo_epochs * a.mini_batches > 1 and not a3po) or (a.kl.coef > 0 and a.kl.in_reward) or min_var


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


def format_graph(cfg: DictConfig) -> str:
    """Human-readable run graph."""
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
    (:func:`rlpost.trainer.launch.local_device`)."""
    from rlpost.trainer.launch import local_device

    return local_device(name)


def is_main_process() -> bool:
    """True for the only process, or rank 0 of a ``trainer.num_procs > 1`` launch: it writes logs and files."""
    return int(os.environ.get("RANK", "0")) == 0


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
        from rlpost.config.compose import validate_config
        from rlpost.models.loader import load_policy
        from rlpost.rewards import RewardFunction
        from rlpost.rollout import build_engine
        from rlpost.samplers import build_sampler
        from rlpost.samplers.base import check_allocation
        from rlpost.selectors import build_selector
        from rlpost.tasks import build_task

        validate_config(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.device = pick_device(cfg.device)
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
        if cfg.sampler.name == "episode" and bool(cfg.executor.get("partial_rollout", False)):
            from rlpost.errors import ConfigError

            raise ConfigError("executor.partial_rollout=true does not carry unfinished multi-turn episodes over yet "
                              "(it would silently drop the environment). Fix: executor.partial_rollout=false with env=...")
        from rlpost.algos.stages import check_sampler

        check_sampler(cfg.algo, cfg.sampler.name)  # per-token temperature: the sampler's only
        # all reward shaping lives here (e.g. algo=dapo's overlong window); its config errors stop the run early too
        self.reward_fn = RewardFunction.from_config(self.task, cfg.task.reward, max_len=cfg.rollout.max_new_tokens,
                                                    preset_shaping=cfg.algo.adv_params)
        from rlpost.memory import preflight

        preflight(cfg, self.device)  # per-GPU memory budget: stop with the cheapest fix before loading 8B weights
        self.policy, self.tokenizer = load_policy(cfg.model, torch.float32, seed=cfg.seed)
        self.trainer = self._build_trainer()
        self.engine = build_engine(cfg, self.trainer.policy, self.tokenizer, self.device)
        self._prompt_cache: Dict[int, List[int]] = {}
        self._eval_tasks: Optional[Dict[str, Any]] = None
        from rlpost.algos.stages import AlgoState, algo_requirements

        self.algo_state = AlgoState(algo_requirements(cfg.algo))
        self.step = 0
        self.update_rng = torch.Generator().manual_seed(cfg.seed)
        self.partial = self._build_partial()

    def _build_partial(self):
        """The APRIL / CoPRIS partial-rollout producer when ``executor.partial_rollout=true``, else None."""
        ex = self.cfg.executor
        if not bool(ex.get("partial_rollout", False)):
            return None
        from rlpost.partial import PartialRolloutProducer
        from rlpost.samplers.base import SamplerContext, pad_id_of

        return PartialRolloutProducer(
            int(self.cfg.rollout.max_new_tokens), group_size=self.sampler.counts(1, SamplerContext())[0],
            over_provision=float(ex.over_provision), chunk_tokens=int(ex.partial_chunk_tokens),
            pad_id=pad_id_of(self.engine),
        )

    def _build_trainer(self):
        if self.cfg.trainer.engine == "deepspeed":
            from rlpost.trainer.deepspeed_engine import DeepSpeedTrainer

            return DeepSpeedTrainer(self.policy, self.cfg, self.device, run_dir=self.run_dir)
        from rlpost.trainer.torch_engine import TorchTrainer

        return TorchTrainer(self.policy, self.cfg, self.device)

    # ------------------------------------------------------------- resume
    def restore(self, ckpt: Path) -> None:
        """Load a checkpoint written by :meth:`checkpoint` and continue after its step.

        Restores the policy, the trainer (optimizer, scheduler, critic, reference),
        the selector, the sampler, the algorithm's cross-step state
        (:class:`rlpost.algos.stages.AlgoState`: MSSR's Beta tracker, HAPO's
        entropy statistics), the update generator and the global RNGs.
        """
        from safetensors.torch import load_file

        files = sorted((ckpt / "policy").glob("*.safetensors"))
        sd: Dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        self.trainer.policy.load_state_dict(sd, strict=False)
        if getattr(self.trainer.policy.config, "tie_word_embeddings", False):
            self.trainer.policy.tie_weights()
        self.trainer.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=False))
        state = torch.load(ckpt / "state.pt", weights_only=False)
        self.selector.load_state_dict(state["selector"])
        self.sampler.load_state_dict(state.get("sampler", {}))
        self.algo_state.load_state_dict(state.get("algo_state", {}))  # absent in checkpoints before it was saved
        if self.partial is not None and state.get("partial") is not None:
            self.partial.load_state_dict(state["partial"])
        self.update_rng.set_state(state["update_rng"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.engine.sync_weights(self.trainer.policy)

    def checkpoint(self) -> Optional[Path]:
        """Write an atomic checkpoint of the current step (files from rank 0 only; None on other ranks).

        ``state.pt`` holds every piece of cross-step state :meth:`restore` reads back.
        """
        trainer_state = self.trainer.state_dict()  # collective for trainer=deepspeed: every rank calls it
        if not is_main_process():
            return None
        return save_checkpoint(
            self.run_dir, self.step, self.trainer.policy, self.tokenizer, trainer_state,
            {"selector": self.selector.state_dict(), "sampler": self.sampler.state_dict(),
             "algo_state": self.algo_state.state_dict(), "update_rng": self.update_rng.get_state(),
             "partial": self.partial.state_dict() if self.partial is not None else None},
            keep_last=self.cfg.checkpoint.keep_last,
        )

    # --------------------------------------------------------------- stages
    def prompt_ids(self, i: int) -> List[int]:
        """Rendered (chat-templated) prompt token ids of training example ``i`` (cached)."""
        if i not in self._prompt_cache:
            self._prompt_cache[i] = self.task.render_prompt(self.train_examples[i], self.tokenizer)
        return self._prompt_cache[i]

    def prompt_entropy(self, indices: List[int]) -> List[float]:
        """HIVE's prompt entropy of training examples ``indices`` under the current policy.

        The mean next-token entropy (nats, temperature 1) over each rendered
        prompt's tokens, one no-grad prefill per prompt, ``trainer.micro_batch_size``
        prompts per pass and ``trainer.logprob_chunk_size`` positions per LM-head
        chunk (:func:`rlpost.models.logprobs.prompt_entropy`; HIVE, "History-Informed
        and online-VErified prompt selection", arXiv:2603.25184). Passed to the
        selector by :meth:`rlpost.selectors.base.Selector.attach`; only ``hive``
        calls it, from :meth:`select`, before the step's rollouts.

        Weights: the trainer's current policy (under the trainer's autocast). With
        ``executor=async`` and ``max_staleness > 0`` the learner updates that policy
        while the producer selects, so the engine's private copy (the weights this
        step's rollouts are generated with) is used instead.

        Returns:
            one entropy per index, in nats.
        Raises:
            ConfigError: async with staleness and an engine without a torch model (vLLM).
        """
        from rlpost.errors import ConfigError
        from rlpost.models.logprobs import prompt_entropy

        ex = self.cfg.executor
        autocast = None
        if ex.name == "async" and int(ex.get("max_staleness", 0)) > 0:
            model = getattr(self.engine, "model", None)
            if not isinstance(model, torch.nn.Module):
                raise ConfigError("selector=hive with executor=async max_staleness>0 computes prompt entropy on the "
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
        scored :class:`rlpost.samplers.driver.StepRollouts`, scored by one
        :class:`rlpost.rewards.StepScorer`; the selector learns from exactly the
        rewards the batch trains on.

        Args:
            step: the RL step these rollouts are for (seeds derive from it).
            version: trainer version (optimizer steps) of the engine's weights.
            weights_step: RL steps completed by those weights (staleness unit).
        """
        from rlpost.rewards import StepScorer
        from rlpost.samplers.driver import collect_rollouts
        from rlpost.selectors.mixture import make_hint_fn

        t_step = time.perf_counter()
        scorer = StepScorer(self.reward_fn, self.train_examples)
        if self.partial is not None:
            out = self._partial_rollouts(step, version, weights_step, scorer)
        else:
            out = collect_rollouts(
                self.selector, self.sampler, self.engine, self.sampling_params(step), step=step, encode=self.prompt_ids,
                score=scorer, hint=make_hint_fn(self.train_examples, self.tokenizer, self.task.reference_solution),
                seed=step_seed(self.cfg.seed, step, "sampler"),
            )
        out.finish(scorer.metrics()).update_selector(self.selector)
        examples = [self.train_examples[int(i)] for i in out.row_prompt_index]
        batch = out.to_batch([e.answer for e in examples], version, weights_step)
        t_rollout = time.perf_counter() - t_step - scorer.seconds
        return Collected(step, batch, examples, out.group_rewards(), out.reward_metrics, out, t_step, t_rollout,
                         scorer.seconds, weights_step)

    def _partial_rollouts(self, step: int, version: int, weights_step: int, score: Any) -> Any:
        """The step's rollouts through the partial-rollout producer (APRIL arXiv:2509.18521; CoPRIS).

        Returns the same :class:`rlpost.samplers.driver.StepRollouts` as
        :func:`rlpost.samplers.driver.collect_rollouts` (rows grouped by prompt,
        compact group ids, every row scored once by ``score`` with its generated
        token count, the same ``rollout/...`` metrics) plus ``partial/...``
        metrics and, in ``result.extras``, the per-token ``token_version`` /
        ``token_policy_step`` ``[B, R]`` (-1 on padding) and the per-row
        ``policy_step`` of the oldest token ``[B]``. The stitched per-token
        behaviour log-probs become ``rollout_logprobs``.
        """
        from rlpost.rollout.base import GenerationResult
        from rlpost.samplers.base import SampleResult, SamplerContext, score_rows
        from rlpost.samplers.driver import StepRollouts, rollout_metrics, row_oldest

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
        texts = [self.tokenizer.decode(sb.response_ids[b][sb.response_mask[b] > 0].tolist(), skip_special_tokens=True)
                 for b in range(len(gi))]
        temps = sb.temperatures if sb.temperatures is not None else float(self.cfg.rollout.temperature) * sb.response_mask
        gen = GenerationResult(sb.prompt_ids, sb.prompt_mask, sb.response_ids, sb.response_mask, sb.rollout_logprobs,
                               temps, sb.finished, texts)
        extras = {"token_version": sb.token_version, "token_policy_step": ps.token_step,
                  "policy_step": row_oldest(ps.token_step, sb.response_mask)}
        res = SampleResult(gen, gi, ps.new_groups * self.partial.group_size, extras, {})
        # rows are positions in prompt_indices (one group per prompt position)
        score_rows(SamplerContext(score=lambda rows, t, n: score([prompt_indices[r] for r in rows], t, n)), res)
        rewards = res.rewards
        observed = [(prompt_indices[g], rewards[gi == g].tolist()) for g in range(len(gmap))]
        out = StepRollouts(res, prompt_indices, rewards, observed)
        out.metrics = {**rollout_metrics(out, res.rollouts_spent, ps.rounds, skipped[0]), **ps.metrics}
        try:
            out.metrics.update(self.selector.metrics())
        except Exception:  # pragma: no cover - metrics must never break a step
            pass
        return out

    def learn(self, c: "Collected", sync_engine: bool = True) -> Dict[str, Any]:
        """Learner half of a step: log-probs -> advantages -> update (-> sync the engine); returns metrics."""
        cfg, a = self.cfg, self.cfg.algo
        step, batch, examples, per_prompt, rm = c.step, c.batch, c.examples, c.per_prompt, c.reward_metrics
        step_out, sres, gen = c.step_out, c.step_out.result, c.step_out.result.generation
        gi, rewards, lengths = batch.group_index, batch.rewards, batch.response_mask.sum(-1)
        t_rollout, t_reward, t_step = c.t_rollout, c.t_reward, c.t_start
        m: Dict[str, Any] = {"step": step}

        # algorithm-specific inputs (entropy, greedy baseline, Beta baseline, SFT references)
        from rlpost.algos.stages import prepare_algo_inputs

        def greedy_rewards() -> torch.Tensor:
            uniq = sorted({int(i) for i in batch.prompt_index})
            sp = self.sampling_params(step)
            sp.greedy, sp.temperature_hook = True, None
            g = self.engine.generate([self.prompt_ids(i) for i in uniq], sp)
            ex = [self.train_examples[i] for i in uniq]
            r_g = self.reward_fn(g.texts, ex, g.response_mask.sum(-1))[0]
            pos = {p: k for k, p in enumerate(uniq)}
            return torch.stack([r_g[pos[int(i)]] for i in batch.prompt_index]).float()

        m.update(prepare_algo_inputs(
            self.algo_state, batch, self.trainer, greedy_rewards=greedy_rewards, tokenizer=self.tokenizer,
            answer_format=cfg.task.answer_format, max_len=cfg.rollout.max_new_tokens,
        ))

        # log-probs, values
        t0 = time.perf_counter()
        if needs_old_logprobs(a):
            batch.extras["old_logprobs"], _ = self.trainer.compute_logprobs(batch)
        if a.kl.coef > 0:
            batch.extras["ref_logprobs"], _ = self.trainer.compute_logprobs(batch, "ref")
        if a.critic.enabled:
            batch.extras["values"] = self.trainer.compute_values(batch)

        # advantages
        token_rewards = None
        if a.kl.coef > 0 and a.kl.in_reward:
            kl = kl_penalty(a.kl.estimator, batch.extras["old_logprobs"], batch.extras["ref_logprobs"])
            token_rewards = -a.kl.coef * kl * batch.response_mask
            m["actor/kl_ref"] = float((kl * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))
        out = compute_advantages(
            a.adv_estimator,
            AdvantageInput(rewards=rewards, response_mask=batch.response_mask, group_index=gi,
                           values=batch.extras.get("values"), token_rewards=token_rewards,
                           baseline_rewards=batch.extras.get("baseline_rewards"), entropy=batch.extras.get("entropy"),
                           old_logprobs=batch.extras.get("old_logprobs"), rollout_logprobs=batch.rollout_logprobs),
            **{"max_len": self.cfg.rollout.max_new_tokens, **dict(a.adv_params or {})},  # overlong shaping's budget
        )
        batch.extras["advantages"] = out.advantages
        if out.loss_mask is not None:  # e.g. MC-GRPO's median pivot leaves the update
            batch.response_mask = batch.response_mask * out.loss_mask
        if out.returns is not None:
            batch.extras["returns"] = out.returns

        # update
        if a.critic.enabled:
            m.update(self.trainer.critic_update(batch))
        if step > a.critic.warmup_steps or not a.critic.enabled:
            m.update(self.trainer.policy_update(batch, self.update_rng))
        else:
            m["actor/frozen_for_critic_warmup"] = 1.0
        t_update = time.perf_counter() - t0

        # sync (the asynchronous executor loads its engine itself)
        if sync_engine:
            self.engine.sync_weights(self.trainer.policy)
        self.step = step

        ntok = gen.num_tokens
        zero_var = sum(1 for g in per_prompt if len(g) > 1 and max(g) == min(g))
        m.update({
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            **rm,
            "response/length_mean": float(lengths.float().mean()),
            "response/truncated_frac": float((~gen.finished).float().mean()),
            "rollout/rollouts_spent": float(sres.rollouts_spent),
            "rollout/zero_var_group_frac": zero_var / max(1, len(per_prompt)),
            "rollout/policy_version": float(batch.policy_version.float().mean()),
            "adv/mean": float((out.advantages * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)),
            "time/rollout_s": t_rollout,
            "time/reward_s": t_reward,
            "time/update_s": t_update,
            "throughput/rollout_tokens_per_s": ntok / max(t_rollout, 1e-9),
            **step_out.metrics,
        })
        if "token_policy_step" in batch.extras:  # partial rollouts: per-token staleness in RL steps (CoPRIS)
            tm = batch.response_mask > 0
            st = ((step - 1) - batch.extras["token_policy_step"])[tm].float()
            m["partial/token_staleness_mean"] = float(st.mean()) if st.numel() else 0.0
            m["partial/token_staleness_max"] = float(st.max()) if st.numel() else 0.0
        m["bench/update_tokens"] = float(batch.prompt_mask.sum() + batch.response_mask.sum())
        m["time/step_s"] = time.perf_counter() - t_step
        m["memory/peak_rss_mb"] = peak_rss_mb()
        return m

    def evaluate(self):
        """Greedy evaluation on the task's held-out split and on every ``eval.tasks`` entry.

        Returns:
            ``(metrics, result)``: flat ``eval/...`` scalars (``eval/accuracy`` is the
            training task's) and the training task's full result dict.
        """
        from rlpost.eval.evaluate import build_eval_tasks, evaluate, evaluate_tasks, scalar_metrics

        name = self.cfg.task.name
        if self.cfg.sampler.name == "episode":  # multi-turn: evaluate episodes with the training environment
            from rlpost.eval.episodes import evaluate_episodes

            res = evaluate_episodes(self.sampler, self.engine, self.tokenizer, self.task, self.reward_fn,
                                    self.cfg.eval, seed=self.cfg.seed)
            out = {"eval/accuracy": res["accuracy"],
                   **{f"eval/{name}/{k}": res[k] for k in ("tool_call_frac", "turns_mean", "truncated_frac")}}
        else:
            res = evaluate(self.engine, self.tokenizer, self.task, self.cfg.eval, seed=self.cfg.seed)
            out = {"eval/accuracy": res["accuracy"], **scalar_metrics(res, f"eval/{name}")}
        if self.cfg.eval.get("tasks"):
            if self._eval_tasks is None:
                self._eval_tasks = build_eval_tasks(list(self.cfg.eval.tasks))
            out.update(evaluate_tasks(self.engine, self.tokenizer, self._eval_tasks, self.cfg.eval, seed=self.cfg.seed)["metrics"])
        return out, res

    def close(self) -> None:
        """Stop worker processes and engines."""
        self.reward_fn.close()
        self.engine.close()


def train(cfg: DictConfig, run_dir: Path) -> Dict[str, Any]:
    """Train per ``cfg`` in ``run_dir``; returns the last step's metrics.

    Resumes from ``cfg.resume`` (see :func:`rlpost.checkpoint.find_resume_checkpoint`);
    when that checkpoint belongs to another run directory, the run continues
    there. Writes ``config.yaml``, ``metrics.jsonl``, checkpoints, ``final/``
    (the trained policy in Hugging Face format) and ``eval.json``.
    """
    from rlpost.executor import build_executor
    from rlpost.tracking import RunLogger

    main = is_main_process()  # under trainer.num_procs > 1 only rank 0 logs, evaluates and writes files
    run_dir = Path(run_dir)
    ckpt = find_resume_checkpoint(cfg.resume, run_dir)
    if ckpt is not None:
        run_dir = ckpt.parent.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run = Run(cfg, run_dir)
    if ckpt is not None:
        run.restore(ckpt)
    logger = RunLogger(
        run_dir, cfg.logger.backend, OmegaConf.to_container(cfg, resolve=True), name=f"{cfg.name}",
        project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode, tags=list(cfg.logger.tags),
        resume_step=run.step if ckpt is not None else None,
    ) if main else _NullLogger()
    executor = build_executor(cfg, run)
    last: Dict[str, Any] = {}
    progress = _progress(cfg.steps, run.step, enabled=main)
    try:
        if cfg.eval.at_start and run.step == 0 and main:
            with executor.paused():
                em, _ = run.evaluate()
            logger.log({"step": 0, **em})
        while run.step < cfg.steps:
            m = executor.step()
            if main and cfg.eval.every > 0 and run.step % cfg.eval.every == 0 and run.step < cfg.steps:
                with executor.paused():
                    em, _ = run.evaluate()
                m.update(em)
            if main and run.step == cfg.steps and cfg.eval.at_end:
                with executor.paused():
                    em, res = run.evaluate()
                m.update(em)
                (run_dir / "eval.json").write_text(json.dumps(_eval_summary(res), indent=1))
            logger.log(m)
            if (cfg.checkpoint.every > 0 and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps:
                with executor.paused():
                    run.checkpoint()
            last = m
            progress.update(m)
        if main:
            final = run_dir / "final"
            run.trainer.policy.save_pretrained(final)
            run.tokenizer.save_pretrained(final)
            (run_dir / DONE_MARKER).write_text(f"{run.step}\n")
    finally:
        executor.close()
        progress.close()
        logger.close()
        run.close()
    return last


def _eval_summary(res: Dict[str, Any]) -> Dict[str, Any]:
    return res


class _NullLogger:
    """Logger of ranks > 0: they compute the same metrics as rank 0, which logs them."""

    def log(self, m: Dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class _progress:
    """Console progress bar (rich) with live reward and throughput."""

    def __init__(self, total: int, start: int, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="rlpost train", unit="step", dynamic_ncols=True,
                        disable=not enabled)

    def update(self, m: Dict[str, Any]) -> None:
        post = {"reward": f"{m.get('reward/mean', 0):.3f}", "tok/s": f"{m.get('throughput/rollout_tokens_per_s', 0):.0f}",
                "s/step": f"{m.get('time/step_s', 0):.1f}"}
        if "eval/accuracy" in m:
            post["eval_acc"] = f"{m['eval/accuracy']:.3f}"
        self.bar.set_postfix(post)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
