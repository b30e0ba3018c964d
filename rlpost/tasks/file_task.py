"""Tasks read from files or the Hugging Face hub: math benchmarks and generic JSONL.

``kind=math`` covers GSM8K, MATH / MATH-500, AIME 2024, AMC 2023 and any other
problem/answer dataset scored by math-verify; ``kind=jsonl`` is the generic
task where the user names the prompt field, the answer field and the verifier.
Rows come from ``task.path`` (JSONL, JSON list or Parquet) or, without a path,
from the hub dataset ``task.dataset`` through the ``datasets`` library.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlpost.core.errors import ConfigError, DataError
from rlpost.core.jsonl import iter_jsonl
from rlpost.tasks.answer_tags import EXTRACTORS, extract_answer, extract_auto, extract_boxed, parse_gsm8k_gold
from rlpost.tasks.base import TASKS, Example, Task
from rlpost.tasks.verifiers import VERIFIERS, verify

GOLD_FORMATS = ("raw", "gsm8k", "boxed", "auto")


def read_rows(path: str | Path) -> List[Dict[str, Any]]:
    """Rows of a local dataset file: ``.jsonl`` (one JSON object per line), ``.json``
    (a list of objects) or ``.parquet``.

    Raises:
        DataError: missing file (names the path and ``task.path``), unsupported
            suffix, or a malformed line (names the line number).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"task.path={str(path)!r} does not exist (resolved to {p.resolve()}); give an existing JSONL/Parquet file")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow ships with datasets/pandas
            raise DataError("reading Parquet needs pyarrow: pip install pyarrow") from None
        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:  # noqa: BLE001 - any reader failure is a data problem
            raise DataError(f"cannot read Parquet file {p}: {e}") from None
    if suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise DataError(f"{p} must hold a JSON list of objects (or use .jsonl with one object per line)")
        return data
    if suffix not in (".jsonl", ".ndjson"):
        raise DataError(f"task.path={str(path)!r}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
    return [row for _, row in iter_jsonl(p, DataError, "task file")]


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint (``$HF_ENDPOINT`` or huggingface.co:443)
    opens within ``timeout_s`` seconds (avoids the datasets library's long retry loop offline)."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def load_hub_rows(dataset: str, config: Optional[str], split: str) -> List[Dict[str, Any]]:
    """Rows of split ``split`` of hub dataset ``dataset`` via :func:`datasets.load_dataset`.

    Raises:
        DataError: ``datasets`` missing or the hub unreachable / dataset unknown;
            the message says to set ``task.path`` to a local file instead.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"task.dataset={dataset!r} with no task.path needs the `datasets` library (pip install datasets); "
            "or set task.path=/path/to/file.jsonl"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "HF_DATASETS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes")
    if not offline and not hub_reachable():
        raise DataError(
            f"task.dataset={dataset!r} needs the Hugging Face hub, which is not reachable from this machine. "
            "Set task.path=/path/to/file.jsonl (JSONL or Parquet) to use a local copy"
            + (", and task.train_path=... for training" if split != "test" else "")
            + " (or HF_HUB_OFFLINE=1 to use a cached copy)."
        )
    try:
        ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, bad split...
        raise DataError(
            f"could not load {dataset!r} (config {config!r}, split {split!r}) from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}). "
            "Set task.path=/path/to/file.jsonl (JSONL or Parquet) to use a local copy"
            + (", and task.train_path=... for training" if split != "test" else "")
            + "."
        ) from None
    return [dict(r) for r in ds]


def parse_gold(value: Any, gold_format: str) -> Any:
    """Gold answer from a dataset field according to ``gold_format``.

    raw: the value itself (numbers kept as numbers); gsm8k: the number after
    ``####``; boxed: the last ``\\boxed{}``; auto: ``####`` if present, else the
    last ``\\boxed{}`` if present, else the raw value.

    Returns None when the format cannot be found in ``value``.
    """
    if gold_format == "raw":
        return value
    text = str(value)
    if gold_format == "gsm8k":
        return parse_gsm8k_gold(text)
    if gold_format == "boxed":
        return extract_boxed(text)
    if gold_format == "auto":
        if "####" in text:
            return parse_gsm8k_gold(text)
        if "\\boxed" in text:
            return extract_boxed(text)
        return value
    raise ConfigError(f"task.gold_format={gold_format!r} is not one of {', '.join(GOLD_FORMATS)}")


@TASKS.register("jsonl", description="generic local JSONL/Parquet task: prompt field, answer field, verifier")
class FileTask(Task):
    """A task whose rows come from a file (``task.path``) or the hub (``task.dataset``).

    Splits: with ``task.train_path`` (or, for the hub, ``task.train_split``) the
    training rows come from there and the evaluation rows from ``task.path``
    (hub: ``task.eval_split``). With only ``task.path`` the first ``eval_size``
    rows are held out for evaluation and the rest are training rows, so the
    splits never overlap. ``train_size``/``eval_size`` cap the splits (0: all).
    Row ``i`` of a split gets ``Example.index = i``.

    Scoring: the answer is extracted with ``task.answer_format`` and compared
    with the gold by ``task.reward.verifier`` (default for this kind: ``exact``).

    Raises:
        ConfigError: unknown verifier / answer format / gold format, or no data
            source (neither ``task.path`` nor ``task.dataset``).
        DataError: unreadable file, missing field, unparsable gold answer,
            unreachable hub.
    """

    default_verifier = "exact"
    default_gold_format = "raw"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        rcfg = getattr(cfg, "reward", None)
        self.verifier = (getattr(rcfg, "verifier", None) if rcfg is not None else None) or self.default_verifier
        VERIFIERS.entry(self.verifier)  # fail fast with the list of choices
        self.verifier_params = dict(getattr(rcfg, "verifier_params", None) or {}) if rcfg is not None else {}
        if cfg.answer_format not in EXTRACTORS:
            raise ConfigError(f"task.answer_format={cfg.answer_format!r} is not one of {', '.join(EXTRACTORS)}")
        self.gold_format = getattr(cfg, "gold_format", None) or self.default_gold_format
        if self.gold_format not in GOLD_FORMATS:
            raise ConfigError(f"task.gold_format={self.gold_format!r} is not one of {', '.join(GOLD_FORMATS)}")
        self._format_re = None
        fr = getattr(rcfg, "format_regex", None) if rcfg is not None else None
        if fr:
            try:
                self._format_re = re.compile(fr, re.DOTALL)
            except re.error as e:
                raise ConfigError(f"task.reward.format_regex={fr!r} is not a valid regular expression: {e}") from None
        train_rows, eval_rows, source = self._load_rows()
        self.source = source
        self._eval = self._to_examples(eval_rows, f"{source} (evaluation split)")
        self._train = self._to_examples(train_rows, f"{source} (training split)") if train_rows is not None else []

    # ---------------------------------------------------------------- loading
    def _load_rows(self):
        cfg = self.cfg
        path = getattr(cfg, "path", None)
        train_path = getattr(cfg, "train_path", None)
        ev_cap = int(cfg.eval_size or 0)
        tr_cap = int(cfg.train_size or 0)
        cap = lambda rows, n: rows[:n] if n > 0 else rows  # noqa: E731
        if path or train_path:
            if not path:
                raise ConfigError("task.train_path is set but task.path (the evaluation file) is not; set task.path too")
            rows = read_rows(path)
            if train_path:
                return cap(read_rows(train_path), tr_cap), cap(rows, ev_cap), str(path)
            if ev_cap <= 0:
                return None, rows, str(path)  # evaluation-only use of the whole file
            return cap(rows[ev_cap:], tr_cap), rows[:ev_cap], str(path)
        if not cfg.dataset:
            raise ConfigError(
                f"task {cfg.name!r} (kind={cfg.kind}) has no data: set task.path=/path/to/file.jsonl "
                "(or task.dataset=<hub id> when the Hugging Face hub is reachable)"
            )
        split_tr = getattr(cfg, "train_split", "train")
        split_ev = getattr(cfg, "eval_split", "test")
        eval_rows = load_hub_rows(cfg.dataset, getattr(cfg, "hub_config", None), split_ev)
        train_rows = load_hub_rows(cfg.dataset, getattr(cfg, "hub_config", None), split_tr) if split_tr else None
        return (cap(train_rows, tr_cap) if train_rows is not None else None), cap(eval_rows, ev_cap), f"hub:{cfg.dataset}"

    def _field(self, row: Dict[str, Any], key: str, what: str, where: str, i: int) -> Any:
        if key not in row:
            raise DataError(
                f"{where}: row {i} has no field {key!r} (fields: {', '.join(sorted(row))}); "
                f"set task.{what}=<one of them>"
            )
        return row[key]

    def _to_examples(self, rows: List[Dict[str, Any]], where: str) -> List[Example]:
        out = []
        for i, row in enumerate(rows):
            q = self._field(row, self.cfg.prompt_field, "prompt_field", where, i)
            raw = self._field(row, self.cfg.answer_field, "answer_field", where, i)
            gold = parse_gold(raw, self.gold_format)
            if gold is None or (isinstance(gold, str) and not gold.strip()):
                raise DataError(
                    f"{where}: row {i} field {self.cfg.answer_field!r} = {str(raw)[-80:]!r} has no gold answer in "
                    f"gold_format={self.gold_format!r}; set task.gold_format (raw, gsm8k, boxed, auto)"
                )
            meta = {k: v for k, v in row.items() if k in ("id", "url", "level", "type", "subject", "unique_id", "solution")}
            if "solution" not in meta and self.gold_format == "gsm8k" and isinstance(raw, str):
                meta["solution"] = raw  # GSM8K's answer field is the worked solution ending "#### <answer>"
            out.append(Example(index=i, question=str(q), answer=gold, meta=meta))
        return out

    # ---------------------------------------------------------------- splits
    def train_examples(self) -> List[Example]:
        """Training split.

        Raises:
            DataError: the task was configured for evaluation only (``task.path``
                with ``eval_size: 0`` and no ``task.train_path``).
        """
        if not self._train:
            raise DataError(
                f"task {self.name!r} has no training split: set task.train_path=/path/to/train.jsonl, "
                "or task.eval_size=N>0 to hold out the first N rows of task.path and train on the rest"
            )
        return self._train

    def eval_examples(self) -> List[Example]:
        """Evaluation split (row order of its source)."""
        return self._eval

    # ---------------------------------------------------------------- scoring
    def extract_answer(self, response: str) -> Optional[str]:
        """The final answer per ``task.answer_format`` (see :mod:`rlpost.tasks.answer_tags`)."""
        return extract_answer(response, self.cfg.answer_format)

    def format_ok(self, response: str) -> bool:
        """``task.reward.format_regex`` found in the response when set; with ``answer_format=auto``
        a ``\\boxed{}`` or ``<answer>`` tag present; otherwise an answer extracted."""
        if self._format_re is not None:
            return super().format_ok(response)
        if self.cfg.answer_format == "auto":
            return extract_answer(response, "boxed") is not None or extract_answer(response, "tags") is not None
        return self.extract_answer(response) is not None

    def score(self, response: str, example: Example) -> float:
        """Verifier ``task.reward.verifier`` on the extracted answer vs the gold (0 when none extracted)."""
        return verify(self.verifier, self.extract_answer(response), example.answer, self.verifier_params)


@TASKS.register(
    "math",
    paper="Math-Verify answer checking; GSM8K (arXiv:2110.14168), MATH (arXiv:2103.03874)",
    description="math benchmark from file/hub (gsm8k, math, aime24, amc23) scored by math-verify",
)
class MathTask(FileTask):
    """Math word problems with a final answer: GSM8K, MATH / MATH-500, AIME, AMC.

    Like :class:`FileTask`, with math defaults: ``verifier=math_verify`` and
    ``gold_format=auto`` (GSM8K ``#### 42`` fields and MATH ``\\boxed{}``
    solutions are both parsed; plain answers such as AMC's ``27.0`` are kept).
    """

    default_verifier = "math_verify"
    default_gold_format = "auto"


__all__ = ["FileTask", "MathTask", "read_rows", "load_hub_rows", "parse_gold", "extract_auto"]
