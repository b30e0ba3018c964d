"""Scoring a policy with lm-evaluation-harness tasks (``rlpost eval harness=TASKS``).

EleutherAI's lm-evaluation-harness (https://github.com/EleutherAI/lm-evaluation-harness,
"Lessons from the Trenches on Reproducible Evaluation of Language Models",
arXiv:2405.14782) defines the prompts, few-shot examples, answer extraction and
metrics behind most published numbers; scoring an rlpost checkpoint with it
makes a run comparable with them. The policy rlpost loads (a run's ``final/``
or ``checkpoints/step_N/``, or the base model) is wrapped in lm-eval's
``HFLM`` and handed to ``lm_eval.simple_evaluate``; rlpost adds only the
config, the error messages, and the output files (``harness.json`` with every
task's metrics and stderr, ``harness_samples.jsonl`` with each document's
prompt, target, response and per-document metrics).

lm-eval is an optional dependency (``pip install 'rlpost[harness]'``).
Standard tasks download their data from the Hugging Face Hub; a local task is a
YAML in ``eval.harness.include`` whose ``dataset_path: json`` points at a local
jsonl file (the README's "Standard benchmarks" section has one), which runs offline.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlpost.core.errors import ConfigError, DataError


def _import_lm_eval() -> Any:
    try:
        import lm_eval  # noqa: F401
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("eval.harness needs lm-evaluation-harness: pip install 'rlpost[harness]' "
                          "(or pip install lm-eval)") from None
    return simple_evaluate, HFLM, TaskManager


def check_tasks(task_manager: Any, tasks: List[str]) -> None:
    """Refuse task names lm-eval does not know (with the closest known names).

    Raises:
        ConfigError: an unknown task or group name.
    """
    known = set(task_manager.all_tasks)
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, sorted(known), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"eval.harness.tasks: {t!r} is not an lm-eval task or group.{hint} Local tasks: put "
                              f"their YAML in a folder and set eval.harness.include=FOLDER.")


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        try:
            return v.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def run_harness(model: Any, tokenizer: Any, harness_cfg: Any, seed: int = 0, device: Optional[str] = None
                ) -> Dict[str, Any]:
    """Score ``model`` on ``harness_cfg.tasks`` with lm-eval; returns ``{"results", "samples", ...}``.

    Args:
        model: a loaded causal LM (``transformers.PreTrainedModel``), on its device, in eval mode.
        tokenizer: its tokenizer.
        harness_cfg: :class:`rlpost.config.schema.HarnessConfig`.
        seed: lm-eval's python, numpy, torch and few-shot seeds.
        device: the model's device name (lm-eval places inputs there).
    Returns:
        ``{"results": {task: {metric: value}}, "n_samples": {task: n}, "n_shot": {task: k},
        "versions": {...}, "samples": {task: [per-document records]}}``; metric
        names are lm-eval's (``exact_match,none``, ``acc,none``, ``acc_stderr,none``).
    Raises:
        ConfigError: lm-eval missing, no tasks, unknown task, bad include folder.
        DataError: a task's data could not be loaded (offline without the data).
    """
    simple_evaluate, HFLM, TaskManager = _import_lm_eval()
    tasks = [str(t) for t in harness_cfg.tasks]
    if not tasks:
        raise ConfigError("eval.harness.tasks is empty; name lm-eval tasks: rlpost eval harness=gsm8k,arc_easy")
    include = harness_cfg.include
    if include is not None and not Path(include).is_dir():
        raise ConfigError(f"eval.harness.include={include!r} is not a folder; give the folder holding the task YAMLs")
    tm = TaskManager(include_path=str(include) if include else None)
    check_tasks(tm, tasks)
    limit = harness_cfg.limit
    if limit is not None:
        limit = float(limit)
        if limit <= 0:
            raise ConfigError(f"eval.harness.limit={limit}: give a document count >= 1, a fraction in (0, 1), or null")
        limit = int(limit) if limit >= 1 else limit
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=int(harness_cfg.batch_size),
              device=device)
    try:
        out = simple_evaluate(
            model=lm, tasks=tasks, task_manager=tm, limit=limit, num_fewshot=harness_cfg.num_fewshot,
            apply_chat_template=bool(harness_cfg.apply_chat_template), log_samples=True,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )
    except (ConnectionError, OSError, FileNotFoundError) as e:
        raise DataError(f"lm-eval could not load a task's data ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        "standard tasks download from the Hugging Face Hub, so run online once, or use a local "
                        "task (eval.harness.include)") from None
    if out is None:  # pragma: no cover - simple_evaluate returns None on non-zero ranks only
        raise DataError("lm-eval returned no results")
    samples: Dict[str, List[Dict[str, Any]]] = {}
    for task, recs in (out.get("samples") or {}).items():
        rows = []
        for r in recs:
            args = r.get("arguments")
            rows.append(_jsonable({
                "doc_id": r.get("doc_id"), "target": r.get("target"),
                "prompt": args[0][0] if args and isinstance(args[0], (list, tuple)) else None,
                "response": r.get("filtered_resps"),
                **{m: r[m] for m in (out.get("higher_is_better", {}).get(task) or {}) if m in r},
            }))
        samples[task] = rows
    return {
        "results": _jsonable(out["results"]),
        "n_samples": _jsonable(out.get("n-samples", {})),
        "n_shot": _jsonable(out.get("n-shot", {})),
        "versions": _jsonable(out.get("versions", {})),
        "lm_eval_version": out.get("lm_eval_version"),
        "samples": samples,
    }


def metric_lines(results: Dict[str, Any]) -> List[str]:
    """``task: metric=value (stderr)`` lines of :func:`run_harness`'s ``results``."""
    lines = []
    for task, res in results["results"].items():
        parts = []
        for k, v in res.items():
            if "," not in k or "_stderr" in k or not isinstance(v, (int, float)):
                continue
            name, filt = k.split(",", 1)
            se = res.get(f"{name}_stderr,{filt}")
            label = name if filt == "none" else f"{name} ({filt})"
            parts.append(f"{label}={v:.4f}" + (f" (stderr {se:.4f})" if isinstance(se, (int, float)) else ""))
        lines.append(f"{task}: " + ", ".join(parts))
    return lines


def write_results(run_dir: Path, res: Dict[str, Any]) -> Path:
    """Write ``harness.json`` (everything but the samples) and ``harness_samples.jsonl``; returns the JSON path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "harness.json").write_text(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    with open(run_dir / "harness_samples.jsonl", "w") as fh:
        for task, rows in res["samples"].items():
            for row in rows:
                fh.write(json.dumps({"task": task, **row}) + "\n")
    return run_dir / "harness.json"
