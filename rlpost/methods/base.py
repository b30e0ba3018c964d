"""Method hooks: how a paper method that is more than a pure tensor function plugs into a run.

Most methods are a registered estimator or loss (:mod:`rlpost.algos`): the run
loop calls them with tensors and knows nothing else of them. A method that
needs more (an input gathered before the update, its own forward pass, state
kept across steps, a guard around the optimizer step) subclasses
:class:`Method` in a file of its own under :mod:`rlpost.methods`, registers it
in :data:`METHODS`, and overrides only the hooks it uses. Every hook's default
does nothing, so the run loop and trainers call all of them unconditionally
and never name a method.

Hooks, in the order a step reaches them:

=====================  ==============================================================
``applies(cfg)``        class method: whether this run config uses the method
``validate()``          config checks before any weights load (raise ConfigError)
``needs()``             :class:`Needs`: passes the run must make for it
``describe()``          a phrase for ``rlpost config --graph``'s ``algo_inputs`` line
``setup(run)``          once, after the trainer and engines exist (:class:`RunServices`)
``prepare(batch, run)`` the ``algo_inputs`` stage: fill ``batch.extras``; returns metrics
``after_old_logprobs``  the ``old_logprobs`` stage, after the trainer's pass
``after_advantages``    the ``advantages`` stage, after the estimator: may replace ``extras['advantages']``
``forward(fwd, mb, ...)`` the update's forward pass for a micro-batch (None: not this one)
``logprob_context``     a context around every trainer log-prob pass (old, ref, update) of a batch
``loss_extras(fwd, mb)`` extra loss inputs of a micro-batch (``PolicyLossInput.extras``)
``proximal(...)``       the update's proximal log-probs when no pass recorded them
``lr_scale(...)``       a multiplier of an optimizer step's learning rate
``critic_batch(...)``   the batch the critic regresses on (its mask)
``wrap_update(...)``    replaces the call of the policy update (e.g. accept or roll back)
``state_dict()``        cross-step state, saved with every checkpoint
=====================  ==============================================================

The trainer hands forward hooks a :class:`ForwardPass` (its device, autocast,
temperature, truncation, log-prob pass), never itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from rlpost.algos.losses import EXTRA_INPUTS, loss_extras
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.core.errors import ConfigError
from rlpost.core.registry import Registry

#: every hook-using method, by name; an entry is a :class:`Method` subclass
METHODS = Registry("method", "algo", catalog="rlpost.methods.catalog")


@dataclass
class Needs:
    """Passes and components a method needs from the run (OR-ed over the run's methods).

    Attributes:
        old_logprobs: the update reads the pre-update policy's log-probs (one
            no-grad pass in the ``old_logprobs`` stage).
        skip_old_logprobs: the method supplies the proximal log-probs itself
            (:meth:`Method.proximal`), so several optimizer steps per batch need no pass.
        reference_policy: a frozen reference copy of the initial policy must exist.
        entropy_for_update: the update computes per-token entropy every step.
        untruncated: the trained tokens were not sampled (reference answers), so the
            trainer's log-probs ignore the sampler's top-k / top-p.
        frozen_rollouts: the rollouts sample the frozen reference copy, never the trained policy: the
            run's rollout engine is built over the reference and receives no weights (evaluation
            keeps an engine over the trained policy); DRIFT's decoupled rollouts.
        provides: keys the method writes into ``batch.extras`` or the loss's extras
            (checked against what the loss declares it reads).
    """

    old_logprobs: bool = False
    skip_old_logprobs: bool = False
    reference_policy: bool = False
    entropy_for_update: bool = False
    untruncated: bool = False
    provides: Tuple[str, ...] = ()
    frozen_rollouts: bool = False


@dataclass
class RunServices:
    """What the run lends methods' ``setup`` / ``prepare`` / ``after_old_logprobs`` hooks.

    Attributes:
        cfg: the resolved run config (read-only).
        logprobs: ``(batch, which="policy"|"ref", with_entropy=False) -> ([B, R] log-probs,
            [B, R] entropy or None)``: the trainer's no-grad pass.
        forward_pass: ``() -> ForwardPass`` of the trainer's current policy (no-grad passes).
        policy: the trainer's full-weight policy module.
        reference_policy: the frozen reference copy, or None.
        snapshot: ``() -> state``: the trainer's weights, optimizer and schedule;
            ``restore(state)`` puts them back exactly.
        engine: the rollout engine (``generate(prompts, SamplingParams)``, ``sync_weights``).
        local_engine: the engine of this process (not split across ranks or workers).
        tokenizer: the policy's tokenizer.
        task: the training task.
        examples: the training examples (indexed by ``batch.prompt_index``).
        prompt_ids: ``i -> rendered prompt token ids`` of training example ``i``.
        sampling_params: ``step -> SamplingParams`` of the step's rollouts.
        reward: ``(texts, examples, lengths) -> [N]`` rewards of the task's reward function.
        policy_update: ``(batch, rng) -> metrics``: the trainer's update.
        build_engine: ``policy module -> a rollout engine`` over it (e.g. of the reference policy).
        rows_pass: ``(batch, fn) -> [B, R]``: ``fn`` over the batch, split across ranks when
            rollouts are sharded.
        step: the RL step being learned (set before each stage).
    """

    cfg: Any
    logprobs: Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
    forward_pass: Callable[[], "ForwardPass"]
    policy: torch.nn.Module
    reference_policy: Optional[torch.nn.Module]
    snapshot: Callable[[], Any]
    restore: Callable[[Any], None]
    policy_update: Callable[..., Dict[str, Any]]
    engine: Any
    local_engine: Any
    tokenizer: Any
    task: Any
    examples: List[Any]
    prompt_ids: Callable[[int], List[int]]
    sampling_params: Callable[[int], Any]
    reward: Callable[..., torch.Tensor]
    build_engine: Callable[[torch.nn.Module], Any]
    rows_pass: Callable[..., torch.Tensor]
    step: int = 0


@dataclass
class ForwardPass:
    """The trainer's forward machinery as a method's forward hook sees it.

    Attributes:
        model: the module the loss differentiates.
        policy: the full-weight policy (no-grad passes).
        device: where the passes run.
        autocast: ``() -> context manager`` of the trainer's mixed precision.
        temperature: ``micro-batch -> float or [b, R]`` sampling temperature of its tokens.
        truncation: ``{"top_k": int, "top_p": float}`` of the rollouts' sampler.
        chunk_size: response positions per LM-head chunk.
        logprobs: ``(model, mb, with_entropy, entropy_grad) -> (logprobs [b, R], entropy or None)``.
        betas: the optimizer's Adam betas.
        lr: ``() -> float``, the learning rate of the coming optimizer step.
        loss_state: cross-step state of losses (saved with the trainer).
        seed: seed of this mini-batch's random draws (the same for each micro-batch and process).
        multi_process: several processes compute this update together.
    """

    model: torch.nn.Module
    policy: torch.nn.Module
    device: torch.device
    autocast: Callable[[], Any]
    temperature: Callable[[Any], Any]
    truncation: Dict[str, Any]
    chunk_size: int
    logprobs: Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
    betas: Tuple[float, float] = (0.9, 0.999)
    lr: Callable[[], float] = lambda: 0.0
    loss_state: Dict[str, Any] = field(default_factory=dict)
    seed: Optional[int] = None
    multi_process: bool = False


#: the result of a forward hook: log-probs ``[b, R]`` (with grad), entropy or None, extra loss inputs
ForwardOut = Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]


class Method:
    """Base class of a hook-using method; every hook does nothing.

    Args:
        cfg: the resolved run config.
    Class attributes:
        name: registry name (a subclass registers with :data:`METHODS`).
        paper: title and arXiv id of its paper.
        order: the position of its ``prepare`` among the run's methods (lower first).
    """

    name = ""
    paper = ""
    order = 50  # prepare hooks run by (order, name): one that replaces the responses goes first

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        """Whether the run config ``cfg`` uses this method."""
        raise NotImplementedError

    def validate(self) -> None:
        """Config checks, before any weights load. Raises ConfigError naming the fix."""

    def needs(self) -> Needs:
        """The passes and components this method needs (:class:`Needs`)."""
        return Needs()

    def describe(self) -> Optional[str]:
        """What the ``algo_inputs`` stage does for it (None: nothing)."""
        return None

    def attach_trainer(self, policy: torch.nn.Module) -> None:
        """Called once with the trainer's policy, before any copy of it is made (engines, references)."""

    def setup(self, run: RunServices) -> None:
        """Build what needs the trainer and the engines (called once)."""

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """The ``algo_inputs`` stage: write inputs into ``batch.extras``; returns metrics."""
        return {}

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """Run after the pre-update log-prob pass; returns metrics."""
        return {}

    def after_advantages(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """Run after the advantage estimator wrote ``batch.extras['advantages']`` ``[B, R]`` (and its
        ``returns`` and other extras), before the critic and policy updates; may replace the advantages
        (e.g. T^5's learned mixing of several critics' estimates). Returns metrics."""
        return {}

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        """The update's forward for micro-batch ``mb`` (None: the trainer's own)."""
        return None

    def logprob_context(self, model: torch.nn.Module, batch: Any) -> Any:
        """A context manager entered around each of the trainer's log-prob passes of ``batch`` through ``model``
        (the pre-update, reference and update passes, and those of forward hooks): e.g. inputs the rollout fed
        the model that are not the token ids (N-GRPO's mixed embeddings). None: nothing to enter."""
        return None

    def loss_extras(self, fwd: ForwardPass, mb: Any) -> Dict[str, torch.Tensor]:
        """Extra loss inputs of micro-batch ``mb`` (merged into ``PolicyLossInput.extras``)."""
        return {}

    def proximal(self, mb: Any, logprobs: torch.Tensor, version_start: int, version: int) -> Optional[torch.Tensor]:
        """The proximal log-probs ``[b, R]`` when no pass recorded them (None: the detached current ones)."""
        return None

    def observe_weights(self, mb: Any, old_logprobs: torch.Tensor) -> None:
        """Called for each micro-batch of a mini-batch with its proximal log-probs (for :meth:`lr_scale`)."""

    def lr_scale(self) -> Tuple[float, Dict[str, float]]:
        """The learning-rate multiplier of the coming optimizer step and its metrics (called once per step)."""
        return 1.0, {}

    def critic_batch(self, batch: Any, seed: int) -> Any:
        """The batch the critic update regresses on (default: ``batch``)."""
        return batch

    def wrap_update(self, update: Callable[[], Dict[str, Any]], run: RunServices, batch: Any) -> Optional[Dict[str, Any]]:
        """Run the policy update ``update()`` its own way (None: not wrapped)."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """Cross-step state (saved with a checkpoint)."""
        return {}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class MethodSet:
    """The methods one run uses, with each hook called over all of them.

    Args:
        methods: instances, in registry order.
    """

    def __init__(self, methods: Iterable[Method] = ()) -> None:
        self.methods: List[Method] = list(methods)

    @classmethod
    def for_config(cls, cfg: Any) -> "MethodSet":
        """The registered methods that ``cfg`` uses (each :meth:`Method.applies`), validated."""
        found = [entry.obj for entry in METHODS if entry.obj.applies(cfg)]
        out = cls(k(cfg) for k in sorted(found, key=lambda k: (k.order, k.name)))
        for m in out.methods:
            m.validate()
        return out

    @property
    def names(self) -> List[str]:
        return [m.name for m in self.methods]

    def get(self, name: str) -> Method:
        """The run's method ``name``.

        Raises:
            KeyError: the run does not use it (the message lists those it uses).
        """
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"this run uses no method {name!r}; it uses: {', '.join(self.names) or 'none'}")

    def needs(self) -> Needs:
        """The OR of every method's :class:`Needs` (``provides`` concatenated)."""
        out = Needs()
        for m in self.methods:
            n = m.needs()
            out = Needs(out.old_logprobs or n.old_logprobs, out.skip_old_logprobs or n.skip_old_logprobs,
                        out.reference_policy or n.reference_policy, out.entropy_for_update or n.entropy_for_update,
                        out.untruncated or n.untruncated, out.provides + tuple(n.provides),
                        out.frozen_rollouts or n.frozen_rollouts)
        return out

    def describe(self) -> List[str]:
        return [d for d in (m.describe() for m in self.methods) if d]

    def attach_trainer(self, policy: torch.nn.Module) -> None:
        for m in self.methods:
            m.attach_trainer(policy)

    def setup(self, run: RunServices) -> None:
        for m in self.methods:
            m.setup(run)

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for m in self.methods:
            out.update(m.prepare(batch, run))
        return out

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for m in self.methods:
            out.update(m.after_old_logprobs(batch, run))
        return out

    def after_advantages(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for m in self.methods:
            out.update(m.after_advantages(batch, run))
        return out

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        """The first method's forward that takes ``mb`` (None: none does)."""
        for m in self.methods:
            out = m.forward(fwd, mb, with_entropy, entropy_grad)
            if out is not None:
                return out
        return None

    def logprob_context(self, model: torch.nn.Module, batch: Any) -> contextlib.ExitStack:
        """Every method's :meth:`Method.logprob_context` for ``batch``, entered together."""
        stack = contextlib.ExitStack()
        for m in self.methods:
            ctx = m.logprob_context(model, batch)
            if ctx is not None:
                stack.enter_context(ctx)
        return stack

    def loss_extras(self, fwd: ForwardPass, mb: Any) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        for m in self.methods:
            out.update(m.loss_extras(fwd, mb))
        return out

    def proximal(self, mb: Any, logprobs: torch.Tensor, version_start: int, version: int) -> Optional[torch.Tensor]:
        for m in self.methods:
            out = m.proximal(mb, logprobs, version_start, version)
            if out is not None:
                return out
        return None

    def observe_weights(self, mb: Any, old_logprobs: torch.Tensor) -> None:
        for m in self.methods:
            m.observe_weights(mb, old_logprobs)

    def lr_scale(self) -> Tuple[float, Dict[str, float]]:
        scale, metrics = 1.0, {}
        for m in self.methods:
            s, mm = m.lr_scale()
            scale *= s
            metrics.update(mm)
        return scale, metrics

    def critic_batch(self, batch: Any, seed: int) -> Any:
        for m in self.methods:
            batch = m.critic_batch(batch, seed)
        return batch

    def wrap_update(self, update: Callable[[], Dict[str, Any]], run: RunServices, batch: Any) -> Dict[str, Any]:
        """The first method's wrapped update, else ``update()``."""
        for m in self.methods:
            out = m.wrap_update(update, run, batch)
            if out is not None:
                return out
        return update()

    def state_dict(self) -> Dict[str, Any]:
        return {m.name: m.state_dict() for m in self.methods if m.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Each method's entry; a checkpoint from before the hooks kept one flat dict, which each method reads."""
        for m in self.methods:
            m.load_state_dict(sd.get(m.name, sd))


def check_loss_extras(cfg: Any, methods: MethodSet) -> None:
    """Every extra input ``algo.loss`` declares (``extras=``) has a provider in this run.

    Providers: the trainer (``loss_state``; ``token_weights`` for a loss tagged ``token_draw``), the
    ``ref_logprobs`` stage (a loss tagged ``needs_ref`` or ``algo.kl.coef > 0``), the ``teacher_logprobs`` stage
    (``model.teacher`` or ``model.teachers``), the advantage estimator (tag ``provides``: the keys of
    its ``AdvantageOutput.extras``), and each method's ``Needs.provides``. Keys the loss
    declares in ``optional_extras`` may be absent.

    Raises:
        ConfigError: a declared key nobody provides, naming the key and the loss.
    """

    loss = str(cfg.algo.loss)
    provided = set(methods.needs().provides) | {"loss_state"}
    if POLICY_LOSSES.tag(loss, "token_draw", None) is not None:
        provided.add("token_weights")  # the trainer's draw before the update's forward
    if float(cfg.algo.kl.coef) > 0 or POLICY_LOSSES.tag(loss, "needs_ref", False):
        provided.add("ref_logprobs")
    if cfg.model.get("teacher", None) or cfg.model.get("teachers", None):
        provided.add("teacher_logprobs")
    provided |= set(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "provides", ()) or ())  # AdvantageOutput.extras
    optional = set(POLICY_LOSSES.tag(loss, "optional_extras", ()) or ())
    for key in loss_extras(loss):
        if key not in provided and key not in optional:
            what = EXTRA_INPUTS.get(key, "a key only a method provides")
            raise ConfigError(f"algo.loss={loss} reads the extra input {key!r} ({what}), but nothing in "
                              f"this run provides it. Fix: use the loss's preset (algo={loss}), which brings what "
                              f"provides it, or set model.teacher for a teacher's log-probs.")


def check_config(cfg: Any) -> None:
    """The hook-using methods the config uses: each one's own checks (:meth:`Method.validate`), and every
    extra input the loss declares has a provider (:func:`check_loss_extras`).

    Raises:
        ConfigError: the first problem found.
    """
    check_loss_extras(cfg, MethodSet.for_config(cfg))
