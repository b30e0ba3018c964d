"""Rollout samplers. Importing registers the built-in ones."""

from rlpost.samplers.base import SAMPLERS, Sampler, SamplerContext, SampleResult, build_sampler  # noqa: F401
