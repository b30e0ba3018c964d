"""Config-time validation of an algorithm preset and of a mismatch correction.

:func:`validate_algo` checks that the registered parts of ``algo`` exist, that
their parameters are ones the components declare (their ``params`` dataclass,
:mod:`rlpost.core.registry`), and that the combination makes sense (a critic for
critic-based estimators, a group for group baselines, a reward-side KL for
estimators that read token rewards...). It raises
:class:`rlpost.core.errors.ConfigError` with a message naming the key and the fix,
before any model is loaded.

Who owns which key:

* ``algo.loss_params``: the loss's declared parameters, plus the trainer's
  :class:`TrainerLossParams` (read for any loss);
* ``algo.clip.*``: shorthand for the clip-range fields (``eps_low``,
  ``eps_high``, ``dual_clip``) of a loss that declares them; null (the default)
  leaves the loss's paper value. :func:`loss_kwargs` maps it, and refuses it for
  a loss without that field or when ``algo.loss_params`` sets the same key to
  another value;
* ``algo.adv_params``: the estimator's declared parameters, plus
  :class:`RewardShapingParams` (read by :func:`rlpost.algos.advantages.compute_advantages`);
* ``precision.correction_params``: the correction's declared parameters.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from omegaconf import OmegaConf

from rlpost.algos.advantages import BASELINES
from rlpost.algos.corrections import CORRECTIONS
from rlpost.algos.registries import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from rlpost.core.errors import ConfigError
from rlpost.core.registry import Choice, param, resolve_params
from rlpost.models.teacher import teacher_model_config


class Proximal(Choice):
    """How the update's proximal (trust-region anchor) log-probs are obtained."""

    recompute = "recompute"
    a3po = "a3po"


@dataclass(frozen=True)
class TrainerLossParams:
    """``algo.offpolicy``: how the update treats off-policy data, for any loss (read through the methods
    :mod:`rlpost.methods.a3po` and :mod:`rlpost.methods.vcpo`)."""

    proximal: Proximal = param(Proximal.recompute, "recompute: a forward pass; a3po: A-3PO's interpolation (arXiv:2512.06547), no pass")
    vcpo_lr: bool = param(False, "scale each optimizer step's lr by the ESS fraction of the IS weights (VCPO, arXiv:2602.17616)")
    vcpo_power: float = param(1.0, "lr scale = ess_frac ** vcpo_power, > 0 (our choice: linear)")
    vcpo_min_scale: float = param(0.1, "smallest lr multiplier, in (0, 1] (our choice)")


@dataclass(frozen=True)
class RewardShapingParams:
    """The old spelling of reward shaping in ``algo.adv_params`` (DAPO's overlong punishment,
    arXiv:2503.14476): ``task.reward.overlong_buffer`` / ``overlong_penalty`` own these now
    (:func:`old_shaping_spelling`)."""

    overlong_buffer: float = param(0, "soft-punishment window: tokens, or a fraction of max_len if in (0, 1); 0 = off")
    overlong_penalty: float = param(1.0, "penalty at the hard length limit (DAPO: 1)")
    max_len: Optional[int] = param(None, "length budget of the penalty (null: the padded response length)")


SHAPING_KEYS = tuple(f.name for f in dataclasses.fields(RewardShapingParams))
CLIP_KEYS = ("eps_low", "eps_high", "dual_clip")
TRAINER_LOSS_KEYS = tuple(f.name for f in dataclasses.fields(TrainerLossParams))
PROXIMAL_CHOICES = tuple(p.value for p in Proximal)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    try:
        return getattr(cfg, key, default)
    except Exception:  # omegaconf raises on missing keys in struct mode
        return default


def _as_dict(x: Any) -> dict:
    if x is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(x, DictConfig):
            return dict(OmegaConf.to_container(x, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover
        pass
    return dict(x)


def _split(d: Mapping[str, Any], keys: Tuple[str, ...]) -> Tuple[dict, dict]:
    """``(entries whose key is not in keys, entries whose key is)``."""
    return {k: v for k, v in d.items() if k not in keys}, {k: v for k, v in d.items() if k in keys}


def loss_overrides(algo_cfg: Any) -> Dict[str, Any]:
    """The loss's own overrides: ``algo.loss_params`` minus the trainer keys, plus ``algo.clip.*`` where set.

    Raises:
        ConfigError: ``algo.clip.<k>`` set for a loss that does not declare
            ``k``, or set to a value other than ``algo.loss_params.<k>``.
    """
    loss = _get(algo_cfg, "loss", "ppo_clip")
    own, _ = _split(_as_dict(_get(algo_cfg, "loss_params")), TRAINER_LOSS_KEYS)
    clip = {k: v for k, v in _as_dict(_get(algo_cfg, "clip")).items() if v is not None}
    declared = [f.name for f in dataclasses.fields(POLICY_LOSSES.params_of(loss))]
    for k, v in clip.items():
        if k not in declared:
            raise ConfigError(
                f"algo.clip.{k}={v} is set, but algo.loss={loss} has no {k}: a clip range applies only to losses that "
                f"declare one. Its parameters: {', '.join(declared) or 'none'}. Fix: drop algo.clip.{k} "
                f"(~algo.clip.{k} or algo.clip.{k}=null), or pick a clipped loss (ppo_clip, gspo, cispo, ...)."
            )
        if k in own and own[k] != v:
            raise ConfigError(
                f"algo.clip.{k}={v} and algo.loss_params.{k}={own[k]} set the same parameter of algo.loss={loss} "
                f"to different values; set it in one place (algo.loss_params.{k})."
            )
        own[k] = v
    return own


def loss_kwargs(algo_cfg: Any) -> Dict[str, Any]:
    """Keyword arguments of ``algo.loss``: its declared defaults with :func:`loss_overrides` applied.

    Raises:
        ConfigError: see :func:`loss_overrides`, or a key the loss does not declare.
    """
    loss = _get(algo_cfg, "loss", "ppo_clip")
    return POLICY_LOSSES.kwargs(loss, loss_overrides(algo_cfg), "algo.loss_params")


#: old spellings already reported (each is said once per process)
_WARNED: set = set()


def trainer_loss_params(algo_cfg: Any) -> TrainerLossParams:
    """``algo.offpolicy`` (:class:`TrainerLossParams`), defaults filled in.

    The old spelling ``algo.loss_params.<key>`` still works for these keys and
    warns once; setting a key in both places to different values is an error.

    Raises:
        ConfigError: wrong type, choice or unknown key; a key set twice to different values.
    """
    _, old = _split(_as_dict(_get(algo_cfg, "loss_params")), TRAINER_LOSS_KEYS)
    new = _as_dict(_get(algo_cfg, "offpolicy"))
    for k, v in old.items():
        if k in new and new[k] != v:
            raise ConfigError(f"algo.loss_params.{k}={v} and algo.offpolicy.{k}={new[k]} set the same key to "
                              f"different values; set it once, as algo.offpolicy.{k}.")
        if k not in _WARNED:
            _WARNED.add(k)
            logging.getLogger("rlpost").warning(
                f"algo.loss_params.{k} is the old spelling of algo.offpolicy.{k} (a trainer setting, not a loss "
                f"parameter); it still works. Fix: write algo.offpolicy.{k}={v}.")
    return resolve_params(TrainerLossParams, {**old, **new}, "algo.offpolicy", "off-policy update")


def old_shaping_spelling(algo_cfg: Any) -> Dict[str, Any]:
    """The reward-shaping keys written in ``algo.adv_params`` (the old spelling of
    ``task.reward.overlong_buffer`` / ``overlong_penalty``), each reported once per process.

    They still work: :meth:`rlpost.rewards.RewardFunction.from_config` applies them (and refuses a
    window set in both places). Empty when ``adv_params`` holds none.
    """
    old = _split(_as_dict(_get(algo_cfg, "adv_params")), SHAPING_KEYS)[1]
    for k, v in old.items():
        if ("shaping", k) not in _WARNED:
            _WARNED.add(("shaping", k))
            logging.getLogger("rlpost").warning(
                f"algo.adv_params.{k} is the old spelling of task.reward.{k} (reward shaping belongs to the "
                f"reward, not the estimator); it still works. Fix: write task.reward.{k}={v}.")
    return old


def adv_overrides(algo_cfg: Any) -> Dict[str, Any]:
    """The estimator's own overrides: ``algo.adv_params`` minus :data:`SHAPING_KEYS`."""
    return _split(_as_dict(_get(algo_cfg, "adv_params")), SHAPING_KEYS)[0]


def validate_algo(algo_cfg: Any, root_cfg: Any = None) -> None:
    """Check an ``algo`` config (AlgoConfig, DictConfig or dict) for a consistent combination.

    Checks, each with its own message:

    * ``algo.adv_estimator``, ``algo.loss``, ``algo.loss_agg``, ``algo.kl.estimator``
      are registered (unknown names list the valid choices);
    * ``algo.adv_params`` / ``algo.loss_params`` / ``algo.clip`` only hold
      parameters the chosen components declare, with the right types and
      choices (plus :class:`RewardShapingParams` in ``adv_params`` and
      :class:`TrainerLossParams` in ``loss_params``, range-checked);
    * ``algo.adv_params.baseline`` (``mean`` | ``min_variance``) is only set for
      estimators that take it;
    * an estimator tagged ``needs_critic`` has ``algo.critic.enabled=true``;
    * an estimator tagged ``needs_group`` has ``algo.n_samples_per_prompt >= 2``
      (``odd_group``: an odd size >= 3, so the median is a sample);
    * ``algo.kl.in_reward=true`` with ``kl.coef > 0`` needs an estimator that
      reads token rewards (``uses_token_rewards``), else the KL would be dropped;
    * the loss's clip range, where it declares one: ``0 <= eps_low <= 1``,
      ``eps_high >= 0``, ``dual_clip`` null or > 1;
    * ``ppo_epochs``, ``mini_batches``, ``n_samples_per_prompt`` >= 1,
      ``loss_agg_norm`` null or > 0, ``kl.coef >= 0``;
    * a loss tagged ``needs_group`` (``tpo``) has ``algo.n_samples_per_prompt >= 2``;
      one tagged ``sequence_sum`` is not aggregated with ``seq-mean-token-mean``;
    * the ``gpg`` loss has no trust region: it needs ``ppo_epochs == 1`` and
      ``mini_batches == 1``;
    * if ``root_cfg`` is given: ``precision.correction`` and its params
      (:func:`validate_correction`).

    Raises:
        ConfigError: the first problem found.
    """
    adv = _get(algo_cfg, "adv_estimator", "grpo")
    loss = _get(algo_cfg, "loss", "ppo_clip")
    agg = _get(algo_cfg, "loss_agg", "token-mean")
    kl = _get(algo_cfg, "kl")
    n = int(_get(algo_cfg, "n_samples_per_prompt", 1) or 0)

    ADV_ESTIMATORS.get(adv)
    POLICY_LOSSES.get(loss)
    LOSS_AGGS.get(agg)
    kl_est = _get(kl, "estimator", "k3")
    KL_ESTIMATORS.get(kl_est)

    adv_params = _as_dict(_get(algo_cfg, "adv_params"))
    _check_baseline(adv, adv_params.get("baseline"))
    ap = ADV_ESTIMATORS.resolve(adv, adv_overrides(algo_cfg), "algo.adv_params")
    if adv == "max_at_k":  # max@k needs k samples per group, k + 1 for the leave-one-out baseline
        need = int(ap.k) + (1 if str(getattr(ap.baseline, "value", ap.baseline)) == "loo" else 0)
        if int(ap.k) < 1 or n < need:
            raise ConfigError(f"algo.adv_estimator=max_at_k with k={ap.k} (baseline={getattr(ap.baseline, 'value', ap.baseline)}) "
                              f"needs 1 <= k and algo.n_samples_per_prompt >= {need}, got {n}; lower algo.adv_params.k "
                              f"or raise algo.n_samples_per_prompt.")
    resolve_params(RewardShapingParams, _split(adv_params, SHAPING_KEYS)[1], "algo.adv_params", "reward shaping")
    lp = POLICY_LOSSES.resolve(loss, loss_overrides(algo_cfg), "algo.loss_params")
    _check_trainer_loss_keys(trainer_loss_params(algo_cfg))
    _check_clip_range(loss, lp)

    for k in ("ppo_epochs", "mini_batches", "n_samples_per_prompt"):
        v = _get(algo_cfg, k, 1)
        if v is not None and int(v) < 1:
            raise ConfigError(f"algo.{k} must be >= 1, got {v}.")
    norm = _get(algo_cfg, "loss_agg_norm")
    if norm is not None and float(norm) <= 0:
        raise ConfigError(f"algo.loss_agg_norm must be null or > 0, got {norm}.")

    _check_combination(algo_cfg, adv, loss, agg, n)

    if root_cfg is not None:
        prec = _get(root_cfg, "precision")
        if prec is not None:
            validate_correction(_get(prec, "correction", "none"), _as_dict(_get(prec, "correction_params")))


def _check_combination(algo_cfg: Any, adv: str, loss: str, agg: str, n: int) -> None:
    """The combination rules of :func:`validate_algo` that read the components' tags (critic, group,
    token rewards, sequence sums, trust region).

    Raises:
        ConfigError: the first rule broken.
    """
    kl = _get(algo_cfg, "kl")
    critic = _get(algo_cfg, "critic")
    tags = ADV_ESTIMATORS.entry(adv).tags
    if bool(_get(critic, "shared_backbone", False)) and int(_get(critic, "warmup_steps", 0) or 0) > 0:
        raise ConfigError("algo.critic.shared_backbone=true with algo.critic.warmup_steps > 0: the critic's updates move "
                          "the shared backbone, so the policy would not be frozen during warm-up. Fix: warmup_steps=0.")
    if tags.get("needs_critic") and not bool(_get(critic, "enabled", False)):
        raise ConfigError(
            f"algo.adv_estimator={adv} needs a critic (value model) but algo.critic.enabled is false. "
            f"Set algo.critic.enabled=true, or choose a critic-free estimator (grpo, rloo, reinforce_pp, ...)."
        )
    heads = _get(critic, "num_heads", 1)
    heads = 1 if heads is None else int(heads)
    if heads < 1:
        raise ConfigError(f"algo.critic.num_heads={heads} must be >= 1 (1: one critic; N: N value heads).")
    if heads > 1 and not tags.get("multi_head_critic"):
        raise ConfigError(
            f"algo.critic.num_heads={heads} gives [B, R, {heads}] values, but algo.adv_estimator={adv} reads one "
            f"critic. Fix: algo.critic.num_heads=1, or an estimator that uses several critics (t5)."
        )
    if tags.get("needs_group") and n < 2:
        raise ConfigError(
            f"algo.adv_estimator={adv} is a group baseline and needs algo.n_samples_per_prompt >= 2 "
            f"(got {n}); with one rollout per prompt use sao (value model) or mssr."
        )
    if tags.get("odd_group") and (n < 3 or n % 2 == 0):
        raise ConfigError(
            f"algo.adv_estimator={adv} takes the group median of G+1 rollouts as its pivot: "
            f"algo.n_samples_per_prompt must be odd and >= 3, got {n}."
        )
    ltags = POLICY_LOSSES.entry(loss).tags
    if ltags.get("needs_group") and n < 2:
        raise ConfigError(
            f"algo.loss={loss} fits a distribution over each prompt's group of rollouts and needs "
            f"algo.n_samples_per_prompt >= 2 (got {n})."
        )
    if ltags.get("sequence_sum") and agg == "seq-mean-token-mean":
        raise ConfigError(
            f"algo.loss={loss} puts a sequence-level gradient on the sum of its token log-probs; "
            f"algo.loss_agg=seq-mean-token-mean would divide it by each response's length. "
            f"Use algo.loss_agg=seq-mean-token-sum (the preset's), token-mean or seq-mean-token-sum-norm."
        )
    kl_coef = float(_get(kl, "coef", 0.0) or 0.0)
    if kl_coef < 0:
        raise ConfigError(f"algo.kl.coef must be >= 0, got {kl_coef}.")
    if kl_coef > 0 and bool(_get(kl, "in_reward", False)) and not tags.get("uses_token_rewards"):
        users = ", ".join(e.name for e in ADV_ESTIMATORS if e.tags.get("uses_token_rewards"))
        raise ConfigError(
            f"algo.kl.in_reward=true puts the KL penalty into token rewards, but algo.adv_estimator={adv} "
            f"only reads the outcome reward, so the penalty would be ignored. Use algo.kl.in_reward=false "
            f"(KL in the loss) or an estimator that reads token rewards ({users})."
        )

    if loss == "gpg" and (int(_get(algo_cfg, "ppo_epochs", 1)) > 1 or int(_get(algo_cfg, "mini_batches", 1)) > 1):
        raise ConfigError(
            "algo.loss=gpg is a plain on-policy policy gradient without a trust region: "
            "set algo.ppo_epochs=1 and algo.mini_batches=1, or use a clipped loss (ppo_clip, cispo...)."
        )


def _takes_baseline(adv: str) -> bool:
    return "baseline" in {f.name for f in dataclasses.fields(ADV_ESTIMATORS.params_of(adv))}


def _check_baseline(adv: str, baseline: Any) -> None:
    """``algo.adv_params.baseline`` (VCPO's minimum-variance baseline, arXiv:2602.17616) is valid for ``adv``.

    Raises:
        ConfigError: the estimator has no ``baseline`` choice, or an unknown value.
    """
    if baseline is None:
        return

    if not _takes_baseline(adv):
        users = ", ".join(e.name for e in ADV_ESTIMATORS if _takes_baseline(e.name))
        raise ConfigError(
            f"algo.adv_params.baseline={baseline} is not a choice of algo.adv_estimator={adv}, which has its own "
            f"baseline. Fix: drop algo.adv_params.baseline, or use a group-baseline estimator that takes it ({users})."
        )
    if baseline not in BASELINES:
        raise ConfigError(f"algo.adv_params.baseline={baseline!r}: valid choices are {', '.join(BASELINES)} "
                          f"(min_variance: VCPO's importance-weighted group baseline).")


def _check_clip_range(loss: str, p: Any) -> None:
    """Range of a loss's declared clip fields (``eps_low``, ``eps_high``, ``dual_clip``).

    Raises:
        ConfigError: ``eps_low`` outside [0, 1], ``eps_high < 0`` or ``dual_clip`` not null and <= 1.
    """
    eps_low = getattr(p, "eps_low", 0.0)
    eps_high = getattr(p, "eps_high", 0.0)
    dual = getattr(p, "dual_clip", None)
    if eps_low is None or not (0.0 <= float(eps_low) <= 1.0):
        raise ConfigError(f"eps_low of algo.loss={loss} must be in [0, 1] (the lower ratio bound 1-eps_low >= 0), got {eps_low}.")
    if eps_high is None or float(eps_high) < 0.0:
        raise ConfigError(f"eps_high of algo.loss={loss} must be >= 0, got {eps_high}.")
    if dual is not None and float(dual) <= 1.0:
        raise ConfigError(f"dual_clip of algo.loss={loss} must be null or > 1, got {dual}.")


def _check_trainer_loss_keys(tp: TrainerLossParams) -> None:
    """Value checks of :class:`TrainerLossParams` (A-3PO arXiv:2512.06547, VCPO arXiv:2602.17616).

    Raises:
        ConfigError: ``vcpo_power <= 0`` or ``vcpo_min_scale`` outside (0, 1].
    """
    power = float(tp.vcpo_power)
    if power <= 0:
        raise ConfigError(f"algo.offpolicy.vcpo_power={power} must be > 0 (lr scale = ess_frac ** power).")
    floor = float(tp.vcpo_min_scale)
    if not 0.0 < floor <= 1.0:
        raise ConfigError(f"algo.offpolicy.vcpo_min_scale={floor} must be in (0, 1] (the smallest lr multiplier).")


def validate_correction(name: Optional[str], params: Optional[Mapping[str, Any]] = None) -> None:
    """Check ``precision.correction`` and ``precision.correction_params``.

    Raises:
        ConfigError: unknown correction, or a parameter it does not accept.
    """

    CORRECTIONS.resolve(name or "none", dict(params or {}), "precision.correction_params")


def check_algo_config(cfg: Any) -> None:
    """``algo``: registered estimator / loss / aggregation / KL, their declared parameters, combinations
    (:func:`validate_algo`).

    Raises:
        ConfigError: the first problem found.
    """
    validate_algo(cfg.algo)
    check_estimator_sampler(cfg)


def estimator_sampler(algo_cfg: Any) -> Optional[str]:
    """The sampler ``algo.adv_estimator`` is tagged to need (``sampler="<name>"``; Shuffle-R1's estimator
    reads the full-group advantages its sampler stores), or None."""
    name = str(algo_cfg.adv_estimator)
    return ADV_ESTIMATORS.tag(name, "sampler", None) if name in ADV_ESTIMATORS else None


def estimator_sampler_overrides(cfg: Any, overrides: List[str]) -> List[str]:
    """``["sampler=<its sampler>"]`` for an estimator tagged with one, unless the user named a sampler
    (a rule of :data:`rlpost.config.compose.COMPOSE_RULES`)."""
    want = estimator_sampler(cfg.algo)
    named = any(o.lstrip("+~").split("=", 1)[0] == "sampler" for o in overrides)
    return [] if want is None or named or cfg.sampler.name == want else [f"sampler={want}"]


def check_estimator_sampler(cfg: Any) -> None:
    """An estimator tagged with a sampler runs with that sampler.

    Raises:
        ConfigError: another sampler was named (the estimator would silently fall back to GRPO's
            advantage on rows its sampler never paired).
    """
    want = estimator_sampler(cfg.algo)
    if want is not None and str(cfg.sampler.name) != want:
        raise ConfigError(f"algo.adv_estimator={cfg.algo.adv_estimator} reads what sampler={want} stores, but "
                          f"sampler={cfg.sampler.name} was chosen. Fix: sampler={want} (or drop the sampler override).")


def check_precision_config(cfg: Any) -> None:
    """``precision``: the correction exists and ``correction_params`` holds only its declared parameters.

    Raises:
        ConfigError: as :func:`validate_correction`.
    """
    validate_correction(cfg.precision.correction, cfg.precision.correction_params)


def uses_teacher(algo_cfg: Any) -> bool:
    """Whether ``algo.loss`` or ``algo.adv_estimator`` is tagged ``needs_teacher``."""

    return bool(POLICY_LOSSES.tag(str(algo_cfg.loss), "needs_teacher", False)
                or ADV_ESTIMATORS.tag(str(algo_cfg.adv_estimator), "needs_teacher", False))


def teacher_top_k(algo_cfg: Any) -> int:
    """K of the teacher's top-K support the loss needs (0: only the sampled tokens' log-probs).

    A loss tagged ``teacher_topk="<param>"`` declares K as that parameter
    (``algo.loss_params.<param>``): the loss owns it, the teacher stage reads it.
    """

    key = POLICY_LOSSES.tag(str(algo_cfg.loss), "teacher_topk", None)
    return int(loss_kwargs(algo_cfg)[key]) if key else 0


def check_teacher_config(cfg: Any) -> None:
    """``model.teacher`` is set exactly when the algorithm uses a teacher, and names a loadable config.

    Raises:
        ConfigError: a distillation algorithm without ``model.teacher``; a teacher
            that no part of ``algo`` reads (a setting that would be ignored); a
            teacher spec that names nothing.
    """
    spec = cfg.model.get("teacher", None)
    routed = dict(cfg.model.get("teachers", None) or {})
    need = uses_teacher(cfg.algo)
    if spec and routed:
        raise ConfigError(f"model.teacher={spec} and model.teachers={routed} are both set: one teacher for every "
                          f"prompt or one per domain. Fix: drop one of them.")
    if routed:
        check_routed_teachers(cfg, routed, need)
        return
    if need and not spec and ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "routed_teachers", False):
        raise ConfigError(f"algo.adv_estimator={cfg.algo.adv_estimator} routes each prompt to its domain's teacher, but "
                          f"model.teachers is not set. Fix: model.teachers.<domain>=<model preset or HF dir> for every "
                          f"domain of the task (e.g. task=arithmetic_mix: model.teachers.basic_arithmetic=smollm2-135m "
                          f"model.teachers.chain_sum=smollm2-135m).")
    if need and not spec:
        raise ConfigError(f"algo={cfg.algo.name} (loss={cfg.algo.loss}, adv_estimator={cfg.algo.adv_estimator}) "
                          f"distils from a teacher but model.teacher is not set. Fix: model.teacher=<model preset or "
                          f"HF dir> (e.g. model.teacher=smollm2-135m), or one per domain: "
                          f"model.teachers.<domain>=<model preset or HF dir>.")
    if spec and not need:
        raise ConfigError(f"model.teacher={spec} is set but algo={cfg.algo.name} uses no teacher, so it would be "
                          f"ignored. Fix: drop model.teacher or choose a distillation preset (algo=opd).")
    if spec:
        teacher_model_config(str(spec))


def check_routed_teachers(cfg: Any, routed: Dict[str, Any], need: bool) -> None:
    """``model.teachers`` (``{domain: spec}``): read by the algorithm, one teacher per domain of the task, each loadable.

    The task's domains come from its config (:func:`rlpost.tasks.base.declared_domains`).

    Raises:
        ConfigError: an algorithm that uses no teacher; a key that is not a domain of the
            task (a misspelt domain); a domain of the task without a teacher; a spec that
            names nothing.
    """
    from rlpost.tasks.base import declared_domains

    if not need:
        raise ConfigError(f"model.teachers={routed} is set but algo={cfg.algo.name} uses no teacher, so it would be "
                          f"ignored. Fix: drop model.teachers or choose a distillation preset (algo=mopd).")
    domains = declared_domains(cfg.task)
    unknown = sorted(set(routed) - set(domains))
    if unknown:
        raise ConfigError(f"model.teachers names {unknown}, which task={cfg.task.name} does not have (its domains: "
                          f"{domains}). Fix: one key per domain of the task, spelt as the task labels it.")
    missing = [d for d in domains if d not in routed]
    if missing:
        raise ConfigError(f"task={cfg.task.name} has domain(s) {missing} without a teacher in model.teachers "
                          f"(oracle routing scores every prompt with its own domain's teacher). Fix: "
                          + " ".join(f"model.teachers.{d}=<model preset or HF dir>" for d in missing) + ".")
    for d, spec in routed.items():
        if not spec:
            raise ConfigError(f"model.teachers.{d} is empty. Fix: model.teachers.{d}=<model preset or HF dir>.")
        teacher_model_config(str(spec), f"model.teachers.{d}")


#: what an estimator tagged ``needs_window_rollouts`` (T-PPO's ``egae``) composes with
WINDOW_ROLLOUTS = ("executor.partial_rollout=true", "executor.partial_train_unfinished=true")


def window_rollout_overrides(cfg: Any, overrides: List[str]) -> List[str]:
    """The :data:`WINDOW_ROLLOUTS` overrides ``cfg`` still needs (a composition rule of
    :data:`rlpost.config.compose.COMPOSE_RULES`).

    An estimator tagged ``needs_window_rollouts`` (T-PPO's ``egae``, arXiv:2506.15050) composes
    with window-cut rollouts (the window is ``executor.partial_chunk_tokens``); a key the user named
    in ``overrides`` is kept as given (``executor.partial_train_unfinished=false`` runs EGAE on whole
    responses, i.e. GAE). Empty for every other estimator.
    """
    name = str(cfg.algo.adv_estimator)
    if name not in ADV_ESTIMATORS or not ADV_ESTIMATORS.tag(name, "needs_window_rollouts", False):
        return []
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return [o for o in WINDOW_ROLLOUTS
            if o.split("=", 1)[0] not in named and not bool(OmegaConf.select(cfg, o.split("=", 1)[0]))]
