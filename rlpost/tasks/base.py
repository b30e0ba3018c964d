"""Task interface: a dataset of prompts with gold answers and a verifier.

A task yields :class:`Example` objects for a training split and a disjoint
held-out evaluation split, renders an example into a prompt with the model's
chat template, and scores a response. Scoring may raise or hang: the reward stage
(:mod:`rlpost.rewards`) runs it with a timeout and turns failures into reward 0.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from rlpost.core.registry import Registry
from rlpost.tasks.answer_tags import INSTRUCTIONS
from rlpost.tasks.chat import encode_framed, template_parts

TASKS = Registry("task kind", "task.kind")


@dataclass
class Example:
    """One prompt of a task.

    Attributes:
        index: position in its split (stable across runs with the same data_seed).
        question: the problem text shown to the model (before templating).
        answer: gold answer (string, number or a task-specific object).
        meta: anything the verifier needs (e.g. a reasoning-gym entry).
    """

    index: int
    question: str
    answer: Any
    meta: Dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """Base class of tasks. Subclasses implement loading and :meth:`score`.

    Args:
        cfg: the ``task`` config node (:class:`rlpost.config.schema.TaskConfig`).
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.name = cfg.name

    @abstractmethod
    def train_examples(self) -> List[Example]:
        """Training split."""

    @abstractmethod
    def eval_examples(self) -> List[Example]:
        """Held-out split; never overlaps the training split."""

    @abstractmethod
    def score(self, response: str, example: Example) -> float:
        """Correctness reward in [0, 1] of ``response`` for ``example`` (may raise)."""

    def extract_answer(self, response: str) -> Optional[str]:
        """The final answer found in ``response``, or None (for logs and majority votes)."""
        return None

    def answer_key(self, response: str) -> Optional[str]:
        """A normalised form of the extracted answer used to group equal answers in
        majority votes (maj@k, TTRL pseudo-labels): whitespace removed, lower-cased,
        a trailing ``.0`` and thousands separators dropped. None when no answer is found.
        """
        ans = self.extract_answer(response)
        if ans is None:
            return None
        key = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", "".join(str(ans).split()).lower())
        if key.endswith(".0"):
            key = key[:-2]
        return key or None

    def format_ok(self, response: str) -> bool:
        """Whether ``response`` follows the requested answer format (for a format reward).

        ``task.reward.format_regex``, when set, must be found (``re.search``);
        otherwise an answer must be extractable.
        """
        pattern = getattr(getattr(self.cfg, "reward", None), "format_regex", None)
        if pattern:
            return re.search(pattern, response or "", re.DOTALL) is not None
        return self.extract_answer(response) is not None

    def visible_score(self, response: str, example: Example) -> float:
        """Execution feedback on the problem's *visible* tests only, in [0, 1]: the fraction passed.

        The tests a solver may see (e.g. a docstring's examples), never those :meth:`score` uses: a
        test-time strategy (``eval.test_time``, :mod:`rlpost.eval.test_time`) learns from this one
        while the evaluation scores with :meth:`score`. Tasks without visible tests do not override
        it.

        Raises:
            NotImplementedError: the task has no visible tests.
        """
        raise NotImplementedError(f"task {self.name!r} exposes no visible tests")

    def with_answer(self, example: Example, answer: Any) -> Example:
        """A copy of ``example`` whose gold answer is ``answer`` (TTRL pseudo-labels).

        Subclasses whose verifier reads the gold from ``meta`` override this.
        """
        return Example(index=example.index, question=example.question, answer=answer, meta=dict(example.meta))

    def reference_solution(self, example: Example) -> str:
        """A worked solution of ``example`` ending in its answer (SEELE's hints are prefixes of it).

        :func:`stored_solution` (the data's own solution, else the bare gold
        answer). Subclasses that can write a worked solution override this.
        """
        return stored_solution(example)

    def user_message(self, example: Example) -> str:
        """The user turn: question plus the answer-format instruction.

        ``task.instruction`` is free text, or one of the shortcuts ``boxed``,
        ``tags``, ``last_number``, ``hashes`` that expand to a ready sentence
        (:data:`rlpost.tasks.answer_tags.INSTRUCTIONS`).
        """

        instr = self.cfg.instruction
        instr = INSTRUCTIONS.get(instr, instr) if instr else instr
        return f"{example.question}\n{instr}".strip() if instr else example.question

    def render_prompt(self, example: Example, tokenizer: Any) -> List[int]:
        """Token ids of the chat-templated prompt, ending with the assistant header.

        Message contents (question, environment observation, system prompt) are plain text: only
        the template's framing carries special ids (:func:`rlpost.tasks.chat.encode_framed`),
        so a question or observation holding ``<|im_start|>`` cannot forge a turn. Equal to
        ``apply_chat_template(tokenize=True)`` whenever no content holds a special token's text.
        """

        msgs = []
        if self.cfg.system_prompt:
            msgs.append({"role": "system", "content": self.cfg.system_prompt})
        msgs.append({"role": "user", "content": self.user_message(example)})
        if getattr(tokenizer, "chat_template", None):
            return encode_framed(tokenizer, *template_parts(tokenizer, msgs, True))
        text = "\n".join(m["content"] for m in msgs) + "\n"
        return tokenizer(text, split_special_tokens=True)["input_ids"]


def stored_solution(example: Example) -> str:
    """``example.meta['solution']`` when the data carries one, else ``str(example.answer)``."""
    sol = (getattr(example, "meta", None) or {}).get("solution")
    return str(sol) if sol else str(example.answer)


def build_task(cfg: Any) -> Task:
    """Instantiate the task kind named by ``cfg.kind``.

    Raises:
        ConfigError: unknown kind (lists the valid ones).
    """
    import rlpost.tasks  # noqa: F401  (registers the built-in kinds)

    return TASKS.get(cfg.kind)(cfg)


def task_prompts(task: Any, tokenizer: Any, seed: int, examples: Any = None) -> Callable[[int], List[List[int]]]:
    """``fn(n)``: ``n`` rendered training prompts of ``task``, a seeded draw without replacement.

    What :func:`rlpost.rollout.mtp_draft.mtp_engine` fits a draft head on. ``examples``: the task's training examples (None:
    ``task.train_examples()``, read only when ``fn`` is called). The draw is a permutation under
    ``torch.Generator().manual_seed(seed)`` (no global RNG draw); ``n`` is capped at the split's size.
    """

    def fn(n: int) -> List[List[int]]:
        ex = task.train_examples() if examples is None else examples
        idx = torch.randperm(len(ex), generator=torch.Generator().manual_seed(int(seed)))[: int(n)]
        return [list(task.render_prompt(ex[int(i)], tokenizer)) for i in idx]

    return fn


#: the domain of an example whose task gives none (``example.meta['domain']`` absent)
DEFAULT_DOMAIN = "default"


def example_domain(example: Any) -> str:
    """The domain label of ``example``: ``example.meta['domain']``, else :data:`DEFAULT_DOMAIN`."""
    return str((getattr(example, "meta", None) or {}).get("domain", DEFAULT_DOMAIN))


def declared_domains(task_cfg: Any) -> List[str]:
    """The domains a task config's examples carry, read from the config alone (no dataset is built).

    A reasoning-gym composite (``task.dataset=composite``) labels each item by its source
    dataset (the names in ``task.params.datasets``); a single reasoning-gym dataset by its
    name; every other kind sets no domain, so its examples are :data:`DEFAULT_DOMAIN`.
    Multi-domain routing (``model.teachers``) is checked against this list before any
    weights load; the built examples are checked again when the run starts.

    Returns:
        The sorted distinct domain names.
    """
    kind, dataset = str(task_cfg.get("kind", "")), str(task_cfg.get("dataset", ""))
    if kind == "reasoning_gym" and dataset == "composite":
        items = (task_cfg.get("params", None) or {}).get("datasets", None) or []
        return sorted({str(d["name"]) for d in items if "name" in d})
    if kind == "reasoning_gym" and dataset:
        return [dataset]
    return [DEFAULT_DOMAIN]
