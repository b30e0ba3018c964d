"""Error types that the CLI turns into one clear message and an exit status.

Every error a user can cause (bad config, missing model, unreadable data) is raised
as a subclass of :class:`RlpostError`; the CLI prints its message without a
traceback. Internal bugs stay ordinary exceptions so they keep their traceback.
"""

from __future__ import annotations


class RlpostError(Exception):
    """Base class of user-facing errors. ``exit_code`` is the process exit status."""

    exit_code = 1


class ConfigError(RlpostError):
    """A config key, type or group choice is invalid. Exits with status 2.

    The message names the offending key and, where there is a finite set, the
    valid choices.
    """

    exit_code = 2


class ModelLoadError(RlpostError):
    """A model could not be found or loaded (no hub access, bad path)."""

    exit_code = 3


class DataError(RlpostError):
    """A dataset file is missing or malformed."""

    exit_code = 4


class TrainingDiverged(RlpostError):
    """The loss became NaN/inf more times in a row than ``trainer.max_bad_steps`` allows.

    The last good checkpoint is kept; the message names it.
    """

    exit_code = 5


class VerifierTimeout(Exception):
    """A verifier's own time limit ended its check (a sandbox's wall clock running a response's tests).

    Raised by a task's ``score``; :func:`rlpost.rewards.scoring.verify` turns it into status ``"timeout"``:
    the row scores 0 and counts in ``reward/verifier_timeouts``, like a verifier worker that ran past
    ``task.reward.timeout_s``.
    """


class Interrupted(KeyboardInterrupt):
    """The run stopped on SIGINT/SIGTERM after saving a checkpoint; the message says what was saved.

    The ``rlpost`` command exits with status 130 (the shell's code for Ctrl-C). It is a
    :class:`KeyboardInterrupt`, not an :class:`RlpostError`, so that a caller running
    training in its own process (a test runner, a notebook) sees the interrupt it asked
    for and stops, instead of taking it for one failed call and going on.
    """

    exit_code = 130
