"""``sampler=s2l``: S2L-PO's small explorer model as a second rollout source, annealed away.

S2L-PO ("Smaller Models are Natural Explorers for Policy-Level Diversity in GRPO",
Ren et al., arXiv:2605.30789) observes that a smaller model of the learner's family
has the higher pass@k at large k, and that its diversity is coherent across a whole
trajectory (one fixed parameter shift, not per-token noise). A frozen small model
therefore produces part of each GRPO group, and a progressive annealing schedule
moves the rollout source from the explorer to the learner's own samples, so the
explorer's limited capacity does not cap the learner later in training.

What this file does, per step ``t`` (1-based) and prompt with group size ``n``:

* the explorer fraction ``f(t)`` follows ``anneal_schedule`` from ``fraction_start`` at
  the first step to ``fraction_end`` once ``anneal_steps`` steps are done (and stays there);
* ``k = floor(f(t) n + 1/2)`` of the prompt's rollouts come from the explorer, the other
  ``n - k`` from the learner's engine; both halves form one group (one GRPO
  baseline), scored by the step's reward function as any rollout;
* an explorer row's ``rollout_logprobs`` are the explorer's own log-probs of its
  tokens, i.e. the behaviour policy's, so the run's importance correction
  (``precision.correction=tis``, the recipe's choice) weights its tokens by
  ``min(pi_old / pi_explorer, C)``; with ``precision.correction=none`` they are
  trained as if sampled by the learner (the ratio ``pi / pi_old`` of a plain GRPO row);
* ``extras['explorer_row']`` (``[B]`` 1.0 / 0.0) marks the explorer's rows; the
  metrics ``sampler/s2l_explorer_fraction`` (the schedule's value at the step) and
  ``sampler/s2l_explorer_rows`` (rows the explorer produced) are logged per step.

Choices the abstract leaves open (ours, declared): the explorer samples online every
step (it is frozen, so its samples are distributed as the paper's offline rollouts;
only the compute differs); the schedule's shape (``anneal_schedule``: ``linear`` default, ``cosine`` and
``step`` offered) and its defaults ``fraction_start=0.5``, ``anneal_steps=100``;
per-prompt rounding of ``f(t) n``. The explorer must share the learner's tokenizer
(same family), checked when it is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.registry import param
from rlpost.samplers.base import SAMPLERS, Sampler, SampleResult, generate_groups, merge_results, pad_id_of, step_params

SCHEDULES = ("linear", "cosine", "step")
SETTING = "sampler.params.explorer_model"


@dataclass(frozen=True)
class S2LSamplerParams:
    """Parameters of :class:`S2LSampler` (S2L-PO, arXiv:2605.30789)."""

    explorer_model: str = param("", "the frozen small model: a conf/model preset or a local HF directory of the "
                                    "learner's family (same tokenizer); required.")
    fraction_start: float = param(0.5, "explorer share of each group at the first step, in [0, 1] (our choice).")
    fraction_end: float = param(0.0, "explorer share from anneal_steps on, in [0, fraction_start].")
    anneal_steps: int = param(100, "steps over which the share goes from fraction_start to fraction_end (our choice).")
    anneal_schedule: str = param("linear", "shape of the annealing: linear, cosine or step (all at start until "
                                    "anneal_steps, then end).")
    explorer_seed: int = param(1, "seed of a tiny random explorer (model preset tiny); other models ignore it.")


def explorer_fraction(step: int, fraction_start: float, fraction_end: float, anneal_steps: int,
                      schedule: str = "linear") -> float:
    """The explorer's share of a group at ``step`` (S2L-PO's progressive annealing; the shape is our reading).

    With ``u = min(step / anneal_steps, 1)``: ``linear`` is ``s + (e - s) u``, ``cosine``
    ``e + (s - e) (1 + cos(pi u)) / 2``, ``step`` is ``s`` before ``anneal_steps`` and ``e``
    from it on. ``anneal_steps = 0`` gives ``e`` at every step.

    Raises:
        ValueError: unknown ``schedule``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; valid: {', '.join(SCHEDULES)}")
    if anneal_steps <= 0:
        return float(fraction_end)
    u = min(max(step, 0) / anneal_steps, 1.0)
    if schedule == "linear":
        return float(fraction_start + (fraction_end - fraction_start) * u)
    if schedule == "cosine":
        return float(fraction_end + (fraction_start - fraction_end) * 0.5 * (1.0 + math.cos(math.pi * u)))
    return float(fraction_start if step < anneal_steps else fraction_end)


def split_counts(counts: List[int], fraction: float) -> List[int]:
    """Explorer rollouts per prompt: ``floor(fraction * c + 0.5)`` of each prompt's ``c`` (half rounds up)."""
    return [min(int(c), int(math.floor(fraction * int(c) + 0.5))) for c in counts]


def load_explorer(spec: str, tokenizer: Any, device: Any, batch_size: int, seed: int) -> Any:
    """The frozen explorer as an hf rollout engine on ``device`` (fp32, eval mode, no gradients).

    Loaded as a frozen teacher is (:func:`rlpost.models.teacher.load_teacher`: preset or directory,
    LoRA off, tokenizer checked against the learner's).

    Raises:
        ConfigError: ``spec`` names no model preset or directory, or its tokenizer differs from the learner's.
        rlpost.core.errors.ModelLoadError: the model cannot be loaded.
    """
    from rlpost.models.teacher import load_teacher
    from rlpost.rollout.hf import HFRolloutEngine

    frozen = load_teacher(spec, tokenizer, torch.float32, device, seed=seed, setting=SETTING)
    return HFRolloutEngine(frozen.module, tokenizer, batch_size, share_weights=True, device=device)


@SAMPLERS.register(
    "s2l",
    paper="S2L-PO: Smaller Models are Natural Explorers for Policy-Level Diversity in GRPO (arXiv:2605.30789)",
    description="Part of each group from a frozen small explorer model, annealed to the learner's own samples.",
    params=S2LSamplerParams,
)
class S2LSampler(Sampler):
    """Mixed groups: ``round(f(t) n)`` rollouts from the explorer, the rest from the learner.

    The explorer is loaded on the first :meth:`sample` (with the learner engine's
    tokenizer); :meth:`set_explorer` gives one directly (tests). It never receives
    weight syncs. Its rows' ``rollout_logprobs`` are its own log-probs.

    Args:
        explorer_model, fraction_start, fraction_end, anneal_steps, anneal_schedule, explorer_seed:
            see :class:`S2LSamplerParams`.

    Raises:
        ValueError: a fraction outside [0, 1], ``fraction_end > fraction_start``, negative
            ``anneal_steps``, an unknown schedule, or no ``explorer_model``.
        ConfigError: ``explorer_model`` names no model preset or directory.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, explorer_model: str, fraction_start: float, fraction_end: float,
                 anneal_steps: int, anneal_schedule: str, explorer_seed: int) -> None:
        super().__init__(n_samples)
        if not str(explorer_model or ""):
            raise ValueError(f"S2L-PO needs its small explorer model. Fix: {SETTING}=<model preset or HF dir of "
                             f"the learner's family>")
        if not (0.0 <= fraction_end <= fraction_start <= 1.0):
            raise ValueError(f"need 0 <= fraction_end <= fraction_start <= 1 (the explorer's share anneals down), "
                             f"got fraction_start={fraction_start}, fraction_end={fraction_end}")
        if anneal_steps < 0:
            raise ValueError(f"anneal_steps must be >= 0, got {anneal_steps}")
        if anneal_schedule not in SCHEDULES:
            raise ValueError(f"anneal_schedule={anneal_schedule!r}; valid: {', '.join(SCHEDULES)}")
        from rlpost.models.teacher import teacher_model_config

        teacher_model_config(str(explorer_model), SETTING)  # a misspelt preset fails at config time
        self.explorer_model = str(explorer_model)
        self.fraction_start, self.fraction_end = float(fraction_start), float(fraction_end)
        self.anneal_steps, self.anneal_schedule, self.explorer_seed = int(anneal_steps), str(anneal_schedule), int(explorer_seed)
        self.explorer: Optional[Any] = None

    def set_explorer(self, engine: Any) -> None:
        """Use ``engine`` (a rollout engine) as the explorer instead of loading ``explorer_model``."""
        self.explorer = engine

    def _explorer(self, engine: Any) -> Any:
        if self.explorer is None:
            dev = getattr(engine, "device", torch.device("cpu"))
            self.explorer = load_explorer(self.explorer_model, engine.tokenizer, dev,
                                          int(getattr(engine, "batch_size", 64)), self.explorer_seed)
        return self.explorer

    def fraction(self, step: int) -> float:
        """The explorer's share at the run's ``step`` (1-based: the first step samples at ``fraction_start``,
        :func:`explorer_fraction` of the ``step - 1`` steps done)."""
        return explorer_fraction(max(int(step) - 1, 0), self.fraction_start, self.fraction_end, self.anneal_steps,
                                 self.anneal_schedule)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        counts = self.counts(len(prompts), ctx)
        f = self.fraction(ctx.step)
        k = split_counts(counts, f)
        rest = [c - e for c, e in zip(counts, k)]
        parts: List[SampleResult] = []
        if sum(rest):
            parts.append(generate_groups(engine, prompts, rest, params))
        if sum(k):
            parts.append(generate_groups(self._explorer(engine), prompts, k, step_params(params, ctx, 1)))
        for part, flag in zip(parts, [0.0] * bool(sum(rest)) + [1.0] * bool(sum(k))):
            part.extras["explorer_row"] = torch.full((part.group_index.shape[0],), flag)
        res = parts[0] if len(parts) == 1 else merge_results(parts, pad_id_of(engine))
        res.metrics["sampler/s2l_explorer_fraction"] = f
        res.metrics["sampler/s2l_explorer_rows"] = float(sum(k))
        return res

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the schedule reads the step; nothing to keep
        return {}



def check_config(cfg: Any) -> None:
    """``sampler=s2l`` names an explorer that resolves (run from the CLI before anything loads).

    Raises:
        ConfigError: ``sampler.params.explorer_model`` is empty or names no model preset or directory.
    """
    if str(cfg.sampler.name) != "s2l":
        return
    from rlpost.core.errors import ConfigError
    from rlpost.core.registry import as_dict

    kw = dataclasses.asdict(SAMPLERS.resolve("s2l", as_dict(cfg.sampler.params), "sampler.params"))
    try:
        S2LSampler(1, **kw)  # its checks only; the explorer loads at the first step
    except ValueError as e:
        raise ConfigError(f"sampler=s2l: {e}") from None
