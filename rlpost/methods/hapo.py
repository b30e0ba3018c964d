"""HAPO's sampling side: per-token adaptive temperature belongs to ``sampler=adaptive_temperature``.

"From Uniform to Heterogeneous: Tailoring Policy Optimization to Every
Token's Nature" (HAPO, arXiv:2509.16591) samples with its Adaptive
Temperature Sampling, which :class:`rlpost.samplers.temperature.AdaptiveTemperatureSampler`
implements (its ``tau`` is ``sampler.params.tau``); ``algo=hapo`` composes with
it (:data:`TEMPERATURE_SAMPLERS`, read by :func:`rlpost.config.compose.compose_config`).
"""

from __future__ import annotations

from typing import Any, List

from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method

#: losses whose paper samples with a per-token temperature, and the sampler that owns it
TEMPERATURE_SAMPLERS = {"hapo": "adaptive_temperature"}


def sampler_overrides(cfg: Any, overrides: List[str]) -> List[str]:
    """``["sampler=<its sampler>"]`` for a loss in :data:`TEMPERATURE_SAMPLERS` composed with another
    sampler the user did not name (a rule of :data:`rlpost.config.compose.COMPOSE_RULES`): ``algo=hapo``
    alone samples with ``sampler=adaptive_temperature``. A sampler the user names is kept; a
    conflicting one is refused by :func:`check_sampler`.
    """
    want = TEMPERATURE_SAMPLERS.get(str(cfg.algo.loss))
    named = any(o.lstrip("+~").split("=", 1)[0] == "sampler" for o in overrides)
    return [] if want is None or named or cfg.sampler.name == want else [f"sampler={want}"]


def check_sampler(algo_cfg: Any, sampler_name: str) -> None:
    """Per-token temperature has one owner, the sampler: refuse conflicting settings.

    ``algo.loss=hapo`` with another sampler, or a temperature range given to the
    algorithm (``algo.loss_params.temperature_tau``, where it used to live), is a
    configuration error.

    Raises:
        rlpost.core.errors.ConfigError: either conflict, naming the fix.
    """
    lp = dict(algo_cfg.loss_params or {})
    if "temperature_tau" in lp:
        raise ConfigError(f"algo.loss_params.temperature_tau={lp['temperature_tau']}: the per-token temperature is "
                          f"owned by the sampler. Fix: sampler=adaptive_temperature "
                          f"sampler.params.tau={lp['temperature_tau']} (and drop algo.loss_params.temperature_tau).")
    want = TEMPERATURE_SAMPLERS.get(str(algo_cfg.loss))
    if want is not None and sampler_name != want:
        raise ConfigError(f"algo.loss={algo_cfg.loss} samples with per-token adaptive temperature, which "
                          f"sampler={want} owns; sampler={sampler_name} would drop it. Fix: add sampler={want}.")


@METHODS.register("hapo", paper="HAPO (arXiv:2509.16591)")
class AdaptiveTemperature(Method):
    """Refuses a sampler that would drop the per-token temperature."""

    name = "hapo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.loss) in TEMPERATURE_SAMPLERS or "temperature_tau" in dict(cfg.algo.loss_params or {})

    def validate(self) -> None:
        check_sampler(self.cfg.algo, str(self.cfg.sampler.name))
