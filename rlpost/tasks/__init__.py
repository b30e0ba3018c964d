"""Tasks: datasets, prompt rendering and verifiers. Importing registers the built-in kinds."""

from rlpost.tasks import code_task, file_task, game_task, reasoning_gym_task  # noqa: F401
from rlpost.tasks.base import TASKS, Example, Task, build_task  # noqa: F401
from rlpost.core.errors import ConfigError
from rlpost.tasks.answer_tags import EXTRACTORS


def check_config(cfg) -> None:
    """``task``: a registered kind and answer format.

    Raises:
        ConfigError: an unknown ``task.kind`` or ``task.answer_format``.
    """

    TASKS.entry(cfg.task.kind)
    if cfg.task.answer_format not in EXTRACTORS:
        raise ConfigError(f"Invalid config: task.answer_format={cfg.task.answer_format!r}: valid choices are "
                          f"{', '.join(EXTRACTORS)}.")
