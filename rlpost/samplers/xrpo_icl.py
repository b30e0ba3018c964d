"""``sampler=xrpo_icl``: XRPO's in-context seeding: prompts whose probe rollouts all failed get solved exemplars.

"XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation"
(arXiv:2510.06672; authors' code https://github.com/UIUC-MLSys/XRPO, not
reachable here). A prompt whose rollouts all fail gives GRPO a group of equal
rewards and no gradient; XRPO breaks that symmetry by putting verified worked
solutions of similar problems into the prompt's context, so that some of the
next rollouts succeed. XRPO's other two parts are ``selector=xrpo`` (the
rollout allocator, :mod:`rlpost.selectors.xrpo_allocator`) and
``algo.adv_estimator=xrpo`` (novelty sharpening, :mod:`rlpost.algos.xrpo`);
``recipes/xrpo_full.yaml`` runs the three together.

What was read: the abstract (seeding of "zero-reward prompts" with "curated
exemplars") and the public reviews of the paper, which quote its method: seeding
is activated for prompts whose rollouts have all failed; the exemplars are
retrieved by embedding similarity (Qwen3-Embedding-8B) from an *evolving corpus
of verified successes*; the ICL template holds ``K = 2`` retrieved examples,
overly long solutions truncated; a prompt with no similar solved example falls
back to its zero-shot form. The method section itself was not readable.

Our reading, where those sources are silent (each a parameter):

* **Phases.** The paper's planner draws a step's rollouts in phases; here each
  prompt's rollouts (``n_samples``, or the allocator's count) are split into a
  probe share (``probe_fraction``) drawn first, unseeded, and the rest drawn
  after the check: seeded for a prompt whose probe solve rate is at most
  ``max_solve_rate`` (0: every probe failed, the paper's trigger), unseeded
  otherwise. The budget is unchanged (no extra rollouts).
* **Corpus.** It starts from the declared exemplar file (``exemplar_file``,
  jsonl ``{question, solution}``; one ships for the default task) and, with
  ``grow_corpus``, gains each prompt's first solved unseeded rollout (the
  paper's evolving corpus); the grown part is saved in the sampler state.
* **Retrieval.** Cosine similarity of character-trigram counts of the questions
  (no embedding model here); an exemplar whose question is the prompt's own
  is never used (it would give the answer away).
* **Template.** The exemplars go into the user turn before the problem (the
  system prompt and the answer-format instruction stay where the task puts
  them): :func:`seeded_question`.
* **Training.** ``train_on=seeded`` (default): a seeded rollout is trained
  under the prompt it was sampled from, exemplars included, so the policy
  ratio and the engine's log-probs refer to the same context; the exemplar
  tokens are prompt tokens, never in the loss mask. ``train_on=original``: its
  prompt is swapped back to the original one, so the loss teaches the policy
  to produce the seeded solution without the exemplars (no correction for the
  context change; the engine's log-probs still refer to the seeded context).
  Seeded rows share their group (and baseline) with the prompt's probes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.jsonl import iter_jsonl
from rlpost.core.registry import Choice, param
from rlpost.core.batch import left_pad
from rlpost.tasks.chat import encode_framed, template_parts
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, generate_groups, merge_results, pad_id_of, score_rows, step_params

PAPER = "XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation (arXiv:2510.06672)"

#: where a bare ``exemplar_file`` name is looked up: ``rlpost/samplers/exemplars/NAME.jsonl`` (package data)
EXEMPLAR_DIR = Path(__file__).resolve().parent / "exemplars"

HEADER = "Here are solved examples of similar problems.\n\n"
FOOTER = "Now solve this problem.\n"


class Template(Choice):
    """Where a seeded prompt's exemplars go."""

    chat_turns = "chat_turns"
    user_turn = "user_turn"


class TrainOn(Choice):
    """Which prompt the loss sees for a seeded rollout."""

    seeded = "seeded"
    original = "original"


@dataclass(frozen=True)
class XRPOICLParams:
    """XRPO's in-context seeding; K is the paper's (as a review quotes it), the rest our choices."""

    exemplar_file: str = param("arithmetic", "jsonl of verified exemplars, one {question, solution[, task]} a line; a "
                               "bare name is the packaged rlpost/samplers/exemplars/NAME.jsonl (scripts/make_exemplars.py)")
    num_exemplars: int = param(2, "K, exemplars put into a seeded prompt (the paper, as a review quotes it: 2)")
    probe_fraction: float = param(0.5, "share of each prompt's rollouts drawn first, unseeded; the rest after the check")
    solved_at: float = param(1.0, "a rollout whose reward is at least this is solved (the default task's correct answer scores 1)")
    max_solve_rate: float = param(0.0, "a prompt is seeded when its probes' solve rate is at most this (0: all failed)")
    grow_corpus: bool = param(True, "add each prompt's first solved unseeded rollout to the corpus (an evolving corpus)")
    max_corpus: int = param(2048, "grown exemplars kept at most, oldest dropped first (the file's are always kept)")
    max_solution_chars: int = param(800, "an exemplar's solution is cut to this many characters (long ones are truncated)")
    template: Template = param(Template.chat_turns, "chat_turns: each exemplar a user turn and an assistant turn before "
                               "the problem's; user_turn: all in the problem's user turn (seeded_question)")
    train_on: TrainOn = param(TrainOn.seeded, "seeded: the loss sees the prompt with its exemplars; original: without them")


# ----------------------------------------------------------------- exemplars
def resolve_exemplar_file(spec: str) -> Path:
    """The path of ``spec``: a bare name (no ``/``, no suffix) is ``EXEMPLAR_DIR/NAME.jsonl``, else a file path."""
    s = str(spec)
    if s and "/" not in s and "\\" not in s and not s.endswith(".jsonl"):
        return EXEMPLAR_DIR / f"{s}.jsonl"
    return Path(s).expanduser()


def load_exemplars(spec: str) -> Tuple[Path, List[Dict[str, str]]]:
    """``(path, records)`` of exemplar file ``spec``: each record has ``question`` and ``solution`` (and maybe ``task``).

    Raises:
        ConfigError: the file is missing, empty, not jsonl, or a line lacks a
            non-empty ``question`` / ``solution`` string; the message names the
            file (and line) and the fix.
    """
    path = resolve_exemplar_file(spec)
    fix = ("Fix: sampler.params.exemplar_file=PATH to a jsonl file, one {\"question\": ..., \"solution\": ...} a line "
           "(write one from a task's verified answers with: python scripts/make_exemplars.py --out PATH task=NAME)")
    packaged = ", ".join(sorted(p.stem for p in EXEMPLAR_DIR.glob("*.jsonl"))) or "none"
    if not path.is_file():
        raise ConfigError(f"sampler=xrpo_icl: exemplar file {path} (sampler.params.exemplar_file={spec!r}) does not "
                          f"exist. Packaged names: {packaged}. {fix}")
    rows: List[Dict[str, str]] = []
    for n, rec in iter_jsonl(path, ConfigError, "sampler=xrpo_icl: exemplar file", fix):
        if not all(isinstance(rec.get(k), str) and rec[k].strip() for k in ("question", "solution")):
            raise ConfigError(f"sampler=xrpo_icl: exemplar file {path}:{n} needs non-empty string fields "
                              f"'question' and 'solution', got {json.dumps(rec)[:80]!r}. {fix}")
        rows.append({k: str(v) for k, v in rec.items() if k in ("question", "solution", "task")})
    if not rows:
        raise ConfigError(f"sampler=xrpo_icl: exemplar file {path} holds no exemplar. {fix}")
    return path, rows


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", str(text).strip().lower())


def trigrams(text: str) -> Counter:
    """Character-trigram counts of ``text`` lower-cased with runs of whitespace as one space (a shorter text: itself)."""
    s = _norm(text)
    if len(s) < 3:
        return Counter([s]) if s else Counter()
    return Counter(s[i:i + 3] for i in range(len(s) - 2))


def similarity(a: Counter, b: Counter) -> float:
    """Cosine of two trigram count vectors (0 when either is empty)."""
    if not a or not b:
        return 0.0
    dot = sum(v * b[k] for k, v in a.items() if k in b)
    return dot / math.sqrt(sum(v * v for v in a.values()) * sum(v * v for v in b.values()))


def retrieve(question: str, bank: Sequence[Dict[str, str]], k: int, grams: Optional[Sequence[Counter]] = None
             ) -> List[int]:
    """Indices of the ``k`` exemplars of ``bank`` whose questions are most similar to ``question``.

    Descending similarity, ties to the earlier exemplar; an exemplar whose
    (normalised) question equals ``question`` is never taken. Returned in
    prompt order: the most similar one *last*, next to the problem.
    """
    q, own = trigrams(question), _norm(question)
    g = grams if grams is not None else [trigrams(e["question"]) for e in bank]
    scored = [(-similarity(q, g[j]), j) for j, e in enumerate(bank) if _norm(e["question"]) != own]
    best = [j for _, j in sorted(scored)[: max(0, int(k))]]
    return best[::-1]


def seeded_question(question: str, exemplars: Sequence[Dict[str, str]], max_chars: int) -> str:
    """The question with ``exemplars`` in front (XRPO's ICL template, our wording).

    ``HEADER``, then per exemplar ``"Problem: {q}\\nSolution: {s}\\n\\n"`` (``s``
    cut to ``max_chars`` characters), then ``FOOTER`` and the question.
    """
    parts = [HEADER]
    for e in exemplars:
        parts.append(f"Problem: {e['question'].strip()}\nSolution: {e['solution'].strip()[: int(max_chars)]}\n\n")
    return "".join(parts) + FOOTER + question


def probe_count(c: int, fraction: float) -> int:
    """Probe rollouts of a prompt with ``c`` rollouts: ``round(c * fraction)`` within ``[1, c - 1]`` (``c`` when ``c < 2``)."""
    if c < 2:
        return c
    return min(c - 1, max(1, int(round(c * fraction))))


@SAMPLERS.register("xrpo_icl", paper=PAPER, params=XRPOICLParams,
                   description="Probe rollouts first; prompts whose probes all failed get K retrieved solved exemplars.")
class XRPOICLSampler(Sampler):
    """XRPO's in-context seeding (module docstring).

    One step, per prompt with ``c`` rollouts (``n_samples`` or the selector's
    allocation): ``probe_count(c, probe_fraction)`` probe rollouts (engine call
    0), scored; a prompt whose probes' solve rate (share of rewards
    ``>= solved_at``) is at most ``max_solve_rate`` is *seeded*: its question
    gets the ``num_exemplars`` most similar exemplars of the corpus
    (:func:`retrieve`), written as few-shot chat turns or into its user turn
    (``template``) with the task's system prompt and chat template; its
    remaining ``c - probes`` rollouts
    are drawn from that prompt, the other prompts' from their own (engine call
    1), and scored against the original example. A seeded prompt without a
    usable exemplar stays zero-shot. Every row keeps its prompt's group.

    Extras: ``icl_seeded`` ``[B]`` (1.0 on seeded rows). Metrics:
    ``sampler/icl_prompts_seeded``, ``icl_rows_seeded``, ``icl_prompts_revived``
    (seeded prompts with a solved seeded rollout), ``icl_seeded_solved_rate``,
    ``icl_no_exemplar``, ``icl_corpus_grown``, ``icl_corpus_size_mean``.

    Raises:
        ValueError: (construction) ``num_exemplars < 1``, ``probe_fraction``
            outside (0, 1), ``max_solve_rate`` outside [0, 1), ``max_corpus < 0``
            or ``max_solution_chars < 1``; the build names ``sampler.params``.
        ConfigError: (construction) a missing or malformed exemplar file;
            (:meth:`attach`) a file whose exemplars declare another task.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, exemplar_file: str, num_exemplars: int, probe_fraction: float,
                 solved_at: float, max_solve_rate: float, grow_corpus: bool, max_corpus: int,
                 max_solution_chars: int, template: str, train_on: str) -> None:
        super().__init__(n_samples)
        if int(num_exemplars) < 1:
            raise ValueError(f"num_exemplars={num_exemplars} must be >= 1")
        if not 0.0 < float(probe_fraction) < 1.0:
            raise ValueError(f"probe_fraction={probe_fraction} must be in (0, 1) (the rest are drawn after the check)")
        if not 0.0 <= float(max_solve_rate) < 1.0:
            raise ValueError(f"max_solve_rate={max_solve_rate} must be in [0, 1)")
        if int(max_corpus) < 0 or int(max_solution_chars) < 1:
            raise ValueError(f"max_corpus={max_corpus} must be >= 0 and max_solution_chars={max_solution_chars} >= 1")
        if str(template) not in ("chat_turns", "user_turn"):
            raise ValueError(f"template={template!r} must be chat_turns or user_turn")
        if str(train_on) not in ("seeded", "original"):
            raise ValueError(f"train_on={train_on!r} must be seeded or original")
        self.path, self.file_exemplars = load_exemplars(exemplar_file)
        self.num_exemplars, self.probe_fraction = int(num_exemplars), float(probe_fraction)
        self.solved_at, self.max_solve_rate = float(solved_at), float(max_solve_rate)
        self.grow, self.max_corpus, self.max_chars = bool(grow_corpus), int(max_corpus), int(max_solution_chars)
        self.train_on, self.template = str(train_on), str(template)
        self.grown: List[Dict[str, str]] = []
        self._grams: List[Counter] = [trigrams(e["question"]) for e in self.file_exemplars]
        self._grown_grams: List[Counter] = []
        self.task: Any = None
        self.examples: Optional[List[Any]] = None

    # ------------------------------------------------------------ wiring
    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """The run's task (renders a seeded prompt) and training examples (their questions).

        Raises:
            ConfigError: every exemplar of the file declares a ``task`` and none is the run's task.
        """
        self.task, self.examples = task, examples
        name = getattr(getattr(task, "cfg", None), "name", None) or getattr(task, "name", None)
        declared = {e.get("task") for e in self.file_exemplars}
        if name and None not in declared and str(name) not in declared:
            raise ConfigError(
                f"sampler=xrpo_icl: exemplar file {self.path} holds exemplars of task {sorted(declared)}, but the run's "
                f"task is {name!r}. Fix: sampler.params.exemplar_file=PATH with exemplars of {name!r} (write one with: "
                f"python scripts/make_exemplars.py --out PATH task={name})")

    @property
    def corpus(self) -> List[Dict[str, str]]:
        """The exemplar bank: the file's exemplars, then the grown ones (oldest first)."""
        return self.file_exemplars + self.grown

    def add_solved(self, question: str, solution: str) -> bool:
        """Add a verified solution to the grown corpus (once per question; oldest dropped past ``max_corpus``)."""
        if not self.grow or self.max_corpus == 0 or not solution.strip():
            return False
        own = _norm(question)
        if any(_norm(e["question"]) == own for e in self.corpus):
            return False
        self.grown.append({"question": question, "solution": solution})
        self._grown_grams.append(trigrams(question))
        if len(self.grown) > self.max_corpus:
            self.grown.pop(0)
            self._grown_grams.pop(0)
        return True

    def _question(self, engine: Any, prompt: List[int], pos: int, ctx: Any) -> Tuple[str, Any]:
        """``(question text, example or None)`` of prompt position ``pos`` (the decoded prompt without examples)."""
        if self.examples is not None and ctx.prompt_indices is not None:
            ex = self.examples[int(ctx.prompt_indices[pos])]
            return str(ex.question), ex
        return engine.tokenizer.decode(prompt, skip_special_tokens=True), None

    def seeded_prompt(self, engine: Any, prompt: List[int], question: str, example: Any,
                      exemplars: Sequence[Dict[str, str]]) -> List[int]:
        """Token ids of the seeded prompt: the task renders the example with :func:`seeded_question` as its
        question, and ids the driver put after the plain rendering (a hint of ``selector=seele`` / ``pope``)
        follow it; without a task, the exemplar block's ids go in front of the prompt's ids."""
        text = seeded_question(question, exemplars, self.max_chars)
        if self.task is not None and example is not None:
            ids = self._chat_turns(engine.tokenizer, example, exemplars) if self.template == "chat_turns" else None
            if ids is None:
                ids = list(self.task.render_prompt(dataclasses.replace(example, question=text), engine.tokenizer))
            plain = list(self.task.render_prompt(example, engine.tokenizer))
            # ids the driver appended after the rendered prompt (a hinting selector's hint) stay at its end
            tail = list(prompt)[len(plain):] if list(prompt)[: len(plain)] == plain else []
            return ids + tail
        block = text[: len(text) - len(question)]
        return list(engine.tokenizer.encode(block, add_special_tokens=False)) + list(prompt)

    def _chat_turns(self, tokenizer: Any, example: Any, exemplars: Sequence[Dict[str, str]]) -> Optional[List[int]]:
        """``template=chat_turns``: the task's system prompt, then per exemplar a user turn (the task's user
        message of its question) and an assistant turn (its solution, cut to ``max_solution_chars``), then the
        problem's user turn, through the chat template; None when the tokenizer has no chat template or the
        task no ``user_message`` (the caller then uses ``user_turn``)."""
        task = self.task
        if not getattr(tokenizer, "chat_template", None) or not hasattr(task, "user_message"):
            return None
        system = getattr(getattr(task, "cfg", None), "system_prompt", None)
        msgs = [{"role": "system", "content": system}] if system else []
        for e in exemplars:
            shown = dataclasses.replace(example, index=-1, question=e["question"].strip())
            msgs += [{"role": "user", "content": task.user_message(shown)},
                     {"role": "assistant", "content": e["solution"].strip()[: self.max_chars]}]
        msgs.append({"role": "user", "content": task.user_message(example)})
        return list(encode_framed(tokenizer, *template_parts(tokenizer, msgs, True)))

    # ------------------------------------------------------------ sampling
    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        counts = self.counts(len(prompts), ctx)
        probes = [probe_count(c, self.probe_fraction) for c in counts]
        pos1 = [i for i, n in enumerate(probes) if n > 0]
        res1 = generate_groups(engine, [prompts[i] for i in pos1], [probes[i] for i in pos1],
                               step_params(params, ctx, 0), positions=pos1)
        score_rows(ctx, res1)
        solved = (res1.rewards >= self.solved_at).double()
        gi1 = res1.group_index
        n_p = torch.zeros(len(prompts), dtype=torch.float64).index_add_(0, gi1, torch.ones_like(solved))
        n_s = torch.zeros(len(prompts), dtype=torch.float64).index_add_(0, gi1, solved)

        questions: Dict[int, Tuple[str, Any]] = {}
        grown = 0
        if self.grow:
            for r in range(len(gi1)):
                i = int(gi1[r])
                if solved[r] > 0:
                    q = questions.setdefault(i, self._question(engine, prompts[i], i, ctx))[0]
                    grown += int(self.add_solved(q, res1.generation.texts[r]))

        bank = self.corpus
        grams = self._grams + self._grown_grams
        rest = [c - n for c, n in zip(counts, probes)]
        round2, pos2, cnt2, seeded_pos = [], [], [], set()
        no_exemplar = 0
        for i, c in enumerate(rest):
            if c <= 0:
                continue
            p = prompts[i]
            if n_p[i] > 0 and float(n_s[i] / n_p[i]) <= self.max_solve_rate:
                q, ex = questions.setdefault(i, self._question(engine, prompts[i], i, ctx))
                pick = retrieve(q, bank, self.num_exemplars, grams)
                if pick:
                    p = self.seeded_prompt(engine, prompts[i], q, ex, [bank[j] for j in pick])
                    seeded_pos.add(i)
                else:
                    no_exemplar += 1
            round2.append(p)
            pos2.append(i)
            cnt2.append(c)
        parts = [res1]
        res1.extras["icl_seeded"] = torch.zeros(len(gi1))
        seeded_rows = torch.zeros(0, dtype=torch.bool)
        if round2:
            res2 = generate_groups(engine, round2, cnt2, step_params(params, ctx, 1), positions=pos2)
            score_rows(ctx, res2)
            seeded_rows = torch.tensor([int(g) in seeded_pos for g in res2.group_index.tolist()], dtype=torch.bool)
            res2.extras["icl_seeded"] = seeded_rows.float()
            if self.train_on == "original" and bool(seeded_rows.any()):
                self._restore_prompts(res2, prompts, pad_id_of(engine))
            parts.append(res2)
        out = merge_results(parts, pad_id_of(engine)) if len(parts) > 1 else res1
        s_rew = parts[-1].rewards[seeded_rows] if len(parts) > 1 and bool(seeded_rows.any()) else torch.zeros(0)
        revived = {int(g) for g, r in zip(parts[-1].group_index[seeded_rows].tolist(), s_rew.tolist())
                   if r >= self.solved_at} if len(s_rew) else set()
        out.metrics = {
            "sampler/icl_prompts_seeded": float(len(seeded_pos)),
            "sampler/icl_rows_seeded": float(len(s_rew)),
            "sampler/icl_prompts_revived": float(len(revived)),
            "sampler/icl_seeded_solved_rate": float((s_rew >= self.solved_at).double().mean()) if len(s_rew) else 0.0,
            "sampler/icl_no_exemplar": float(no_exemplar),
            "sampler/icl_corpus_grown": float(grown),
            "sampler/icl_corpus_size_mean": float(len(self.corpus)),
        }
        return out

    @staticmethod
    def _restore_prompts(res: SampleResult, prompts: Sequence[List[int]], pad_id: int) -> None:
        """``train_on=original``: every row of ``res`` gets its prompt position's original prompt ids (left-padded)."""
        rows = [list(prompts[int(g)]) for g in res.group_index.tolist()]
        ids, mask = left_pad(rows, pad_id)
        res.generation.prompt_ids, res.generation.prompt_mask = ids.long(), mask.to(res.generation.prompt_mask.dtype)

    # ------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The grown corpus (the file's exemplars are read again from the file)."""
        return {"grown": [dict(e) for e in self.grown]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102 - see state_dict
        self.grown = [{"question": str(e["question"]), "solution": str(e["solution"])} for e in state.get("grown", [])]
        self._grown_grams = [trigrams(e["question"]) for e in self.grown]
