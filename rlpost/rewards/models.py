"""Rewards from models: the registry of model-based reward kinds and the reward-model verifier.

A run names model rewards in ``task.reward.models``, one entry per reward::

    task.reward.models.rm = {kind: rm, weight: 1.0, model_path: DIR, normalize: batch}

``kind`` picks a registered kind (:data:`REWARD_MODELS`: ``rm``, ``judge``,
``local_judge``, ``prm``, ``prs``), ``weight`` multiplies its score in the total
reward, and every other key is a parameter the kind declares once (a frozen
dataclass with defaults and one doc line per field); a misspelt key is a
:class:`rlpost.core.errors.ConfigError` naming the valid ones. The presets in
``conf/reward_model/`` fill these in: ``+reward_model=rm task.reward.models.rm.model_path=DIR``.

Each entry's weighted score is one reward component (``reward_<name>`` per row,
``reward/<name>_mean`` per step), summed with the rule components by
:class:`rlpost.rewards.scoring.RewardFunction`; ``task.reward.correct_weight``
weighs the rule verifier's correctness (0 turns it off, e.g. for a judge-only run).

Text, not token ids, crosses from the policy to a reward model: every model
re-renders the prompt and response with *its own* tokenizer and chat template
(:func:`render_chat`). A reward model whose tokenizer differs from the
policy's therefore needs nothing special, and one with the same tokenizer
sees exactly what a user would send it. The cost is one extra tokenization
per row (negligible next to the forward pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.errors import ConfigError
from rlpost.core.registry import Choice, Registry, param

#: model-based reward kinds (``task.reward.models.<name>.kind``)
#: the rule reward's components (rlpost.rewards.scoring), which a model reward's name may not take
REWARD_COMPONENTS = ("correct", "format", "overlong", "length")

REWARD_MODELS = Registry("model reward kind", "task.reward.models.<name>.kind", typed_params=True,
                         catalog="rlpost.rewards.kinds")  # the files of the other kinds, loaded on first lookup

#: keys of a ``task.reward.models`` entry that are not the kind's parameters
ENTRY_KEYS = ("kind", "weight")


@dataclass
class ModelScore:
    """What one model reward returns for a batch.

    Attributes:
        values: ``[B]`` float32 scores (before the entry's weight; 0 for a failed row).
        errors: rows whose scoring failed (a dead endpoint, an unparsable reply):
            counted like verifier errors.
        metrics: ``reward/<name>_...`` extras of this call (sums for counts).
        token_rewards: per row, ``(response token index, reward)`` pairs (process
            rewards placed on each step's last token), or None.
        raw: ``[B]`` float32 scores before normalisation (what a staged reward reads).
    """

    values: torch.Tensor
    errors: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)
    token_rewards: Optional[List[List[Tuple[int, float]]]] = None
    raw: Optional[torch.Tensor] = None


class ModelReward:
    """Base class of model rewards: built from config, checked at start, attached, then scoring.

    Lifecycle: ``__init__`` (parameters only) -> :meth:`check` (cheap start-time
    checks, before the policy loads: a missing score head, an unreachable
    endpoint) -> :meth:`attach` (after the policy loads: the trainer's dtype and
    device, the policy tokenizer; loads weights) -> :meth:`score` per call ->
    :meth:`close`.

    Attributes:
        name: the entry's key in ``task.reward.models``.
        weight: its weight in the total reward.
        task: the run's task (prompts are rendered from its examples).
    """

    name: str = ""
    weight: float = 1.0
    task: Any = None
    #: the entry needs token rewards read by the advantage estimator (a PRM)
    token_level = False

    def check(self) -> None:
        """Start-time checks (raise :class:`ConfigError`); the default has none."""

    def attach(self, tokenizer: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        """Receive the policy tokenizer, the trainer's dtype and device; load weights."""

    def begin_step(self) -> None:
        """A new RL step starts (caches that live for one step are cleared here)."""

    def score(self, responses: Sequence[str], examples: Sequence[Any], prior: Mapping[str, ModelScore]) -> ModelScore:
        """Scores of ``responses`` (answers to ``examples``); ``prior``: entries scored before this one."""
        raise NotImplementedError

    def close(self) -> None:
        """Release servers, threads and weights."""

    def state_dict(self) -> Dict[str, Any]:
        """Cross-step state saved with checkpoints (running score statistics); the default has none."""
        norm = getattr(self, "norm", None)
        return {"norm": norm.state_dict()} if norm is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if "norm" in state and getattr(self, "norm", None) is not None:
            self.norm.load_state_dict(state["norm"])


# ------------------------------------------------------------------ normalisation
class Normalize(Choice):
    """How a model's raw scores are normalised before weighting."""

    none = "none"
    batch = "batch"
    running = "running"


class ScoreNormalizer:
    """Score normalisation: ``none``, ``batch`` (z-score over the call's rows) or ``running``.

    ``running`` keeps the count, mean and sum of squared deviations of every
    score seen so far (Welford's update, this call's scores included first) and
    returns ``(s - mean) / (std + eps)``; with a single score seen the std is 0
    and the result is 0.

    Args:
        mode: none | batch | running.
        eps: added to the standard deviation.
    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str = "none", eps: float = 1e-6) -> None:
        if str(mode) not in ("none", "batch", "running"):
            raise ValueError(f"normalize must be none, batch or running, got {mode!r}")
        self.mode, self.eps = str(mode), float(eps)
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        """``[B]`` float32 normalised scores of ``s`` ``[B]``."""
        s = s.float()
        if self.mode == "none" or s.numel() == 0:
            return s
        if self.mode == "batch":
            sd = s.std(unbiased=False) if s.numel() > 1 else torch.tensor(0.0)
            return (s - s.mean()) / (sd + self.eps)
        for x in s.double().tolist():
            self.n += 1
            d = x - self.mean
            self.mean += d / self.n
            self.m2 += d * (x - self.mean)
        sd = math.sqrt(self.m2 / self.n) if self.n > 1 else 0.0
        return ((s.double() - self.mean) / (sd + self.eps)).float()

    def state_dict(self) -> Dict[str, float]:
        """Running statistics (for checkpoints)."""
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Continue from :meth:`state_dict`'s statistics (a resumed run normalises as the killed one would have)."""
        self.n, self.mean, self.m2 = int(state["n"]), float(state["mean"]), float(state["m2"])


# ------------------------------------------------------------------ rendering
def render_chat(tokenizer: Any, task: Any, example: Any, response: str) -> str:
    """The conversation ``[system?, user, assistant=response]`` as text for a reward model.

    Rendered with ``tokenizer``'s chat template when it has one (no generation
    prompt: the assistant turn is complete), else as ``system\\nuser\\nresponse``.
    The user turn is the task's (:meth:`rlpost.tasks.base.Task.user_message`),
    so the reward model sees the question exactly as the policy did.

    Returns:
        the text, to be tokenized by the reward model's own tokenizer.
    """
    msgs = []
    sys_prompt = getattr(getattr(task, "cfg", None), "system_prompt", None) if task is not None else None
    if sys_prompt:
        msgs.append({"role": "system", "content": sys_prompt})
    user = task.user_message(example) if task is not None else str(getattr(example, "question", example))
    msgs.append({"role": "user", "content": user})
    msgs.append({"role": "assistant", "content": response})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    return "\n".join(m["content"] for m in msgs)


def render_prefix(tokenizer: Any, task: Any, example: Any) -> str:
    """The conversation up to the assistant's first character (where the response starts in
    :func:`render_chat`'s text), found by rendering with an empty-marker response."""
    marker = "\u2063\u2063RLPOST\u2063\u2063"
    text = render_chat(tokenizer, task, example, marker)
    return text[: text.index(marker)]


# ------------------------------------------------------------------ loading
def score_head(model: Any) -> Any:
    """The linear head of a classification model (``score`` in Llama/Qwen/GPT-2, ``classifier`` in BERT).

    Raises:
        ConfigError: the model has neither.
    """
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ConfigError(f"{type(model).__name__} has no score/classifier head")


def _read_config(path: str, what: str) -> Any:
    import os

    from transformers import AutoConfig

    if not os.path.isdir(str(path)):
        raise ConfigError(f"{what}: model_path={path!r} is not a directory. Fix: point it at a local Hugging Face "
                          f"model directory (config.json + weights), e.g. one written by `rlpost train-rm`.")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: cannot read {path}/config.json: {str(e).splitlines()[0]}") from None


def check_head(path: str, what: str, allowed: Tuple[str, ...] = ("ForSequenceClassification",),
               num_labels: Tuple[int, ...] = (1,)) -> Any:
    """Check (from ``config.json`` only, no weights) that ``path`` holds a model with a score head.

    Args:
        allowed: architecture-name suffixes accepted (``ForSequenceClassification``,
            ``ForTokenClassification``).
        num_labels: accepted label counts (1: a scalar score; 2: a binary classifier).
    Returns:
        the model's config.
    Raises:
        ConfigError: no directory, no readable config, an architecture without
            such a head (e.g. a causal LM), or another label count. The message
            names the fix (``rlpost train-rm``).
    """
    cfg = _read_config(path, what)
    archs = list(getattr(cfg, "architectures", None) or [])
    if not any(a.endswith(s) for a in archs for s in allowed):
        raise ConfigError(
            f"{what}: {path} has no score head (architectures={archs}; needs one ending in "
            f"{' or '.join(allowed)}). A causal LM is not a reward model. Fix: train one with "
            f"`rlpost train-rm --pairs FILE --out DIR` or point model_path at an "
            f"AutoModel{allowed[0]} checkpoint with num_labels={num_labels[0]}.")
    nl = int(getattr(cfg, "num_labels", 0) or 0)
    if nl not in num_labels:
        raise ConfigError(f"{what}: {path} has num_labels={nl}; a reward here needs num_labels in {list(num_labels)} "
                          f"(a single score). Fix: a checkpoint with one score head, e.g. from `rlpost train-rm`.")
    return cfg


def load_classifier(path: str, dtype: torch.dtype, device: Any, token_level: bool = False) -> Tuple[Any, Any]:
    """``(model, tokenizer)`` of a classification checkpoint, in ``dtype`` on ``device``, eval mode, frozen.

    The tokenizer pads on the right and gets a pad token (EOS) when it has none.

    Raises:
        ConfigError: the checkpoint's head was not in the weights (transformers
            would initialise it at random: a silent random reward).
    """
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    cfg = _read_config(path, "reward model")
    cls = AutoModelForSequenceClassification
    if token_level and any(a.endswith("ForTokenClassification") for a in (cfg.architectures or [])):
        cls = AutoModelForTokenClassification
    model, info = cls.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if k.split(".")[0] in ("score", "classifier")]
    if missing:
        raise ConfigError(f"reward model {path}: the score head's weights ({', '.join(missing)}) are not in the "
                          f"checkpoint, so they would be random. Fix: a checkpoint saved with its head (`rlpost train-rm`).")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    model.to(device).eval().requires_grad_(False)
    return model, tok


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scalar head outputs of a classification model, at chosen positions, in one forward pass.

    The body (``model.base_model``) runs once on the right-padded batch and the
    head is applied to the hidden states at ``positions`` (default: each row's
    last real token, ``attention_mask.sum(-1) - 1``). Used both for training
    (with grad) and scoring (under ``torch.no_grad``).

    Args:
        input_ids, attention_mask: ``[N, T]``, right padding.
        positions: ``[N]`` or ``[N, K]`` long token positions.
    Returns:
        ``[N]`` (or ``[N, K]``) float32 scores: label 0 of a one-label head; for
        a two-label head, the logit difference ``l1 - l0`` (log-odds of label 1).
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [N, T, H]
    if positions is None:
        positions = attention_mask.long().sum(-1) - 1
    idx = positions if positions.dim() == 2 else positions[:, None]
    h = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, K, H]
    logits = score_head(model)(h).float()  # [N, K, L]
    out = logits[..., 0] if logits.shape[-1] == 1 else logits[..., 1] - logits[..., 0]
    return out if positions.dim() == 2 else out[:, 0]


def length_batches(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Row indices grouped into micro-batches of ``batch_size`` by descending length (least padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), max(1, int(batch_size)))]


# ------------------------------------------------------------------ the reward-model verifier
@dataclass(frozen=True)
class RMParams:
    """A Bradley-Terry reward model: ``AutoModelForSequenceClassification`` with one score head."""

    model_path: str = param("", "local directory of the reward model (config.json, weights, tokenizer)")
    normalize: Normalize = param(Normalize.none, "none | batch (z-score over the call's rows) | running (over all rows seen)")
    batch_size: int = param(32, "rows per forward pass (rows sorted by length first)")
    max_length: int = param(1024, "tokens kept per rendered conversation (longer ones are truncated on the left)")


@REWARD_MODELS.register(
    "rm", params=RMParams,
    paper="Training language models to follow instructions with human feedback (arXiv:2203.02155): a Bradley-Terry reward model",
    description="reward model: a sequence-classification checkpoint with one score head, batched, no grad")
class RewardModelScorer(ModelReward):
    """Scores chat-rendered ``prompt + response`` with a local sequence-classification reward model.

    Batched and without gradients: rows are rendered with the RM's own chat
    template (:func:`render_chat`), tokenized together, sorted by length into
    micro-batches of ``batch_size`` and scored by one forward pass each (the
    score at each row's last token, :func:`sequence_scores`). Never one forward
    per row unless ``batch_size=1``.

    Raises:
        ConfigError: (``check``) no ``model_path``, no such directory, or a
            checkpoint without a one-label score head.
    """

    def __init__(self, *, model_path: str, normalize: str, batch_size: int, max_length: int) -> None:
        self.model_path = str(model_path)
        self.norm = ScoreNormalizer(normalize)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.model = self.tokenizer = None
        self.device: Any = "cpu"

    def check(self) -> None:
        if not self.model_path:
            raise ConfigError(f"task.reward.models.{self.name}: kind=rm needs model_path=DIR "
                              f"(a reward model directory, e.g. from `rlpost train-rm`).")
        check_head(self.model_path, f"task.reward.models.{self.name}")

    def attach(self, tokenizer: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        self.device = device
        self.model, self.tokenizer = load_classifier(self.model_path, dtype, device)

    def raw_scores(self, texts: Sequence[str]) -> torch.Tensor:
        """``[N]`` float32 reward-model scores of already rendered ``texts`` (batched, no grad)."""
        if self.model is None:
            self.attach()
        tok = self.tokenizer
        tok.truncation_side = "left"
        enc = [tok(t, add_special_tokens=False, truncation=True, max_length=self.max_length)["input_ids"] for t in texts]
        out = torch.zeros(len(texts), dtype=torch.float32)
        pad = int(tok.pad_token_id)
        with torch.no_grad():
            for rows in length_batches([len(e) for e in enc], self.batch_size):
                T = max(1, max(len(enc[i]) for i in rows))
                ids = torch.full((len(rows), T), pad, dtype=torch.long)
                att = torch.zeros((len(rows), T), dtype=torch.long)
                for j, i in enumerate(rows):
                    ids[j, :len(enc[i])] = torch.tensor(enc[i], dtype=torch.long)
                    att[j, :len(enc[i])] = 1
                out[rows] = sequence_scores(self.model, ids.to(self.device), att.to(self.device)).cpu()
        return out

    def score(self, responses: Sequence[str], examples: Sequence[Any], prior: Mapping[str, ModelScore]) -> ModelScore:
        if self.model is None:
            self.attach()
        texts = [render_chat(self.tokenizer, self.task, e, r) for r, e in zip(responses, examples)]
        raw = self.raw_scores(texts)
        return ModelScore(self.norm(raw), 0, {f"reward/{self.name}_raw_mean": float(raw.mean()) if len(raw) else 0.0},
                          raw=raw)

    def close(self) -> None:
        self.model = None


# ------------------------------------------------------------------ building from config
def build_model_rewards(models_cfg: Any, task: Any) -> Dict[str, ModelReward]:
    """The run's model rewards from ``task.reward.models`` (name -> entry), checked, in config order.

    Args:
        models_cfg: mapping ``name -> {kind, weight, <params>}`` (or None).
        task: the run's task.
    Raises:
        ConfigError: an entry without ``kind``, an unknown kind, an unknown or
            mistyped parameter (naming the valid keys), a name that clashes with a
            rule component, or a failed start-time check (:meth:`ModelReward.check`).
    """
    from omegaconf import DictConfig, OmegaConf

    if models_cfg is None:
        return {}
    if isinstance(models_cfg, DictConfig):
        models_cfg = OmegaConf.to_container(models_cfg, resolve=True)
    out: Dict[str, ModelReward] = {}
    for name, entry in dict(models_cfg).items():
        key = f"task.reward.models.{name}"
        if entry is None:  # a preset removed with task.reward.models.NAME=null
            continue
        if name in REWARD_COMPONENTS:
            raise ConfigError(f"{key}: {name!r} is a rule reward component; name the model reward otherwise (e.g. rm).")
        if not isinstance(entry, Mapping) or "kind" not in entry:
            raise ConfigError(f"{key} needs kind=<{'|'.join(REWARD_MODELS.names())}> (and its parameters).")
        entry = dict(entry)
        kind = str(entry.pop("kind"))
        weight = float(entry.pop("weight", 1.0))
        params = REWARD_MODELS.resolve(kind, entry, key=key)  # unknown / mistyped keys raise here
        from rlpost.core.registry import plain

        kwargs = {k: plain(getattr(params, k)) for k in params.__dataclass_fields__}
        obj: ModelReward = REWARD_MODELS.get(kind)(**kwargs)
        obj.name, obj.weight, obj.task = str(name), weight, task
        out[str(name)] = obj
    for obj in out.values():
        obj.check()
    return out


def check_estimator(models: Mapping[str, ModelReward], adv_estimator: str) -> None:
    """A process reward needs an estimator that reads token rewards.

    Raises:
        ConfigError: a token-level entry (a PRM) with an estimator not tagged
            ``uses_token_rewards`` (its step rewards would be dropped silently).
    """

    tl = [n for n, m in models.items() if m.token_level]
    if tl and not ADV_ESTIMATORS.entry(adv_estimator).tags.get("uses_token_rewards"):
        users = ", ".join(e.name for e in ADV_ESTIMATORS if e.tags.get("uses_token_rewards"))
        raise ConfigError(f"task.reward.models.{tl[0]} puts process rewards on tokens, but algo.adv_estimator="
                          f"{adv_estimator} ignores token rewards. Fix: algo.adv_estimator= one of {users} "
                          f"(e.g. algo=reinforce_pp_baseline).")


