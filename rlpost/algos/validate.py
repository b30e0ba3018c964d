"""Config-time validation of an algorithm preset and of a mismatch correction.

:func:`validate_algo` checks that the registered parts of ``algo`` exist, that
their parameters are ones the functions accept, and that the combination makes
sense (a critic for critic-based estimators, a group for group baselines, a
reward-side KL for estimators that read token rewards...). It raises
:class:`rlpost.errors.ConfigError` with a message naming the key and the fix,
before any model is loaded.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping, Optional

from rlpost.algos.registries import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from rlpost.errors import ConfigError

# Keys of algo.adv_params consumed by compute_advantages (reward shaping), not by estimators.
SHAPING_KEYS = ("overlong_buffer", "overlong_penalty", "max_len")
# Keys of algo.clip, always passed to the loss together with algo.loss_params.
CLIP_KEYS = ("eps_low", "eps_high", "dual_clip")
# Keys of algo.loss_params the trainer reads for any loss (rlpost.trainer.torch_engine): A-3PO's proximal
# policy (arXiv:2512.06547) and VCPO's ESS learning-rate scaling (arXiv:2602.17616).
TRAINER_LOSS_KEYS = ("proximal", "vcpo_lr", "vcpo_power", "vcpo_min_scale")
PROXIMAL_CHOICES = ("recompute", "a3po")


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
            return dict(OmegaConf.to_container(x, resolve=False))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover
        pass
    return dict(x)


def accepted_params(fn: Any, skip: int = 1) -> Optional[set]:
    """Keyword parameter names of ``fn`` after its first ``skip`` positional ones (None if it has none)."""
    ps = list(inspect.signature(fn).parameters.values())[skip:]
    return {p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_params(kind: str, key: str, name: str, fn: Any, params: Iterable[str], skip: int, ignore=()) -> None:
    ok = accepted_params(fn, skip) or set()
    bad = sorted(set(params) - ok - set(ignore))
    if bad:
        valid = ", ".join(sorted(ok)) or "(none)"
        raise ConfigError(
            f"{key} has unknown parameter(s) {', '.join(bad)} for {kind} {name!r}. Valid: {valid}."
        )


def validate_algo(algo_cfg: Any, root_cfg: Any = None) -> None:
    """Check an ``algo`` config (AlgoConfig, DictConfig or dict) for a consistent combination.

    Checks, each with its own message:

    * ``algo.adv_estimator``, ``algo.loss``, ``algo.loss_agg``, ``algo.kl.estimator``
      are registered (unknown names list the valid choices);
    * ``algo.adv_params`` / ``algo.loss_params`` only hold parameters the chosen
      functions accept (plus the reward-shaping keys of ``adv_params`` and the
      trainer's ``proximal`` / ``vcpo_*`` keys of ``loss_params``, range-checked);
    * ``algo.adv_params.baseline`` (``mean`` | ``min_variance``) is only set for
      estimators that take it;
    * an estimator tagged ``needs_critic`` has ``algo.critic.enabled=true``;
    * an estimator tagged ``needs_group`` has ``algo.n_samples_per_prompt >= 2``
      (``odd_group``: an odd size >= 3, so the median is a sample);
    * ``algo.kl.in_reward=true`` with ``kl.coef > 0`` needs an estimator that
      reads token rewards (``uses_token_rewards``), else the KL would be dropped;
    * clip range: ``0 <= eps_low <= 1``, ``eps_high >= 0``, ``dual_clip`` null or > 1;
    * ``ppo_epochs``, ``mini_batches``, ``n_samples_per_prompt`` >= 1,
      ``loss_agg_norm`` null or > 0, ``kl.coef >= 0``;
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
    critic = _get(algo_cfg, "critic")
    clip = _as_dict(_get(algo_cfg, "clip"))
    n = int(_get(algo_cfg, "n_samples_per_prompt", 1) or 0)

    adv_fn = ADV_ESTIMATORS.get(adv)
    loss_fn = POLICY_LOSSES.get(loss)
    LOSS_AGGS.get(agg)
    kl_est = _get(kl, "estimator", "k3")
    KL_ESTIMATORS.get(kl_est)

    adv_params = _as_dict(_get(algo_cfg, "adv_params"))
    _check_baseline(adv, adv_fn, adv_params.get("baseline"))
    _check_params("advantage estimator", "algo.adv_params", adv, adv_fn, adv_params, 1, SHAPING_KEYS)
    loss_params = _as_dict(_get(algo_cfg, "loss_params"))
    _check_params("policy loss", "algo.loss_params", loss, loss_fn, loss_params, 1, CLIP_KEYS + TRAINER_LOSS_KEYS)
    _check_trainer_loss_keys(loss_params)

    for k in ("ppo_epochs", "mini_batches", "n_samples_per_prompt"):
        v = _get(algo_cfg, k, 1)
        if v is not None and int(v) < 1:
            raise ConfigError(f"algo.{k} must be >= 1, got {v}.")
    norm = _get(algo_cfg, "loss_agg_norm")
    if norm is not None and float(norm) <= 0:
        raise ConfigError(f"algo.loss_agg_norm must be null or > 0, got {norm}.")

    tags = ADV_ESTIMATORS.entry(adv).tags
    if tags.get("needs_critic") and not bool(_get(critic, "enabled", False)):
        raise ConfigError(
            f"algo.adv_estimator={adv} needs a critic (value model) but algo.critic.enabled is false. "
            f"Set algo.critic.enabled=true, or choose a critic-free estimator (grpo, rloo, reinforce_pp, ...)."
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

    eps_low = clip.get("eps_low", 0.2)
    eps_high = clip.get("eps_high", 0.2)
    dual = clip.get("dual_clip")
    if eps_low is None or not (0.0 <= float(eps_low) <= 1.0):
        raise ConfigError(f"algo.clip.eps_low must be in [0, 1] (the lower ratio bound 1-eps_low >= 0), got {eps_low}.")
    if eps_high is None or float(eps_high) < 0.0:
        raise ConfigError(f"algo.clip.eps_high must be >= 0, got {eps_high}.")
    if dual is not None and float(dual) <= 1.0:
        raise ConfigError(f"algo.clip.dual_clip must be null or > 1, got {dual}.")
    if loss == "gpg" and (int(_get(algo_cfg, "ppo_epochs", 1)) > 1 or int(_get(algo_cfg, "mini_batches", 1)) > 1):
        raise ConfigError(
            "algo.loss=gpg is a plain on-policy policy gradient without a trust region: "
            "set algo.ppo_epochs=1 and algo.mini_batches=1, or use a clipped loss (ppo_clip, cispo...)."
        )

    if root_cfg is not None:
        prec = _get(root_cfg, "precision")
        if prec is not None:
            validate_correction(_get(prec, "correction", "none"), _as_dict(_get(prec, "correction_params")))


def _check_baseline(adv: str, adv_fn: Any, baseline: Any) -> None:
    """``algo.adv_params.baseline`` (VCPO's minimum-variance baseline, arXiv:2602.17616) is valid for ``adv``.

    Raises:
        ConfigError: the estimator has no ``baseline`` choice, or an unknown value.
    """
    if baseline is None:
        return
    from rlpost.algos.advantages import BASELINES

    if "baseline" not in (accepted_params(adv_fn) or set()):
        users = ", ".join(e.name for e in ADV_ESTIMATORS if "baseline" in (accepted_params(e.obj) or set()))
        raise ConfigError(
            f"algo.adv_params.baseline={baseline} is not a choice of algo.adv_estimator={adv}, which has its own "
            f"baseline. Fix: drop algo.adv_params.baseline, or use a group-baseline estimator that takes it ({users})."
        )
    if baseline not in BASELINES:
        raise ConfigError(f"algo.adv_params.baseline={baseline!r}: valid choices are {', '.join(BASELINES)} "
                          f"(min_variance: VCPO's importance-weighted group baseline).")


def _check_trainer_loss_keys(lp: Mapping[str, Any]) -> None:
    """Value checks of :data:`TRAINER_LOSS_KEYS` (A-3PO arXiv:2512.06547, VCPO arXiv:2602.17616).

    Raises:
        ConfigError: unknown ``proximal``, ``vcpo_power <= 0`` or ``vcpo_min_scale`` outside (0, 1].
    """
    prox = lp.get("proximal", "recompute")
    if prox not in PROXIMAL_CHOICES:
        raise ConfigError(f"algo.loss_params.proximal={prox!r}: valid choices are {', '.join(PROXIMAL_CHOICES)} "
                          f"(a3po: A-3PO's interpolated proximal policy, no extra forward pass).")
    power = float(lp.get("vcpo_power", 1.0))
    if power <= 0:
        raise ConfigError(f"algo.loss_params.vcpo_power={power} must be > 0 (lr scale = ess_frac ** power).")
    floor = float(lp.get("vcpo_min_scale", 0.1))
    if not 0.0 < floor <= 1.0:
        raise ConfigError(f"algo.loss_params.vcpo_min_scale={floor} must be in (0, 1] (the smallest lr multiplier).")


def validate_correction(name: Optional[str], params: Optional[Mapping[str, Any]] = None) -> None:
    """Check ``precision.correction`` and ``precision.correction_params``.

    Raises:
        ConfigError: unknown correction, or a parameter it does not accept.
    """
    from rlpost.algos.corrections import CORRECTIONS

    name = name or "none"
    fn = CORRECTIONS.get(name)
    _check_params("correction", "precision.correction_params", name, fn, dict(params or {}), 3)
