"""Rollout samplers. Importing registers the built-in ones."""

from rlpost.samplers.base import SAMPLERS, Sampler, SamplerContext, SampleResult, build_sampler  # noqa: F401
from rlpost.samplers import adaptive, bandit, episode, hdl, perturb, prune, speculative, temperature, tree  # noqa: F401,E402
