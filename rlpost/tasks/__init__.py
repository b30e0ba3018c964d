"""Tasks: datasets, prompt rendering and verifiers. Importing registers the built-in kinds."""

from rlpost.tasks import code_task, file_task, game_task, reasoning_gym_task  # noqa: F401
from rlpost.tasks.base import TASKS, Example, Task, build_task  # noqa: F401
