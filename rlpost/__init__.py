"""rlpost: a command-line experiment runner for RL post-training of language models.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
already sets it (an empty value keeps the OpenMP runtime's own default). It must
happen before torch loads its OpenMP runtime, which ``rlpost``'s CLI guarantees.
Why: torch's CPU kernels run in OpenMP parallel regions, and by default idle
OpenMP threads spin at each barrier. When other processes share the cores, a
spinning thread burns the time slice its descheduled sibling needs, and every
small kernel of token-by-token decoding waits for a scheduler tick: steps slowed
20-40x beside 3-4 competing processes on 2 cores. Passive threads sleep at the
barrier instead (``scripts/bench_oversubscription.py`` measures both).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
