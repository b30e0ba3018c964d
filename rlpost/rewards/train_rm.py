"""Train a Bradley-Terry reward model on chosen/rejected pairs (``rlpost train-rm``), and make pairs.

Paper: "Training language models to follow instructions with human feedback"
(Ouyang et al., arXiv:2203.02155), Eq. 1: ``loss = -log sigmoid(r(x, y_c) - r(x, y_r))``
over preference pairs; the head is a scalar score on the last token of the
chat-rendered conversation.

Pairs are JSONL rows ``{"prompt": ..., "chosen": ..., "rejected": ..., "system": optional}``.
A share of the rows (``eval_frac``) is held out and the report gives their
pairwise accuracy (``r(chosen) > r(rejected)``) before and after training.
:func:`task_pairs` makes pairs from an rlpost task itself: the gold answer
against a wrong one, written the way the task's system prompt asks.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError, DataError
from rlpost.core.jsonl import iter_jsonl
from rlpost.models.loader import load_model, load_tokenizer
from rlpost.rewards.models import render_chat, score_head, sequence_scores

PAIR_KEYS = ("prompt", "chosen", "rejected")


def read_pairs(path: str) -> List[Dict[str, str]]:
    """Rows of a pairs JSONL file.

    Raises:
        DataError: a missing file, a line that is not JSON, a row missing one
            of ``prompt``, ``chosen``, ``rejected`` (naming the line), or no rows.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"pairs file {path} does not exist. Fix: --pairs FILE (JSONL rows with prompt, chosen, "
                        f"rejected), e.g. one written by `rlpost rm-pairs`.")
    rows = []
    for n, row in iter_jsonl(p, DataError, "pairs file"):
        miss = [k for k in PAIR_KEYS if not isinstance(row.get(k), str)]
        if miss:
            raise DataError(f"{path}:{n}: missing string field(s) {', '.join(miss)}; a pair row needs prompt, chosen, rejected")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no pairs")
    return rows


_EXPR = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x×])\s*(-?\d+(?:\.\d+)?)")


def task_pairs(task: Any, n: int, seed: int = 0, max_offset: int = 10, min_offset: int = 1) -> List[Dict[str, str]]:
    """``n`` pairs from ``task``'s training prompts: the gold answer (chosen) against a wrong one (rejected).

    Both answers are written as ``<a> <op> <b> = <answer>`` when the question
    holds a two-operand expression (the arithmetic tasks' requested style),
    else as the bare answer. The wrong answer is the gold plus a random
    integer with ``min_offset <= |d| <= max_offset``.

    Raises:
        ConfigError: the task's gold answers are not numbers.
    """
    rng = random.Random(seed)
    exs = task.train_examples()
    rows = []
    for k in range(n):
        e = exs[k % len(exs)]
        try:
            gold = float(str(e.answer).strip())
        except ValueError:
            raise ConfigError(f"task_pairs needs numeric gold answers; task {task.name} has {e.answer!r}") from None
        d = rng.choice((-1, 1)) * rng.randint(max(1, min_offset), max(1, min_offset, max_offset))
        fmt = (lambda v: str(int(v)) if float(v).is_integer() else str(v))
        m = _EXPR.search(e.question)
        lead = f"{m.group(1)} {m.group(2)} {m.group(3)} = " if m else ""
        rows.append({"system": getattr(task.cfg, "system_prompt", None) or "", "prompt": task.user_message(e),
                     "chosen": lead + fmt(gold), "rejected": lead + fmt(gold + d)})
    return rows


def write_pairs(rows: Sequence[Dict[str, str]], path: str) -> None:
    """Write pair rows as JSONL (parents created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))


class _PairTask:
    """A stand-in task for :func:`render_chat`: the pair's own system prompt and user turn."""

    def __init__(self, system: str) -> None:
        self.cfg = SimpleNamespace(system_prompt=system or None)

    def user_message(self, example: Any) -> str:
        return example.question


def render_pair(tokenizer: Any, row: Dict[str, str]) -> Tuple[str, str]:
    """``(chosen text, rejected text)`` rendered with ``tokenizer``'s chat template (as the RM verifier renders)."""
    t, ex = _PairTask(row.get("system", "")), SimpleNamespace(question=row["prompt"])
    return render_chat(tokenizer, t, ex, row["chosen"]), render_chat(tokenizer, t, ex, row["rejected"])


def _batch(tokenizer: Any, texts: Sequence[str], max_length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    enc = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    T = max(len(e) for e in enc)
    ids = torch.full((len(enc), T), int(tokenizer.pad_token_id), dtype=torch.long)
    att = torch.zeros((len(enc), T), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = torch.tensor(e)
        att[i, :len(e)] = 1
    return ids, att


def pairwise_accuracy(model: Any, tokenizer: Any, rendered: Sequence[Tuple[str, str]], batch_size: int = 32,
                      max_length: int = 512) -> float:
    """Share of pairs with ``r(chosen) > r(rejected)`` (ties count half), batched, no grad."""
    if not rendered:
        return float("nan")
    wins = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rendered), batch_size):
            chunk = rendered[i:i + batch_size]
            ids, att = _batch(tokenizer, [c for c, _ in chunk] + [r for _, r in chunk], max_length)
            s = sequence_scores(model, ids, att)
            rc, rr = s[:len(chunk)], s[len(chunk):]
            wins += float((rc > rr).sum()) + 0.5 * float((rc == rr).sum())
    return wins / len(rendered)


def init_reward_model(model_cfg: Any, seed: int = 0) -> Tuple[Any, Any]:
    """A fresh one-label sequence-classification model on the body of ``model_cfg``'s policy, and its tokenizer.

    ``model=tiny`` gets a random tiny body; any other model loads its pretrained
    body with a new score head (seeded).
    """
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(model_cfg)
    tok.padding_side = "right"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        lm = load_model(model_cfg, torch.float32, seed=seed)
        cfg = lm.config
        cfg.num_labels = 1
        cfg.pad_token_id = tok.pad_token_id
        model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
        missing, _ = model.load_state_dict(lm.state_dict(), strict=False)
    bad = [k for k in missing if not k.startswith(("score", "classifier"))]
    if bad:
        raise ConfigError(f"reward-model init: body weights {bad[:3]} did not transfer from {type(lm).__name__}")
    model.config.architectures = [type(model).__name__]
    return model, tok


def train_reward_model(pairs: Sequence[Dict[str, str]], model: Any, tokenizer: Any, out_dir: Optional[str] = None,
                       steps: int = 60, lr: float = 2e-5, batch_size: int = 8, eval_frac: float = 0.2,
                       seed: int = 0, max_length: int = 512, train_layers: int = -1, log: Any = None) -> Dict[str, Any]:
    """Train ``model``'s score head (and body) with the Bradley-Terry loss; report held-out pairwise accuracy.

    The last ``ceil(eval_frac * N)`` pairs of a seeded shuffle are held out.
    Each step draws ``batch_size`` training pairs (cycling through a shuffled
    order) and takes one AdamW step on ``mean(-log sigmoid(r_c - r_r))``.

    Args:
        pairs: rows with ``prompt``, ``chosen``, ``rejected`` (``system`` optional).
        out_dir: where the trained model and tokenizer are saved (``save_pretrained``), or None.
        train_layers: train only the last ``k`` decoder layers, the final norm and
            the head (-1: everything). 0 trains the head alone on the frozen
            body's last-token features, computed once (a linear-probe reward
            model: ``steps`` full-batch AdamW steps on cached features, fast on CPU).
    Returns:
        ``{"heldout_accuracy_before", "heldout_accuracy", "train_pairs", "heldout_pairs",
        "final_loss", "seconds", "steps"}``.
    Raises:
        ConfigError: fewer than 2 pairs, or ``eval_frac`` outside (0, 1).
    """
    if len(pairs) < 2:
        raise ConfigError(f"train-rm needs at least 2 pairs (got {len(pairs)})")
    if not 0.0 < eval_frac < 1.0:
        raise ConfigError(f"--eval-frac must be in (0, 1), got {eval_frac}")
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    n_eval = max(1, int(-(-eval_frac * len(pairs) // 1)))
    train_idx, eval_idx = order[:-n_eval], order[-n_eval:]
    rendered = [render_pair(tokenizer, r) for r in pairs]
    heldout = [rendered[i] for i in eval_idx]
    acc0 = pairwise_accuracy(model, tokenizer, heldout, max_length=max_length)
    if train_layers == 0:
        return _train_head_only(model, tokenizer, rendered, train_idx, heldout, acc0, out_dir, steps, lr, max_length)
    if train_layers >= 0:
        model.requires_grad_(False)
        layers = getattr(model.base_model, "layers", None)
        keep = list(layers[len(layers) - train_layers:]) if layers is not None and train_layers > 0 else []
        for m in keep + [getattr(model.base_model, "norm", None)]:
            if m is not None:
                m.requires_grad_(True)
        from rlpost.rewards.models import score_head

        score_head(model).requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    t0, loss_v, cursor = time.perf_counter(), float("nan"), 0
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        model.train()
        if cursor + batch_size > len(train_idx):
            train_idx = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
            cursor = 0
        rows = train_idx[cursor:cursor + batch_size]
        cursor += batch_size
        ids, att = _batch(tokenizer, [rendered[i][0] for i in rows] + [rendered[i][1] for i in rows], max_length)
        s = sequence_scores(model, ids, att)
        loss = -torch.nn.functional.logsigmoid(s[:len(rows)] - s[len(rows):]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())
        if log is not None and (step % 10 == 0 or step == steps):
            log(f"step {step}/{steps} loss {loss_v:.4f}")
    acc = pairwise_accuracy(model, tokenizer, heldout, max_length=max_length)
    report = {"heldout_accuracy_before": acc0, "heldout_accuracy": acc, "train_pairs": len(train_idx),
              "heldout_pairs": len(heldout), "final_loss": loss_v, "seconds": time.perf_counter() - t0, "steps": steps}
    _save(model, tokenizer, out_dir, report)
    return report


def _save(model: Any, tokenizer: Any, out_dir: Optional[str], report: Dict[str, Any]) -> None:
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        (out / "rm_report.json").write_text(json.dumps(report, indent=2) + "\n")


def last_token_features(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = 32,
                        max_length: int = 512) -> torch.Tensor:
    """``[N, H]`` float32 hidden states of the body at each text's last token (batched, no grad)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            ids, att = _batch(tokenizer, texts[i:i + batch_size], max_length)
            h = model.base_model(input_ids=ids, attention_mask=att).last_hidden_state
            out.append(h[torch.arange(len(ids)), att.long().sum(-1) - 1].float())
    return torch.cat(out)


def _train_head_only(model: Any, tokenizer: Any, rendered: Sequence[Tuple[str, str]], train_idx: List[int],
                     heldout: Sequence[Tuple[str, str]], acc0: float, out_dir: Optional[str], steps: int, lr: float,
                     max_length: int) -> Dict[str, Any]:
    """Bradley-Terry on cached features: only the score head learns (full-batch AdamW, ``steps`` steps)."""

    t0 = time.perf_counter()
    tr = [rendered[i] for i in train_idx]
    f = last_token_features(model, tokenizer, [c for c, _ in tr] + [r for _, r in tr], max_length=max_length)
    fc, fr = f[:len(tr)], f[len(tr):]
    head = score_head(model)
    head.requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    loss_v = float("nan")
    for _ in range(steps):
        loss = -torch.nn.functional.logsigmoid((head(fc) - head(fr))[:, 0].float()).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())
    acc = pairwise_accuracy(model, tokenizer, heldout, max_length=max_length)
    report = {"heldout_accuracy_before": acc0, "heldout_accuracy": acc, "train_pairs": len(tr),
              "heldout_pairs": len(heldout), "final_loss": loss_v, "seconds": time.perf_counter() - t0, "steps": steps,
              "head_only": True}
    _save(model, tokenizer, out_dir, report)
    return report
