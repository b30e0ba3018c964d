"""Evaluate a policy on a task: greedy accuracy, pass@k / maj@k / mean@k, bootstrap CIs.

Used by ``rlpost eval`` (stand-alone on a checkpoint) and by the runner every
``eval.every`` steps. Generation goes through the run's
:class:`rlpost.rollout.base.RolloutEngine`; scoring goes through
:class:`rlpost.rewards.RewardFunction`, so a hanging or crashing verifier costs
that sample (scored 0, counted in ``verifier_errors`` / ``verifier_timeouts``)
and never the evaluation.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from rlpost.config.compose import compose_config
from rlpost.core.errors import ConfigError, DataError
from rlpost.eval.stats import bootstrap_ci, summarize_samples
from rlpost.rewards import RewardFunction
from rlpost.rollout.base import RolloutEngine, SamplingParams
from rlpost.tasks import build_task

#: Scalar keys of an evaluation result that are logged (plus the pass@k family).
SCALAR_KEYS = (
    "accuracy",
    "accuracy_ci_low",
    "accuracy_ci_high",
    "n",
    "response_length_mean",
    "truncated_frac",
    "format_rate",
    "verifier_errors",
    "verifier_timeouts",
    "time_s",
)


def _cfg_get(cfg: Any, key: str, default: Any) -> Any:
    val = getattr(cfg, key, default) if cfg is not None else default
    return default if val is None and default is not None else val


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(desc: Optional[str], total: int, leave: bool = True) -> Any:
    """A console progress bar (tqdm on stderr) over ``total`` responses, or a no-op one when ``desc`` is None.

    Evaluations generate in chunks of ``eval.batch_size`` prompts, so the bar moves once per chunk;
    it is drawn at the start, so a long evaluation is never silent.
    """
    if desc is None:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="response", dynamic_ncols=True, leave=leave)


def _generate_scored(
    engine: RolloutEngine,
    prompts: List[List[int]],
    examples: List[Any],
    params: SamplingParams,
    reward_fn: Any,
    batch_size: int,
    bar: Any = None,
) -> Dict[str, Any]:
    """Generate one response per prompt in chunks and score each with the isolated verifier."""
    texts: List[str] = []
    lengths: List[int] = []
    finished: List[bool] = []
    for i in range(0, len(prompts), batch_size):
        res = engine.generate(prompts[i : i + batch_size], params)
        texts.extend(res.texts)
        lengths.extend(int(x) for x in res.response_mask.sum(-1).tolist())
        finished.extend(bool(x) for x in res.finished.tolist())
        if bar is not None:
            bar.update(len(res.texts))
    scores, fmts, counts = reward_fn.correctness(texts, examples)
    return {"texts": texts, "lengths": lengths, "finished": finished, "scores": scores, "format": fmts, "counts": counts}


def _ci_fields(prefix: str, values: Sequence[float], seed: int, n_boot: int) -> Dict[str, float]:
    ci = bootstrap_ci(values, n_boot=n_boot, seed=seed)
    return {prefix: ci["mean"], f"{prefix}_ci_low": ci["ci_low"], f"{prefix}_ci_high": ci["ci_high"]}


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    task: Any,
    eval_cfg: Any,
    seed: int = 0,
    reward_fn: Any = None,
    n_boot: Optional[int] = None,
    rollout_cfg: Any = None,
    progress: Optional[str] = None,
    leave: bool = True,
    test_time: Any = None,
) -> Dict[str, Any]:
    """Evaluate ``task``'s held-out split with ``engine``.

    Greedy decoding gives ``accuracy`` (fraction of problems whose greedy
    response the task's verifier scores > 0.5; partial scores count as their
    value in the mean). With ``eval.n_samples = n > 1``, ``n`` further samples
    per problem at ``eval.temperature`` give pass@k (the unbiased estimator of
    Chen et al., "Evaluating Large Language Models Trained on Code",
    arXiv:2107.03374), maj@k (majority vote over extracted answers) and mean@k
    for every ``k`` in ``eval.ks`` with ``k <= n``. Every figure comes with a
    95% percentile bootstrap CI over problems.

    Args:
        engine: the rollout engine holding the policy weights to evaluate.
        tokenizer: the policy's tokenizer (for the chat template).
        task: a :class:`rlpost.tasks.Task`; its ``eval_examples()`` are used
            (the first ``eval.limit``).
        eval_cfg: :class:`rlpost.config.schema.EvalConfig` (``limit``,
            ``max_new_tokens``, ``n_samples``, ``temperature``, ``ks``,
            ``batch_size``).
        seed: seeds the sampled generations and the bootstrap.
        reward_fn: a :class:`rlpost.rewards.RewardFunction` for ``task``; by
            default one is built with the task's ``reward.timeout_s`` and closed
            afterwards.
        n_boot: bootstrap replicates (default ``eval.n_boot``, else 1000).
        rollout_cfg: the run's ``rollout`` config. Evaluation generates with
            training's stop strings (``rollout.stop``) and, for the sampled
            generations, training's ``top_k``/``top_p``, unless ``eval.stop``
            (when the eval config has one) says otherwise: the same weights
            must be judged on the responses training would produce (ignoring
            ``rollout.stop`` changed accuracy from 0.1875 to 0.375 on a
            16-problem check). None: no stop strings, no truncation.
        progress: the console progress bar's label (:func:`progress_bar`); None: no bar.
        leave: keep the finished bar on the console (False: it disappears, as inside training's bar).
        test_time: ``(strategy, context)``: a :class:`rlpost.eval.test_time.TestTimeStrategy` and its
            :class:`rlpost.eval.test_time.TestTimeContext` produce each answer in place of greedy
            decoding (``eval.test_time``); the answers are scored as greedy ones, and each record gets
            the strategy's ``test_time`` info. None: greedy decoding.
    Returns:
        A dict with ``task``, ``n`` (problems), ``accuracy`` with
        ``accuracy_ci_low``/``accuracy_ci_high`` (also as ``ci_low``/``ci_high``), ``response_length_mean``
        (tokens, greedy), ``truncated_frac``, ``format_rate``,
        ``verifier_errors``, ``verifier_timeouts``, ``time_s``, ``seed``, the
        pass@k / maj@k / mean@k figures (each with ``_ci_low``/``_ci_high``)
        when sampled, and ``records``: one dict per problem with ``index``,
        ``question``, ``gold``, ``response``, ``extracted``, ``correct``,
        ``length``, ``finished`` (plus ``sample_correct`` / ``sample_answers``
        when sampled).
    Raises:
        DataError: the task has no evaluation examples.
        ConfigError: a ``k`` in ``eval.ks`` exceeds ``eval.n_samples`` > 1.
    """

    t0 = time.monotonic()
    max_new, n_samples, temperature, ks, batch_size, stop, top_k, top_p = _settings(eval_cfg, rollout_cfg)
    n_boot = int(n_boot if n_boot is not None else _cfg_get(eval_cfg, "n_boot", 1000))
    examples = _eval_examples(task, eval_cfg)
    own_reward = reward_fn is None
    if own_reward:
        rcfg = getattr(task.cfg, "reward", None)
        reward_fn = RewardFunction(task, timeout_s=float(_cfg_get(rcfg, "timeout_s", 5.0)))
    bar = progress_bar(progress, len(examples) * (1 + (n_samples if n_samples > 1 else 0)), leave=leave)
    try:
        prompts = [task.render_prompt(ex, tokenizer) for ex in examples]
        greedy = _answers(test_time, engine, task, examples, prompts, reward_fn,
                          SamplingParams(max_new_tokens=max_new, greedy=True, seed=seed, stop=stop), batch_size, bar)
        sampled = None
        if n_samples > 1:
            rep_prompts = [p for p in prompts for _ in range(n_samples)]
            rep_examples = [e for e in examples for _ in range(n_samples)]
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, stop=stop,
                                    top_k=top_k, top_p=top_p)
            sampled = _generate_scored(engine, rep_prompts, rep_examples, params, reward_fn, batch_size, bar)
        bar.set_postfix_str(f"accuracy={float(np.mean([float(x) for x in greedy['scores']])):.3f}")
    finally:
        bar.close()
        if own_reward:
            reward_fn.close()

    out = _summarise(task, examples, greedy, sampled, n_samples, ks, seed, n_boot)
    if test_time is not None:
        out["test_time"] = getattr(test_time[0], "name", "") or type(test_time[0]).__name__
        for rec, info in zip(out["records"], greedy.get("info") or []):
            rec["test_time"] = info
    out["time_s"] = time.monotonic() - t0
    return out


def _answers(test_time: Any, engine: Any, task: Any, examples: List[Any], prompts: List[Any], reward_fn: Any,
             greedy: SamplingParams, batch_size: int, bar: Any) -> Dict[str, Any]:
    """Each problem's scored answer: greedy decoding, or the ``(strategy, context)`` of ``eval.test_time``
    (its ``respond`` gives the texts, scored by the same verifier; :mod:`rlpost.eval.test_time`)."""
    if test_time is None:
        return _generate_scored(engine, prompts, examples, greedy, reward_fn, batch_size, bar)
    strategy, ctx = test_time
    out = strategy.respond(task, examples, prompts, ctx, greedy.max_new_tokens, greedy.stop, greedy.seed, bar)
    out["scores"], out["format"], out["counts"] = reward_fn.correctness(out["texts"], examples)
    return out


def _eval_examples(task: Any, eval_cfg: Any) -> List[Any]:
    """The task's held-out examples, the first ``eval.limit`` of them when it is set.

    Raises:
        DataError: none are left.
    """
    examples = list(task.eval_examples())
    limit = _cfg_get(eval_cfg, "limit", None)
    if limit is not None:
        examples = examples[: int(limit)]
    if not examples:
        raise DataError(f"task {task.name!r} has no evaluation examples (check task.path / task.eval_size / eval.limit)")
    return examples


def _settings(eval_cfg: Any, rollout_cfg: Any) -> tuple:
    """``(max_new_tokens, n_samples, temperature, ks, batch_size, stop, top_k, top_p)`` of an evaluation.

    Raises:
        ConfigError: a ``k`` in ``eval.ks`` exceeds ``eval.n_samples`` > 1.
    """
    max_new = int(_cfg_get(eval_cfg, "max_new_tokens", 64))
    n_samples = int(_cfg_get(eval_cfg, "n_samples", 1))
    temperature = float(_cfg_get(eval_cfg, "temperature", 1.0))
    ks = [int(k) for k in (_cfg_get(eval_cfg, "ks", [1]) or [1])]
    batch_size = max(1, int(_cfg_get(eval_cfg, "batch_size", 64)))
    if n_samples > 1:
        bad = [k for k in ks if k > n_samples]
        if bad:
            raise ConfigError(f"eval.ks={ks} has k > eval.n_samples={n_samples}: {bad}; raise eval.n_samples or drop them")
    eval_stop = _cfg_get(eval_cfg, "stop", None)
    stop = [str(s) for s in (eval_stop if eval_stop is not None else (_cfg_get(rollout_cfg, "stop", None) or []))]
    top_k = int(_cfg_get(rollout_cfg, "top_k", 0) or 0)
    top_p = float(_cfg_get(rollout_cfg, "top_p", 1.0) or 1.0)
    return max_new, n_samples, temperature, ks, batch_size, stop, top_k, top_p


def _summarise(task: Any, examples: List[Any], greedy: Dict[str, Any], sampled: Optional[Dict[str, Any]],
               n_samples: int, ks: List[int], seed: int, n_boot: int) -> Dict[str, Any]:
    """:func:`evaluate`'s result dict (without ``time_s``) from its greedy and sampled generations."""
    n = len(examples)
    correct = [float(s) for s in greedy["scores"]]
    records: List[Dict[str, Any]] = []
    for i, ex in enumerate(examples):
        records.append(
            {
                "index": ex.index,
                "question": ex.question,
                "gold": _jsonable(ex.answer),
                "response": greedy["texts"][i],
                "extracted": task.extract_answer(greedy["texts"][i]),
                "correct": correct[i],
                "length": greedy["lengths"][i],
                "finished": greedy["finished"][i],
            }
        )
    out: Dict[str, Any] = {"task": task.name, "n": n, "seed": seed}
    out.update(_ci_fields("accuracy", correct, seed, n_boot))
    out["ci_low"], out["ci_high"] = out["accuracy_ci_low"], out["accuracy_ci_high"]  # aliases
    out["response_length_mean"] = float(np.mean(greedy["lengths"]))
    out["truncated_frac"] = float(np.mean([not f for f in greedy["finished"]]))
    out["format_rate"] = float(np.mean([float(f) for f in greedy["format"]]))
    errors = greedy["counts"]["errors"]
    timeouts = greedy["counts"]["timeouts"]
    if sampled is not None:
        sc = [sampled["scores"][i * n_samples : (i + 1) * n_samples] for i in range(n)]
        answers = [
            [task.answer_key(t) for t in sampled["texts"][i * n_samples : (i + 1) * n_samples]] for i in range(n)
        ]
        per_problem = summarize_samples(sc, answers, [k for k in ks if k <= n_samples], seed=seed)
        for key, vals in per_problem.items():
            out.update(_ci_fields(key, vals, seed, n_boot))
            for rec, v in zip(records, vals):
                rec[key] = v
        for rec, c, a in zip(records, sc, answers):
            rec["sample_correct"] = [float(x) for x in c]
            rec["sample_answers"] = a
        out["n_samples"] = n_samples
        out["sample_length_mean"] = float(np.mean(sampled["lengths"]))
        errors += sampled["counts"]["errors"]
        timeouts += sampled["counts"]["timeouts"]
    out["verifier_errors"] = float(errors)
    out["verifier_timeouts"] = float(timeouts)
    out["records"] = records
    return out


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return str(x)


def scalar_metrics(result: Dict[str, Any], prefix: Optional[str] = None) -> Dict[str, float]:
    """Flat ``{prefix/key: float}`` of an :func:`evaluate` result for the metrics log.

    ``prefix`` defaults to ``eval/<task>``; keys are :data:`SCALAR_KEYS` plus the
    pass@k / maj@k / mean@k family with their CI bounds. ``records`` is dropped.
    """
    prefix = prefix if prefix is not None else f"eval/{result['task']}"
    out: Dict[str, float] = {}
    for key, val in result.items():
        if key in ("records", "task", "seed"):
            continue
        if key in SCALAR_KEYS or key.split("@")[0] in ("pass", "maj", "mean") or key in ("n_samples", "sample_length_mean"):
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                out[f"{prefix}/{key}"] = float(val)
    return out


def aggregate(results: Dict[str, Dict[str, Any]], seed: int = 0, n_boot: int = 1000) -> Dict[str, float]:
    """Aggregate per-benchmark results into overall figures.

    ``macro_accuracy`` is the unweighted mean of per-benchmark accuracies (each
    benchmark counts equally, the "domain-balanced average" of DataFlex-RL); its
    CI resamples problems within each benchmark (a stratified bootstrap).
    ``micro_accuracy`` pools all problems. Same for every shared pass@k key.

    Args:
        results: ``{task name: evaluate() result}`` (with ``records``).
    Returns:
        ``{"macro_accuracy", "macro_accuracy_ci_low", "macro_accuracy_ci_high",
        "micro_accuracy", ..., "n"}``.
    """
    if not results:
        return {}
    rng = np.random.default_rng(seed)
    keys = ["accuracy"] + sorted(
        set.intersection(*[{k for k in r if "@" in k and not k.endswith(("_ci_low", "_ci_high"))} for r in results.values()])
    )
    out: Dict[str, float] = {"n": float(sum(r["n"] for r in results.values()))}
    for key in keys:
        rec_key = "correct" if key == "accuracy" else key
        per = [np.asarray([rec[rec_key] for rec in r["records"]], dtype=np.float64) for r in results.values()]
        macro = float(np.mean([p.mean() for p in per]))
        boots = np.empty(n_boot)
        for b in range(n_boot):
            boots[b] = np.mean([p[rng.integers(0, p.size, p.size)].mean() for p in per])
        lo, hi = np.quantile(boots, [0.025, 0.975])
        out[f"macro_{key}"] = macro
        out[f"macro_{key}_ci_low"] = float(lo)
        out[f"macro_{key}_ci_high"] = float(hi)
        out.update(_ci_fields(f"micro_{key}", np.concatenate(per).tolist(), seed, n_boot))
    return out


def save_result(result: Dict[str, Any], run_dir: str | Path, step: Optional[int] = None) -> Path:
    """Write an :func:`evaluate` result under ``run_dir/eval/<task>/`` for ``rlpost compare``.

    Writes ``step_<step>.json`` (or ``final.json`` when ``step`` is None): the
    scalar figures plus ``records``. Returns the file path.
    """
    d = Path(run_dir) / "eval" / str(result["task"]).replace("/", "_")
    d.mkdir(parents=True, exist_ok=True)
    path = d / (f"step_{int(step):06d}.json" if step is not None else "final.json")
    payload = {k: v for k, v in result.items()}
    payload["step"] = step
    path.write_text(json.dumps(payload, default=str))
    return path


def format_result(result: Dict[str, Any]) -> str:
    """One human-readable line per figure, e.g. ``gsm8k accuracy 0.120 [0.060, 0.190] (n=100)``."""
    lines = [
        f"{result['task']}: accuracy {result['accuracy']:.3f} "
        f"[95% CI {result['accuracy_ci_low']:.3f}, {result['accuracy_ci_high']:.3f}] (n={result['n']}), "
        f"mean response length {result['response_length_mean']:.1f} tokens, truncated {result['truncated_frac']:.2f}, "
        f"verifier errors {int(result['verifier_errors'])}, timeouts {int(result['verifier_timeouts'])}"
    ]
    for key in sorted(k for k in result if "@" in k and not k.endswith(("_ci_low", "_ci_high"))):
        v = result[key]
        if isinstance(v, float) and not math.isnan(v):
            lines.append(f"  {key} {v:.3f} [{result[key + '_ci_low']:.3f}, {result[key + '_ci_high']:.3f}]")
    return "\n".join(lines)


def build_eval_tasks(specs: Sequence[str], extra_overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Tasks named in ``eval.tasks``, each composed from its preset ``conf/task/<name>.yaml``.

    An entry is ``<preset>`` or ``<preset>:<path>`` (sets ``task.path``, e.g.
    ``gsm8k:data/gsm8k/test.jsonl``). Tasks are evaluation-only here:
    their training split is never read.

    Args:
        specs: entries of ``eval.tasks``.
        extra_overrides: further Hydra overrides applied to every preset.
    Returns:
        ``{task name: Task}`` in the order given.
    Raises:
        ConfigError: unknown preset (lists the choices) or invalid override.
        DataError: unreadable file / unreachable hub.
    """

    tasks: Dict[str, Any] = {}
    for spec in specs:
        name, _, path = str(spec).partition(":")
        overrides = [f"task={name.strip()}"] + list(extra_overrides)
        if path:
            overrides.append(f"task.path={path.strip()}")
        cfg = compose_config(overrides)
        task = build_task(cfg.task)
        tasks[task.name] = task
    return tasks


def evaluate_tasks(
    engine: RolloutEngine, tokenizer: Any, tasks: Dict[str, Any], eval_cfg: Any, seed: int = 0
) -> Dict[str, Any]:
    """:func:`evaluate` on every task, plus the :func:`aggregate` figures.

    Returns:
        ``{"results": {task: result}, "aggregate": {...}, "metrics": flat
        eval/<task>/... and eval/aggregate/... scalars for the metrics log}``.
    """
    results = {name: evaluate(engine, tokenizer, t, eval_cfg, seed=seed) for name, t in tasks.items()}
    agg = aggregate(results, seed=seed, n_boot=int(_cfg_get(eval_cfg, "n_boot", 1000))) if len(results) > 1 else {}
    metrics: Dict[str, float] = {}
    for name, res in results.items():
        metrics.update(scalar_metrics(res, f"eval/{name}"))
    metrics.update({f"eval/aggregate/{k}": float(v) for k, v in agg.items()})
    return {"results": results, "aggregate": agg, "metrics": metrics}
