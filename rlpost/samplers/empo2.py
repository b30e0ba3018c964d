"""``sampler=empo2``: EMPO²'s memory of self-written tips and its on-/off-policy rollout modes, on episodes.

"Exploratory Memory-Augmented LLM Agent via Hybrid On- and Off-Policy Optimization" (EMPO²,
arXiv:2602.23008); authors' code: github.com/microsoft/agent-lightning, branch ``archive/agl``,
``contrib/agentlightning/contrib/agent/empo2_agent.py`` (rollout, tips, memory calls),
``contrib/recipes/envs/empo2_server/server_mem.py`` (the memory), ``.../algorithm/env_verl/trainer.py``
(the mode draw, the off-policy old log-probs) and ``core_empo2.py`` (low-probability masking). Where the
paper's text and that code could differ, the code is followed (only the abstract and summaries of the
paper's text were readable here).

Followed from the authors' code:

* **Modes.** Each training step draws one mode for the whole batch: ``off_policy`` with probability
  0.17 (episodes sampled *with* memory, trained on the prompt *without* it), ``on_policy_memory`` with
  0.08 (sampled and trained with memory), else ``on_policy`` (no memory). So a quarter of the steps
  explore with memory and about two thirds of those are distilled into the memory-free policy.
* **Memory.** One slot per task instance (here: the training example's index). An entry is
  ``(key, content, score)``; the same content is stored once per slot; past 1000 entries the oldest
  goes. Retrieval keeps the entries whose key has cosine similarity ``> 0.5`` with the query and
  returns the 10 with the highest score (:class:`TipMemory`).
* **Tips.** After every training episode (all three modes) the policy is asked, in the episode's own
  context, to sum the trajectory up in one sentence; for each model turn the memory gets that tip plus
  the turn's action and the episode's score, keyed by the episode's final conversation, scored by the
  episode reward. Held-out evaluation uses no memory and writes none.
* **Intrinsic reward** ``1 / (count + 1)`` per memory-mode episode, ``count`` the entries retrieved.
  The authors' GRPO path reads the extrinsic scores only, so it never reaches their advantage: the
  weight here defaults to 0 (``intrinsic_weight``).
* The off-policy ratio and the masking live in :mod:`rlpost.methods.empo2`.

Our reading (each a parameter or a stated departure):

* **Retrieval once per episode**, from the conversation at its start, and the notes go into the
  first user turn (after the question and any initial observation). The authors retrieve at every
  turn from the conversation so far and append each turn's notes to that turn's user message; here
  later turns are environment text inside the response, and moving notes there would change the
  trained row's tokens between the two contexts.
* **Keys are character-trigram count vectors** (:func:`rlpost.samplers.xrpo_icl.trigrams`, cosine
  similarity) instead of the authors' MiniLM sentence embeddings (no embedding model ships here).
* The wording of the tip instruction, of the notes header and of an entry is ours.
* ``mode_unit=prompt`` (not the default) draws the mode per prompt instead of per step.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.batch import left_pad as left_pad_rows
from rlpost.core.registry import Choice, param
from rlpost.samplers.base import SAMPLERS, pad_id_of, score_rows, step_params
from rlpost.samplers.episode import EpisodeSampler, EpisodeSamplerParams, _Episode, render_insert
from rlpost.samplers.xrpo_icl import similarity, trigrams

PAPER = "Exploratory Memory-Augmented LLM Agent via Hybrid On- and Off-Policy Optimization (EMPO², arXiv:2602.23008)"

#: row modes (``extras['empo2_mode']``)
ON_POLICY, ON_POLICY_MEMORY, OFF_POLICY = 0, 1, 2
MODE_NAMES = ("on_policy", "on_policy_memory", "off_policy")

#: asked after an episode, in its context (our wording of the authors' tip request)
TIP_INSTRUCTION = ("The episode is over. In one line and at most 100 words, sum up what you tried, what you found out "
                   "about the task, and how far you got from solving it.")
NOTES_HEADER = "Notes from your earlier attempts at this task:\n"


class ModeUnit(Choice):
    """``sampler.params.mode_unit``: what one mode draw covers."""

    step = "step"
    prompt = "prompt"


@dataclass(frozen=True)
class EMPO2Params(EpisodeSamplerParams):
    """EMPO²'s memory and rollout modes (authors' code unless the line says ours), plus the episode parameters."""

    off_policy_prob: float = param(0.17, "probability of an off-policy draw: sampled with memory, trained without "
                                   "(authors' trainer: 0.17)")
    memory_on_policy_prob: float = param(0.08, "probability of an on-policy-with-memory draw (authors' trainer: 0.08, "
                                         "their die's 0.17 to 0.25); the rest is on-policy without memory")
    mode_unit: ModeUnit = param(ModeUnit.step, "step: one mode for the whole step (authors' code); prompt: one per "
                                "prompt group (ours)")
    top_k: int = param(10, "notes retrieved at most, highest score first (authors' memory server: 10)")
    similarity_threshold: float = param(0.5, "an entry is retrieved when the cosine of its key and the query is above "
                                        "this (authors: 0.5, on MiniLM embeddings; here trigram counts)")
    memory_capacity: int = param(1000, "entries kept per task instance, oldest dropped (authors: 1000)")
    tip_max_tokens: int = param(512, "token limit of a tip generation (authors' client: 512)")
    intrinsic_weight: float = param(0.0, "weight of the novelty reward 1 / (retrieved + 1) on memory-mode rows (authors' "
                                    "GRPO path: 0, it never reaches their advantage; the paper's text adds it, weight not read here)")
    low_prob_threshold: Optional[float] = param(-5.0, "rows whose smallest old log-prob over the loss mask is below "
                                                "this get no loss (authors' code: -5.0, on by default; their "
                                                "ScienceWorld script turns it off); null: off")


class TipMemory:
    """EMPO²'s non-parametric memory: per slot (task instance) a list of ``{key, content, score}`` entries.

    ``key`` is stored as text; similarity is the cosine of character-trigram count vectors
    (:func:`rlpost.samplers.xrpo_icl.trigrams`), cached.

    Args:
        capacity: entries kept per slot; the oldest is dropped past it (authors: 1000).
        threshold: retrieval keeps entries whose similarity is ``> threshold`` (authors: 0.5).
        top_k: at most this many contents are returned, highest score first (authors: 10).
    Raises:
        ValueError: ``capacity < 1``, ``top_k < 1`` or ``threshold`` outside ``[-1, 1]``.
    """

    def __init__(self, capacity: int = 1000, threshold: float = 0.5, top_k: int = 10) -> None:
        if int(capacity) < 1 or int(top_k) < 1 or not -1.0 <= float(threshold) <= 1.0:
            raise ValueError(f"memory_capacity={capacity} and top_k={top_k} must be >= 1 and similarity_threshold="
                             f"{threshold} in [-1, 1]")
        self.capacity, self.threshold, self.top_k = int(capacity), float(threshold), int(top_k)
        self.slots: Dict[int, List[Dict[str, Any]]] = {}
        self._grams: Dict[str, Counter] = {}

    def _g(self, text: str) -> Counter:
        g = self._grams.get(text)
        if g is None:
            g = self._grams[text] = trigrams(text)
        return g

    def add(self, slot: int, key: str, content: str, score: float) -> bool:
        """Store ``content`` under ``key`` in ``slot`` (False when that slot already holds the same content)."""
        entries = self.slots.setdefault(int(slot), [])
        if any(e["content"] == content for e in entries):
            return False
        entries.append({"key": str(key), "content": str(content), "score": float(score)})
        if len(entries) > self.capacity:
            del entries[: len(entries) - self.capacity]
        return True

    def retrieve(self, slot: int, query: str) -> List[str]:
        """Contents of ``slot`` whose key's similarity with ``query`` is ``> threshold``: the ``top_k`` highest
        scores, ties in storage order (oldest first)."""
        q = self._g(query)
        hits = [e for e in self.slots.get(int(slot), []) if similarity(q, self._g(e["key"])) > self.threshold]
        hits.sort(key=lambda e: -e["score"])  # stable
        return [e["content"] for e in hits[: self.top_k]]

    def size(self) -> int:
        """Entries over all slots."""
        return sum(len(v) for v in self.slots.values())

    def state_dict(self) -> Dict[str, Any]:
        """Plain values: ``{"slots": {slot: [entries]}}``."""
        return {"slots": {int(k): [dict(e) for e in v] for k, v in self.slots.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102 - see state_dict
        self.slots = {int(k): [{"key": str(e["key"]), "content": str(e["content"]), "score": float(e["score"])}
                               for e in v] for k, v in (state.get("slots") or {}).items()}
        self._grams = {}


def draw_mode(u: float, off_policy_prob: float, memory_on_policy_prob: float) -> int:
    """The mode of a uniform draw ``u`` in [0, 1): ``OFF_POLICY`` below ``off_policy_prob``, then
    ``ON_POLICY_MEMORY`` below ``off_policy_prob + memory_on_policy_prob``, else ``ON_POLICY`` (authors' trainer)."""
    if u < off_policy_prob:
        return OFF_POLICY
    if u < off_policy_prob + memory_on_policy_prob:
        return ON_POLICY_MEMORY
    return ON_POLICY


def notes_text(notes: Sequence[str]) -> str:
    """The block appended to the user turn: ``NOTES_HEADER`` then one note a line (empty without notes)."""
    return NOTES_HEADER + "".join(f"{n}\n" for n in notes) if notes else ""


def entry_content(tip: str, action: str, turn: int, score: float) -> str:
    """One memory entry: the episode's tip, the action of model turn ``turn`` (1-based) and the episode's score."""
    return f"{tip.strip()} (turn {turn}, your action: {action.strip()}; the episode scored {score:.1f})"


def _tip_line(text: str, limit: int = 600) -> str:
    """The first non-empty line of a tip generation, cut to ``limit`` characters (the request asks for one line)."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


@SAMPLERS.register("empo2", paper=PAPER, params=EMPO2Params, episodes=True,
                   description="Episodes with a memory of self-written tips; per step on-policy, on-policy with "
                               "memory, or off-policy (sampled with memory, trained without).")
class EMPO2Sampler(EpisodeSampler):
    """EMPO²'s rollouts (module docstring) on :class:`EpisodeSampler`'s episodes.

    One training step: draw the mode(s) (:func:`draw_mode`, seeded by the run seed and the step);
    in a memory mode retrieve each prompt's notes (:meth:`TipMemory.retrieve`, query: the user turn
    text) and put them after its question; run the episodes; score them; ask the policy for a tip per
    episode (one engine call, ``tip_max_tokens``; in the context the episode saw) and store one entry
    per model turn; in the off-policy mode give each row its memory-free prompt back (its response,
    loss mask and rollout log-probs stay as sampled, so ``rollout_logprobs`` still refer to the memory
    context; :mod:`rlpost.methods.empo2` turns them into the off-policy ratio's denominator).

    Extras ``[B]``: ``empo2_mode`` (0 on-policy, 1 on-policy with memory, 2 off-policy),
    ``empo2_offpolicy`` (1.0 on off-policy rows), ``empo2_notes`` (notes in the row's sampling
    context), ``reward_intrinsic`` (with ``intrinsic_weight``). Metrics ``empo2/...``.

    Args:
        n_samples: episodes per prompt.
        off_policy_prob, memory_on_policy_prob, mode_unit, top_k, similarity_threshold,
        memory_capacity, tip_max_tokens, intrinsic_weight, low_prob_threshold: :class:`EMPO2Params`;
        the rest as :class:`EpisodeSampler`.
    Raises:
        ValueError (a ConfigError through ``build_sampler``): probabilities outside [0, 1] or summing
        above 1, ``tip_max_tokens < 1``, ``intrinsic_weight < 0``, a bad memory setting, ``branching``
        set, or ``low_prob_threshold > 0``.
    """

    def __init__(self, n_samples: int = 1, *, off_policy_prob: float, memory_on_policy_prob: float, mode_unit: Any,
                 top_k: int, similarity_threshold: float, memory_capacity: int, tip_max_tokens: int,
                 intrinsic_weight: float, low_prob_threshold: Optional[float], **episode: Any) -> None:
        super().__init__(n_samples, **episode)
        p_off, p_mem = float(off_policy_prob), float(memory_on_policy_prob)
        if not (0.0 <= p_off <= 1.0 and 0.0 <= p_mem <= 1.0 and p_off + p_mem <= 1.0 + 1e-12):
            raise ValueError(f"off_policy_prob={p_off} and memory_on_policy_prob={p_mem} must be in [0, 1] with a sum "
                             f"<= 1. Fix: e.g. the authors' 0.17 and 0.08.")
        if self.branching != "none":
            raise ValueError(f"sampler=empo2 does not branch episodes (branching={self.branching}). "
                             f"Fix: sampler.params.branching=none.")
        if int(tip_max_tokens) < 1 or float(intrinsic_weight) < 0:
            raise ValueError(f"tip_max_tokens={tip_max_tokens} must be >= 1 and intrinsic_weight={intrinsic_weight} >= 0")
        if low_prob_threshold is not None and float(low_prob_threshold) > 0:
            raise ValueError(f"low_prob_threshold={low_prob_threshold} is a log-prob (<= 0), or null for no masking. "
                             f"Fix: sampler.params.low_prob_threshold=-5.0")
        self.mode_unit = str(getattr(mode_unit, "value", mode_unit))
        if self.mode_unit not in ("step", "prompt"):
            raise ValueError(f"mode_unit={self.mode_unit!r}: valid choices are step, prompt")
        self.p_off, self.p_mem = p_off, p_mem
        self.memory = TipMemory(memory_capacity, similarity_threshold, top_k)
        self.tip_max_tokens, self.intrinsic_weight = int(tip_max_tokens), float(intrinsic_weight)
        self.low_prob_threshold = None if low_prob_threshold is None else float(low_prob_threshold)
        self._train_examples: Optional[List[Any]] = None
        self._plan: Dict[int, Tuple[int, List[str]]] = {}  # prompt position -> (mode, notes) of this step
        self._last_eps: List[_Episode] = []

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """:meth:`EpisodeSampler.attach`; ``examples`` are remembered as the training examples (held-out
        evaluation swaps ``self.examples`` and then runs without memory)."""
        super().attach(task, examples, run_dir)
        self._train_examples = examples

    # ------------------------------------------------------------ modes and notes
    def modes(self, n_prompts: int, ctx: Any) -> List[int]:
        """The mode of each prompt position this step (one draw for all with ``mode_unit=step``)."""
        # a string seed is hashed by SHA-512 (the same in every process; hash() of a str is not)
        rng = random.Random(f"empo2:{int(getattr(ctx, 'seed', 0) or 0)}:{int(getattr(ctx, 'step', 0) or 0)}")
        if self.mode_unit == "step":
            return [draw_mode(rng.random(), self.p_off, self.p_mem)] * n_prompts
        return [draw_mode(rng.random(), self.p_off, self.p_mem) for _ in range(n_prompts)]

    def _slot(self, ctx: Any, pos: int) -> int:
        return int(ctx.prompt_indices[pos]) if ctx.prompt_indices is not None else -1 - pos

    def _user_text(self, example: Any, obs: str, prompt: Sequence[int], tok: Any) -> str:
        """The user turn's text: the question and any initial observation (the decoded prompt without examples)."""
        if self.examples is None or not getattr(example, "question", ""):
            return tok.decode(list(prompt), skip_special_tokens=True) if tok is not None else ""
        return f"{example.question}\n\n{obs}".strip() if obs else str(example.question)

    def _query(self, ctx: Any, pos: int, prompt: Sequence[int], tok: Any) -> str:
        """The retrieval query at an episode's start: ``"user: <question>"`` (the authors' conversation format)."""
        return f"user: {self._user_text(self._example(ctx, pos), '', prompt, tok)}"

    def _new_episode(self, ctx: Any, pos: int, prompt: List[int], tok: Any) -> _Episode:
        """:meth:`EpisodeSampler._new_episode`, then the notes of this step's plan put after the question."""
        e = super()._new_episode(ctx, pos, prompt, tok)
        e.plain_prompt = list(e.prompt)
        mode, notes = self._plan.get(pos, (ON_POLICY, []))
        e.empo2_mode, e.empo2_notes = mode, len(notes)
        if notes:
            e.prompt = self.memory_prompt(tok, e.plain_prompt, self._example(ctx, pos), e.initial_obs, notes)
        return e

    def memory_prompt(self, tok: Any, plain: List[int], example: Any, obs: str, notes: Sequence[str]) -> List[int]:
        """Token ids of the prompt with ``notes`` after the question (and observation) in the user turn.

        With a task and examples, the task renders the example with that text as its question; ids the
        driver put after the plain rendering (a hint) stay at the end. Without them, the notes block's ids
        go in front of the prompt's ids.
        """
        block = notes_text(notes)
        if self.task is not None and self.examples is not None and getattr(example, "question", ""):
            text = self._user_text(example, obs, plain, tok) + "\n\n" + block.rstrip("\n")
            ids = list(self.task.render_prompt(dataclasses.replace(example, question=text), tok))
            if not obs:
                base = list(self.task.render_prompt(example, tok))
                ids += list(plain)[len(base):] if list(plain)[: len(base)] == base else []
            return ids
        return list(tok.encode(block, add_special_tokens=False)) + list(plain)

    # ------------------------------------------------------------ sampling
    def _assemble(self, eps, gi, engine, prompts, left_pad):  # noqa: D102 - keeps the episodes for sample()
        self._last_eps = list(eps)
        return super()._assemble(eps, gi, engine, prompts, left_pad)

    def sample(self, engine, prompts, params, ctx):
        """One step of EMPO²'s rollouts (class docstring); held-out evaluation runs plain episodes."""
        training = self.examples is self._train_examples
        tok = getattr(engine, "tokenizer", None)
        self._plan = {}
        if training:
            for pos, mode in enumerate(self.modes(len(prompts), ctx)):
                notes: List[str] = []
                if mode != ON_POLICY:
                    notes = self.memory.retrieve(self._slot(ctx, pos), self._query(ctx, pos, prompts[pos], tok))
                self._plan[pos] = (mode, notes)
        try:
            res = super().sample(engine, prompts, params, ctx)
        finally:
            self._plan = {}
        if not training:
            return res
        eps = self._last_eps
        if res.rewards is None:
            score_rows(ctx, res)
        rewards = res.rewards.clone()
        modes = torch.tensor([float(getattr(e, "empo2_mode", ON_POLICY)) for e in eps])
        counts = torch.tensor([float(getattr(e, "empo2_notes", 0)) for e in eps])
        written = self._write_memory(engine, eps, rewards, params, ctx, tok)
        off = modes == OFF_POLICY
        if bool(off.any()):  # trained without the memory: the memory-free prompts back
            rows = [e.plain_prompt if o else e.prompt for e, o in zip(eps, off.tolist())]
            ids, mask = left_pad_rows(rows, pad_id_of(engine))
            res.generation.prompt_ids = ids.long()
            res.generation.prompt_mask = mask.to(res.generation.prompt_mask.dtype)
        if self.intrinsic_weight:
            r_int = torch.where(modes != ON_POLICY, self.intrinsic_weight / (counts + 1.0), torch.zeros_like(counts))
            res.rewards = res.rewards + r_int
            res.extras["reward_intrinsic"] = r_int
        res.extras["empo2_mode"] = modes
        res.extras["empo2_offpolicy"] = off.float()
        res.extras["empo2_notes"] = counts
        res.metrics.update({
            "empo2/offpolicy_frac": float(off.float().mean()),
            "empo2/memory_frac": float((modes != ON_POLICY).float().mean()),
            "empo2/notes_mean": float(counts.mean()),
            "empo2/memory_entries": float(self.memory.size()),
            "empo2/entries_written": float(written),
        })
        return res

    def _write_memory(self, engine: Any, eps: List[_Episode], rewards: torch.Tensor, params: Any, ctx: Any,
                      tok: Any) -> int:
        """Ask for one tip per episode in its own context (one engine call) and store an entry per model turn."""
        eos_ids = set(getattr(engine, "eos_ids", None) or [tok.eos_token_id])
        ask = [{"role": "user", "content": TIP_INSTRUCTION}]
        rows = [e.prompt + e.ids + render_insert(tok, ask, after_eos=bool(e.ids) and int(e.ids[-1]) in eos_ids)
                for e in eps]
        sp = dataclasses.replace(step_params(params, ctx, 10_007), max_new_tokens=self.tip_max_tokens, stop=[])
        gen = engine.generate(rows, sp)
        written = 0
        for j, e in enumerate(eps):
            tip = _tip_line(gen.texts[j])
            score = round(float(rewards[j]), 1)
            user = self._user_text(self._example(ctx, e.pos), e.initial_obs, e.plain_prompt, tok)
            key = " ".join([f"user: {user}"] + [f"{m['role']}: {m['content']}" for m in e.transcript])
            actions = [m["content"] for m in e.transcript if m["role"] == "assistant"]
            for t, a in enumerate(actions, 1):
                written += int(self.memory.add(self._slot(ctx, e.pos), key, entry_content(tip, a, t, score), score))
        return written

    # ------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The memory (:meth:`TipMemory.state_dict`)."""
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102 - see state_dict
        self.memory.load_state_dict(state.get("memory") or {})
