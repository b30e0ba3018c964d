"""Rollout samplers. Importing registers the built-in ones."""

import re
from typing import List

from rlpost.samplers.base import SAMPLERS, Sampler, SamplerContext, SampleResult, build_sampler, runs_episodes  # noqa: F401
from rlpost.samplers import adaptive, bandit, episode, hdl, perturb, prune, speculative, temperature, tree  # noqa: F401,E402
from rlpost.samplers import scope  # noqa: F401,E402  (SCOPE: PRM-located repair of failed rollouts)
from rlpost.samplers import elpo  # noqa: F401,E402  (ELPO: binary-search tree to the first irrecoverable step)
from rlpost.samplers import shuffle_r1  # noqa: F401,E402  (Shuffle-R1: PTS + ABS)
from rlpost.samplers import trace  # noqa: F401,E402  (TRACE: tree rollout allocation over turn prefixes)
from rlpost.core.errors import ConfigError
from rlpost.core.registry import as_dict, param_rows


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
    check_process_local_hooks(cfg)
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


def check_process_local_hooks(cfg) -> None:
    """Refuse a sampler whose decoding hook keeps state in this process when rollouts run elsewhere.

    A sampler registered with the tag ``process_local_hooks="<what the hook keeps>"`` (HAPO's
    per-token temperature, N-GRPO's and M3PO's mixed inputs) fills that state while the engine
    decodes. Ray rollout workers (``launcher=ray``) decode in other processes, and data-parallel
    ranks (``trainer.num_procs > 1``) each decode a slice of the rows and update on another split,
    so the state would be partial or missing where it is read (the trainer's log-probs would be
    computed on inputs the rollouts did not see).

    Raises:
        ConfigError: such a sampler with ``launcher=ray`` or ``trainer.num_procs > 1``.
    """
    name = str(cfg.sampler.name)
    what = SAMPLERS.tag(name, "process_local_hooks", None)
    if not what:
        return
    lc = cfg.get("launcher", None)
    ray = lc is not None and str(lc.get("name", "none")) != "none"
    procs = int(cfg.get("trainer", {}).get("num_procs", 1) or 1)
    if ray or procs > 1:
        where = "launcher=ray decodes in Ray workers" if ray else f"trainer.num_procs={procs} splits the rows across ranks"
        raise ConfigError(f"sampler={name} keeps {what} in the process that decodes, but {where}, so they would be "
                          f"partial or lost. Fix: launcher=none trainer.num_procs=1 (one process), or another sampler.")


def env_sampler_check(cfg, overrides: List[str]) -> List[str]:
    """Refuse ``sampler=X`` that a preset composed on the same command line replaces; adds no override.

    An env preset (``conf/env``, named as ``env=`` or composed by a ``+recipe=``) is global and sets
    ``sampler.name`` after the sampler group is composed, so ``env=calculator sampler=empo2`` would
    run the plain episode sampler without a word. ``sampler=X`` may also come from a composition
    rule (``algo=hapo`` adds its sampler). When X takes the env's episode settings,
    ``sampler.name=X`` (a key, applied last) is the fix; otherwise the two cannot be combined.

    Raises:
        ConfigError: the composed sampler is not the last ``sampler=X`` asked for.
    """
    chosen = env = recipe = None
    for o in overrides:
        m = re.match(r"^\+{0,2}(sampler|env|recipe)=([A-Za-z0-9_.-]+)$", o.strip())
        if m:
            kind, value = m.group(1), m.group(2)
            chosen, env, recipe = (value if kind == "sampler" else chosen, value if kind == "env" else env,
                                   value if kind == "recipe" else recipe)
    got = str(cfg.get("sampler", {}).get("name", ""))
    if not chosen or got == chosen:
        return []
    src = f"env={env}" if env else (f"+recipe={recipe} (through the env preset it composes)" if recipe
                                    else "a preset on this command line")
    algo = cfg.get("algo", {}).get("name", "?")
    given = set((cfg.sampler.get("params", None) or {}).keys())
    valid = {r[0] for r in param_rows(SAMPLERS.params_of(chosen))} if chosen in SAMPLERS else set()
    if valid and given <= valid:
        raise ConfigError(f"{src} sets the sampler to {got!r}, which replaces the requested sampler={chosen}. Fix: "
                          f"sampler.name={chosen} (keeps the preset's episode settings), or drop sampler={chosen}.")
    raise ConfigError(f"{src} sets the sampler to {got!r}, which replaces the requested sampler={chosen}; {chosen} does "
                      f"not take the preset's episode settings ({', '.join(sorted(given - valid))}), so the two cannot "
                      f"run together. Fix: drop one of them (if algo={algo} asked for sampler={chosen}, algo={algo} "
                      f"does not run on env episodes).")
