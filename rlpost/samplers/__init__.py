"""Rollout samplers. Importing registers the built-in ones."""

from rlpost.samplers.base import SAMPLERS, Sampler, SamplerContext, SampleResult, build_sampler, runs_episodes  # noqa: F401
from rlpost.samplers import adaptive, bandit, episode, hdl, perturb, prune, speculative, temperature, tree  # noqa: F401,E402
from rlpost.samplers import scope  # noqa: F401,E402  (SCOPE: PRM-located repair of failed rollouts)
from rlpost.samplers import elpo  # noqa: F401,E402  (ELPO: binary-search tree to the first irrecoverable step)
from rlpost.samplers import shuffle_r1  # noqa: F401,E402  (Shuffle-R1: PTS + ABS)
from rlpost.samplers import trace  # noqa: F401,E402  (TRACE: tree rollout allocation over turn prefixes)
from rlpost.core.registry import as_dict


def check_config(cfg) -> None:
    """``sampler``: registered, ``sampler.params`` holds only its declared parameters (types checked),
    and the sampler accepts their values.

    The sampler is built once and dropped, so a range check in its constructor (M3PO's
    ``mix_lambda`` in [0, 1], an unknown AgentFlow tool) stops ``rlpost config`` instead of the
    run's build. Constructors only check and store their parameters; engines, models and tools'
    processes are attached later (``Sampler.setup``, ``attach``).

    Raises:
        ConfigError: an unknown sampler or parameter, or a value the sampler refuses.
    """

    SAMPLERS.resolve(cfg.sampler.name, as_dict(cfg.sampler.params), "sampler.params")
    algo = cfg.get("algo", None)
    if algo is not None and algo.get("n_samples_per_prompt", None) is not None:
        build_sampler(cfg.sampler, int(algo.n_samples_per_prompt))
from rlpost.samplers import xrpo_icl  # noqa: F401,E402  (XRPO: in-context seeding of prompts whose probes all failed)
from rlpost.samplers import r3l  # noqa: F401,E402  (R^3L: reflect on failed attempts, retry from the failure step)
from rlpost.samplers import rc_grpo  # noqa: F401,E402  (RC-GRPO: reward tokens in the prompt, stage 1 rctp and stage 2 rc_grpo)
from rlpost.samplers import echo  # noqa: F401,E402  (ECHO: entropy-confidence branch width, low-confidence pruning)
from rlpost.samplers import s2l  # noqa: F401,E402  (S2L-PO: a frozen small explorer model's rollouts in each group, annealed away)
from rlpost.samplers import neighbor_mixing  # noqa: F401,E402  (N-GRPO: embedding-level neighbour mixing while decoding)
from rlpost.samplers import lens  # noqa: F401,E402  (LENS: purify low-success prompts, train the originals on the result)
from rlpost.samplers import m3po  # noqa: F401,E402  (M3PO: a group's thinking paths mix their input embeddings by distribution similarity)
from rlpost.samplers import empo2  # noqa: F401,E402  (EMPO²: memory of self-written tips, on-/off-policy rollout modes)
from rlpost.samplers import agentflow  # noqa: F401,E402  (AgentFlow: planner / executor / verifier / generator, one row per planner turn)
from rlpost.samplers import datpo  # noqa: F401,E402  (DATPO: difficulty-adaptive sentence-entropy tree, sibling diversities)
