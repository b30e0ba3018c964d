"""Recipes: a method's paper setting, its headline claim as data, and a CPU variant with its baseline.

A recipe is ``recipes/NAME.yaml`` (also the Hydra group ``recipe``, so
``rlpost train +recipe=NAME`` runs it). Its Hydra body is the CPU-scale variant
(SmolLM2-135M on the default task); its ``card:`` block is the record this module
reads and validates (:class:`Card`)::

    card:
      method: vade                       # what the recipe exercises (a registered name)
      kind: selector                     # algo | selector | sampler | correction | precision | executor | model | baseline
      paper: "VADE: Variance-Aware Dynamic Sampling ..."
      arxiv: "2511.18902"                # or null; code: URL or null
      paper_setting:                     # the paper's own GPU setting
        source: "arXiv:2511.18902 Sec. 5.1"
        model: Qwen2.5-VL-7B-Instruct
        ...                              # a value the paper does not give: "not stated";
                                         # one nobody has read yet: "not checked"
      claim:                             # the headline claim as data
        metric: accuracy
        benchmark: MathVista
        baseline: GRPO (uniform sampling)
        value: 70.1
        baseline_value: 68.3
        delta: 1.8
        unit: points
        source: "arXiv:2511.18902 Table 1"
      cpu:                               # how `rlpost reproduce` checks the claim here
        baseline: [selector=uniform]     # overrides giving the baseline arm, or "untrained"
        expect: higher                   # higher | no_worse (within `margin` of the baseline)

A variant recipe holds ``card: {recipe_of: NAME}`` instead: its claim and paper
setting are those of the method recipe it names. Variants are GPU deployments
(``dapo_qwen2.5_32b``: ``recipe_of: dapo``) and the CPU agent recipes
(``agent_multiply_sao``: ``recipe_of: sao``).

A misspelt or missing card field is a :class:`~rlpost.core.errors.ConfigError`
naming the valid fields (:func:`parse_card`), raised when the recipe is composed
(:func:`rlpost.config.compose.validate_config`) and by ``rlpost recipes``.

``rlpost reproduce NAME --seeds N`` (:func:`reproduce`) trains the CPU variant
and its baseline on matched seeds, evaluates both on the same held-out problems,
and judges the difference with the paired two-way bootstrap of
:func:`rlpost.eval.stats.paired_bootstrap` (via
:func:`rlpost.eval.compare.compare_methods`) and :func:`judge`; a difference it
cannot resolve comes with :func:`seeds_to_resolve`, a power estimate of the
seeds that would. The record goes to ``recipes/results/NAME.json``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from statistics import NormalDist
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from rlpost.config.compose import compose_config, conf_dir, group_choices, validate_config
from rlpost.core.errors import ConfigError
from rlpost.eval.compare import compare_methods, load_run
from rlpost.run.checkpoint import DONE_MARKER
from rlpost.run.runner import train

NOT_STATED = "not stated"  #: the paper (or its code) was read and gives no value
NOT_CHECKED = "not checked"  #: nobody has read the source for this value yet
SENTINELS = (NOT_STATED, NOT_CHECKED)
KINDS = ("algo", "selector", "sampler", "correction", "precision", "executor", "model", "baseline")
EXPECTS = ("higher", "no_worse")
VERDICTS = ("reproduced direction", "not resolved", "contradicted")
UNTRAINED = "untrained"
FINAL = "{final}"  #: in ``cpu.after.overrides``: the stage run's ``final/`` weights directory

Value = Union[str, int, float, List[Any], None]


@dataclass
class PaperSetting:
    """The paper's own training setting, each value as the paper or its released code states it.

    Attributes:
        source: where the values come from (section, table or config file);
            ``sources`` overrides it per field.
        model, data: policy model and training data.
        prompts_per_step: prompts per RL step (the paper's batch size).
        group_size: rollouts per prompt (G).
        max_response_len: response length limit in tokens.
        lr: learning rate of the policy.
        steps: RL steps (or epochs, as stated).
        clip: clip values (eps_low / eps_high, dual clip, or the method's own bounds).
        kl_coef: KL penalty coefficient (0 when the paper removes it).
        extra: method-specific hyperparameters ``{name: value}``.
        sources: ``{field: source}`` for values that come from elsewhere than ``source``.
    """

    source: str
    model: Value
    data: Value
    prompts_per_step: Value
    group_size: Value
    max_response_len: Value
    lr: Value
    steps: Value
    clip: Value
    kl_coef: Value
    extra: Dict[str, Value] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)


@dataclass
class Claim:
    """The paper's headline claim as data.

    Attributes:
        summary: one sentence, the claim in words.
        metric: e.g. ``avg@32 accuracy``, ``greedy accuracy``, ``rollouts to reach X``.
        benchmark: where it was measured.
        baseline: what the method is compared against.
        value, baseline_value: the two reported figures (or a sentinel).
        delta: ``value - baseline_value`` as reported (or a sentinel).
        unit: ``points`` (accuracy x 100), ``x`` (a ratio), ``%``...
        source: section / table / figure that holds the numbers.
    """

    summary: str
    metric: str
    benchmark: str
    baseline: str
    value: Value
    baseline_value: Value
    delta: Value
    unit: str
    source: str


@dataclass
class Stage:
    """A run that must come before both arms: a method's first stage (ERPD's teacher, RC-GRPO's RCTP fine-tune).

    Attributes:
        recipe: the recipe the stage trains (one run per seed, same seed as the arms).
        overrides: Hydra overrides both arms get, where ``{final}`` stands for the stage run's
            ``final/`` weights directory (e.g. ``[model.teacher={final}]`` or
            ``[model.source=hf, model.path={final}]``); at least one must contain ``{final}``.
    """

    recipe: str
    overrides: List[str]


@dataclass
class CpuVariant:
    """How the CPU variant is checked against its baseline.

    Attributes:
        baseline: Hydra overrides that turn the recipe into its baseline arm
            (e.g. ``[selector=uniform]``), or ``"untrained"``: the same model
            before training (the method run's own ``eval_start.json``).
        expect: ``higher`` (the method beats the baseline) or ``no_worse``
            (efficiency claims: accuracy within ``margin`` of the baseline).
        margin: non-inferiority margin for ``no_worse``, in accuracy units (0.05 = 5 points).
        note: what differs from the paper's setting and why.
        after: a :class:`Stage` both arms start from (``rlpost reproduce`` trains it first), or none.
    """

    baseline: Union[str, List[str]]
    expect: str = "higher"
    margin: float = 0.0
    note: str = ""
    after: Optional[Stage] = None


@dataclass
class Card:
    """A recipe's record: the method, its paper, the paper setting, the claim and the CPU check."""

    method: str
    kind: str
    paper: str
    arxiv: Optional[str]
    code: Optional[str]
    paper_setting: PaperSetting
    claim: Claim
    cpu: CpuVariant
    gpu_recipe: Optional[str] = None


@dataclass
class LinkCard:
    """The card of a variant recipe (GPU deployment or agent setting): ``recipe_of`` names the method recipe
    holding claim and setting."""

    recipe_of: str


def link_card_note(name: str, card: LinkCard) -> str:
    """One line saying that recipe ``name`` has no claim of its own and whose claim it shares."""
    return (f"recipe {name} has no claim of its own: its card points to recipe {card.recipe_of} "
            f"(claim, paper setting, CPU baseline)")


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)`` with every key checked: unknown or missing fields are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with fields {', '.join(f.name for f in fields(cls))}, got {data!r}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        import difflib

        hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, list(names), n=1)) else repr(u)
                 for u in unknown]
        raise ConfigError(f"{where}: unknown field {', '.join(hints)}. Valid fields: {', '.join(names)}.")
    missing = [n for n in names if n not in data and _required(names[n])]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}; write \"{NOT_STATED}\" when the paper "
                          f"gives no value, \"{NOT_CHECKED}\" when nobody has read it yet.")
    return cls(**data)


def _stage(data: Any, where: str) -> Stage:
    """Build a card's ``cpu.after`` (:class:`Stage`), checking that its recipe exists and that it uses ``{final}``.

    Raises:
        ConfigError: unknown / missing fields, an unknown recipe, overrides that are not a list of
            ``key=value`` strings, or none that mentions ``{final}``.
    """
    st = _build(Stage, data, where)
    if st.recipe not in recipe_names():
        raise ConfigError(f"{where}.recipe={st.recipe!r}: no such recipe in {recipes_dir()} (rlpost recipes lists them)")
    ov = st.overrides
    if not (isinstance(ov, list) and ov and all(isinstance(o, str) and "=" in o for o in ov)):
        raise ConfigError(f"{where}.overrides={ov!r}: give a list of Hydra overrides, e.g. [model.teacher={{final}}]")
    if not any(FINAL in o for o in ov):
        raise ConfigError(f"{where}.overrides={ov!r}: none mentions {FINAL}, the stage run's weights; "
                          f"e.g. model.teacher={FINAL} or model.path={FINAL}")
    return st


def stage_overrides(stage: Stage, stage_dir: Path) -> List[str]:
    """``stage.overrides`` with ``{final}`` replaced by ``stage_dir/final`` (the stage run's weights)."""
    return [o.replace(FINAL, str(Path(stage_dir) / "final")) for o in stage.overrides]


def _required(f: Any) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING


def parse_card(data: Any, where: str = "card") -> Union[Card, LinkCard]:
    """Validate a recipe's ``card`` mapping and build it.

    Raises:
        ConfigError: unknown / missing fields (with the valid ones), a bad
            ``kind`` / ``expect``, a baseline that is neither a list of
            overrides nor ``"untrained"``, or a number cited without a source.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(data, (DictConfig, ListConfig)):
        data = OmegaConf.to_container(data, resolve=False)
    if isinstance(data, dict) and set(data) == {"recipe_of"}:
        return LinkCard(str(data["recipe_of"]))
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping (method, kind, paper, ...) or {{recipe_of: NAME}}, got {data!r}")
    d = dict(data)
    for key, cls in (("paper_setting", PaperSetting), ("claim", Claim), ("cpu", CpuVariant)):
        if key in d:
            d[key] = _build(cls, d[key], f"{where}.{key}")
    if isinstance(d.get("cpu"), CpuVariant) and d["cpu"].after is not None:
        d["cpu"].after = _stage(d["cpu"].after, f"{where}.cpu.after")
    card = _build(Card, d, where)
    if card.kind not in KINDS:
        raise ConfigError(f"{where}.kind={card.kind!r}: expected one of {', '.join(KINDS)}")
    if card.cpu.expect not in EXPECTS:
        raise ConfigError(f"{where}.cpu.expect={card.cpu.expect!r}: expected one of {', '.join(EXPECTS)}")
    b = card.cpu.baseline
    if not (b == UNTRAINED or (isinstance(b, list) and b and all(isinstance(o, str) and ("=" in o or o.startswith("~")) for o in b))):
        raise ConfigError(f"{where}.cpu.baseline={b!r}: give Hydra overrides for the baseline arm "
                          f"(e.g. [selector=uniform], or ~key to drop a method-only setting) or {UNTRAINED!r}")
    if not 0.0 <= float(card.cpu.margin) < 1.0:
        raise ConfigError(f"{where}.cpu.margin={card.cpu.margin!r}: an accuracy difference in [0, 1) (0.05 = 5 points)")
    problems = unsourced_numbers(card)
    if problems:
        raise ConfigError(f"{where}: {problems[0]}")
    return card


_CITATION = re.compile(r"arXiv:\d{4}\.\d{4,5}|https?://|\b(Table|Tab\.|Sec\.|Section|Fig\.|Figure|Eq\.|Appendix|abstract|"
                       r"README|docs/|config|script)\b", re.I)


def is_citation(text: Any) -> bool:
    """Whether ``text`` names a place a number can be checked: an arXiv id, a URL, a table/section/figure, a file."""
    return isinstance(text, str) and text not in SENTINELS and bool(_CITATION.search(text))


def _has_number(v: Any) -> bool:
    if isinstance(v, bool) or v is None:
        return False
    if isinstance(v, (int, float)):
        return True
    if isinstance(v, str):
        return v not in SENTINELS and bool(re.search(r"\d", v))
    if isinstance(v, (list, tuple)):
        return any(_has_number(x) for x in v)
    if isinstance(v, dict):
        return any(_has_number(x) for x in v.values())
    return False


def unsourced_numbers(card: Card) -> List[str]:
    """Cited numbers without a source: each problem as a sentence (empty: every number has one).

    A number in the paper setting needs ``paper_setting.sources[field]`` or
    ``paper_setting.source`` to be a citation (:func:`is_citation`); a number in
    the claim needs ``claim.source``. Sentinels need none.
    """
    out: List[str] = []
    ps = card.paper_setting
    for f in fields(PaperSetting):
        if f.name in ("source", "sources"):
            continue
        v = getattr(ps, f.name)
        items = v.items() if f.name == "extra" else [(f.name, v)]
        for name, val in items:
            src = ps.sources.get(name, ps.source)
            if _has_number(val) and not is_citation(src):
                out.append(f"paper_setting.{name}={val!r} has no source: set paper_setting.source or "
                           f"paper_setting.sources.{name} to the section/table/config it comes from")
    c = card.claim
    for name in ("value", "baseline_value", "delta"):
        if _has_number(getattr(c, name)) and not is_citation(c.source):
            out.append(f"claim.{name}={getattr(c, name)!r} has no source: set claim.source to the table/section")
    return out


def incomplete_fields(card: Card) -> List[str]:
    """Fields still ``"not checked"`` (nobody has read the source yet): ``["paper_setting.lr", ...]``."""
    out = [f"paper_setting.{f.name}" for f in fields(PaperSetting)
           if f.name not in ("source", "sources", "extra") and getattr(card.paper_setting, f.name) == NOT_CHECKED]
    out += [f"paper_setting.extra.{k}" for k, v in card.paper_setting.extra.items() if v == NOT_CHECKED]
    out += [f"claim.{f.name}" for f in fields(Claim) if getattr(card.claim, f.name) == NOT_CHECKED]
    return out


# --------------------------------------------------------------------------- loading


def recipes_dir() -> Path:
    """``recipes/`` beside the config tree (``conf/recipe`` links to it)."""

    return (conf_dir() / "recipe").resolve()


def results_dir() -> Path:
    """Where ``rlpost reproduce`` records results: ``recipes/results/``."""
    return recipes_dir() / "results"


@dataclass
class Recipe:
    """One recipe file: its name, path, one-line description and parsed card (None: no card)."""

    name: str
    path: Path
    description: str
    card: Union[Card, LinkCard, None]


def recipe_names() -> List[str]:
    """Every recipe, sorted."""

    return group_choices("recipe")


def load_recipe(name: str) -> Recipe:
    """Read ``recipes/NAME.yaml`` and validate its card (no Hydra composition).

    Raises:
        ConfigError: unknown recipe (the valid names listed) or an invalid card.
    """
    from omegaconf import OmegaConf

    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"Unknown recipe {name!r}. Recipes: {', '.join(recipe_names())}.")
    raw = OmegaConf.load(path)
    card = parse_card(raw["card"], f"recipe {name}: card") if "card" in raw else None
    desc = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("# @package"):
            continue
        if not s.startswith("#"):
            break
        desc += (" " if desc else "") + s.lstrip("#").strip()
        if desc.endswith((".", ")")):
            break
    return Recipe(name, path, desc, card)


def resolve_card(rec: Recipe) -> Optional[Card]:
    """The full card of ``rec``, following ``recipe_of`` once (None: no card)."""
    if isinstance(rec.card, LinkCard):
        target = load_recipe(rec.card.recipe_of)
        if not isinstance(target.card, Card):
            raise ConfigError(f"recipe {rec.name}: recipe_of={rec.card.recipe_of!r} has no full card")
        return target.card
    return rec.card


def load_result(name: str, directory: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    """The latest recorded reproduction of recipe ``name`` (None: never run)."""
    f = (directory or results_dir()) / f"{name}.json"
    if not f.is_file():
        return None
    runs = json.loads(f.read_text()).get("runs", [])
    return runs[-1] if runs else None


# --------------------------------------------------------------------------- verdict and power


def judge(ci_low: float, ci_high: float, expect: str = "higher", margin: float = 0.0) -> str:
    """Verdict on a difference (method - baseline) from its 95% CI.

    ``expect="higher"``: ``reproduced direction`` when the CI lies above 0,
    ``contradicted`` when it lies below 0, ``not resolved`` when it spans 0.
    ``expect="no_worse"`` (non-inferiority): ``reproduced direction`` when the CI
    lies above ``-margin``, ``contradicted`` when it lies below ``-margin``,
    else ``not resolved``.

    Raises:
        ConfigError: unknown ``expect`` or ``ci_low > ci_high``.
    """
    if expect not in EXPECTS:
        raise ConfigError(f"expect={expect!r}: one of {', '.join(EXPECTS)}")
    if ci_low > ci_high:
        raise ConfigError(f"CI [{ci_low}, {ci_high}] is empty (low > high)")
    bar = 0.0 if expect == "higher" else -abs(margin)
    if ci_low > bar:
        return VERDICTS[0]
    if ci_high < bar:
        return VERDICTS[2]
    return VERDICTS[1]


def variance_components(diffs: np.ndarray) -> Dict[str, float]:
    """Two-way random-effects variance components of a ``[S, P]`` matrix of paired differences.

    ``d[s, p] = mu + a_s + b_p + e_sp`` (seed effect, problem effect, residual),
    estimated by the ANOVA method of moments: ``var_e`` from the interaction mean
    square, ``var_seed = max(0, var(seed means) - var_e / P)``, ``var_problem =
    max(0, var(problem means) - var_e / S)``. With one seed (or one problem) that
    component cannot be estimated and is NaN.

    Returns:
        ``{"mean", "var_seed", "var_problem", "var_resid", "S", "P"}``.
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ConfigError(f"variance_components needs a non-empty [seeds, problems] array, got shape {d.shape}")
    S, P = d.shape
    m_s, m_p, mu = d.mean(axis=1), d.mean(axis=0), d.mean()
    if S > 1 and P > 1:
        r = d - m_s[:, None] - m_p[None, :] + mu
        var_e = float((r ** 2).sum() / ((S - 1) * (P - 1)))
    else:
        var_e = float("nan")
    nan = float("nan")
    var_seed = max(0.0, float(m_s.var(ddof=1)) - (var_e / P if S > 1 and P > 1 else 0.0)) if S > 1 else nan
    var_prob = max(0.0, float(m_p.var(ddof=1)) - (var_e / S if S > 1 and P > 1 else 0.0)) if P > 1 else nan
    return {"mean": float(mu), "var_seed": var_seed, "var_problem": var_prob, "var_resid": var_e, "S": S, "P": P}


def seeds_to_resolve(
    diffs: np.ndarray, effect: Optional[float] = None, alpha: float = 0.05, power: float = 0.8, max_seeds: int = 1000
) -> Dict[str, Any]:
    """Seeds a matched study needs for its 95% CI to exclude 0 with probability ``power``.

    With ``P`` problems held fixed, the variance of the mean difference over ``S'``
    seeds is ``var_seed / S' + var_problem / P + var_resid / (S' P)``
    (:func:`variance_components`). The study resolves an effect ``delta`` when
    ``|delta| >= (z_{1-alpha/2} + z_{power}) * se(S')``; the smallest such ``S'``
    is returned. The problem term does not shrink with seeds: when it alone is
    too large, no number of seeds resolves ``delta`` on these ``P`` problems
    and the answer says how many problems would (with seeds at the
    ``var_seed`` floor, i.e. infinitely many). The standard normal-approximation
    sample-size formula (e.g. Cohen, "Statistical Power Analysis for the
    Behavioral Sciences", 1988); the two-way decomposition is our choice, to
    match the two-way bootstrap of :func:`rlpost.eval.stats.paired_bootstrap`.

    Args:
        diffs: ``[S, P]`` paired differences (method - baseline), ``S >= 2``.
        effect: the difference to resolve (default: the observed mean).
    Returns:
        ``{"seeds": int or None, "reason": str, "effect", "var_seed", "var_problem", "var_resid"}``;
        ``seeds`` is None when one seed gives no seed variance, the effect is 0,
        or seeds alone cannot resolve it (``reason`` says which, and
        ``"problems"`` then holds the problems needed at unlimited seeds, or None).
    """
    vc = variance_components(diffs)
    S, P = vc["S"], vc["P"]
    delta = vc["mean"] if effect is None else float(effect)
    out: Dict[str, Any] = {"effect": delta, **{k: vc[k] for k in ("var_seed", "var_problem", "var_resid")}}
    if S < 2:
        return {**out, "seeds": None, "reason": "one seed gives no seed-to-seed variance; run at least 2 seeds"}
    if delta == 0.0:
        return {**out, "seeds": None, "reason": "the observed difference is exactly 0: no number of seeds resolves it"}
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    target_var = (abs(delta) / z) ** 2
    vs, vp, ve = vc["var_seed"], vc["var_problem"], (0.0 if math.isnan(vc["var_resid"]) else vc["var_resid"])
    floor = vp / P
    if floor >= target_var:
        # more problems: var_problem / P' < target (seeds unlimited)
        need_p = math.ceil(vp / target_var) + 1 if target_var > 0 else None
        return {**out, "seeds": None, "problems": need_p,
                "reason": f"the problem-to-problem variance alone exceeds what a {abs(delta):.3f} difference allows on "
                          f"{P} problems; more seeds cannot resolve it, about {need_p} problems could"}
    per_seed = vs + ve / P
    need = max(2, math.ceil(per_seed / (target_var - floor))) if per_seed > 0 else 2
    if need > max_seeds:
        return {**out, "seeds": None, "reason": f"more than {max_seeds} seeds"}
    return {**out, "seeds": need, "reason": f"{need} seeds resolve a {abs(delta):.3f} difference with {power:.0%} power"}


# --------------------------------------------------------------------------- reproduce


METRIC_RE = re.compile(r"^(pass|maj|mean)@([1-9][0-9]*)$")


def metric_overrides(metric: str, extra: Sequence[str] = ()) -> List[str]:
    """Evaluation overrides that make every arm's ``eval.json`` hold ``metric`` per problem.

    ``correct`` (greedy accuracy) needs none. ``pass@k`` and ``maj@k`` need ``k``
    samples per problem and ``k`` in ``eval.ks``; ``mean@n`` needs ``n`` samples.
    Sampling uses ``eval.temperature`` (1.0 unless ``extra`` sets it). Settings that
    ``extra`` already gives are left to it, so ``--metric pass@4 eval.n_samples=16``
    estimates pass@4 from 16 samples (the unbiased estimator of "Evaluating Large
    Language Models Trained on Code", arXiv:2107.03374).

    Returns:
        overrides to put before ``extra`` (empty for ``correct``).
    Raises:
        ConfigError: an unknown metric, or ``eval.n_samples`` in ``extra`` below k.
    """
    if metric == "correct":
        return []
    m = METRIC_RE.match(metric)
    if m is None:
        raise ConfigError(f"--metric {metric!r}: give correct (greedy accuracy), pass@K, maj@K or mean@N, e.g. pass@4")
    kind, k = m.group(1), int(m.group(2))
    given = {e.split("=", 1)[0].lstrip("+"): e.split("=", 1)[1] for e in extra if "=" in e}
    out: List[str] = []
    if "eval.n_samples" in given:
        try:
            n = int(given["eval.n_samples"])
        except ValueError:
            raise ConfigError(f"eval.n_samples={given['eval.n_samples']!r} is not an integer") from None
        if n < k or (kind == "mean" and n != k):
            need = f"eval.n_samples={k}" if kind == "mean" else f"eval.n_samples>={k}"
            raise ConfigError(f"--metric {metric} with eval.n_samples={n}: set {need} (or drop it; reproduce sets it)")
    else:
        out.append(f"eval.n_samples={k}")
    if kind != "mean" and "eval.ks" not in given:
        out.append(f"eval.ks=[{k}]")
    return out


def arm_overrides(name: str, card: Card, seed: int, extra: Sequence[str], metric: str = "correct",
                  stage_dir: Optional[Path] = None) -> Dict[str, List[str]]:
    """Hydra overrides of the runs of ``name`` for one seed: ``{"method": [...], "baseline": [...] or []}``,
    plus ``"stage": [...]`` when the card has ``cpu.after``.

    ``extra`` (the command line's budget overrides, e.g. ``steps=10 eval.limit=50``)
    goes to every run, after the recipe and the evaluation settings ``metric``
    needs (:func:`metric_overrides`); the baseline's own overrides come last.
    The untrained baseline needs no run (``[]``): the method run evaluates before
    its first step. With ``cpu.after`` (a :class:`Stage`) both arms also get the
    stage's overrides, ``{final}`` replaced by ``stage_dir/final``; the stage run
    itself only trains (no evaluation).

    Raises:
        ConfigError: from :func:`metric_overrides`; ``cpu.after`` without ``stage_dir``.
    """
    common = [f"+recipe={name}", f"seed={seed}", "logger=jsonl", "checkpoint.every=0", "eval.at_end=true"]
    common += metric_overrides(metric, extra)
    stage: List[str] = []
    if card.cpu.after is not None:
        if stage_dir is None:
            raise ConfigError(f"recipe {name} starts from the stage {card.cpu.after.recipe}: give its run directory")
        common += stage_overrides(card.cpu.after, stage_dir)
        stage = [f"+recipe={card.cpu.after.recipe}", f"seed={seed}", "logger=jsonl", "checkpoint.every=0",
                 "eval.at_start=false", "eval.at_end=false", *extra]
    untrained = card.cpu.baseline == UNTRAINED
    method = common + [f"eval.at_start={'true' if untrained else 'false'}"] + list(extra)
    base = [] if untrained else common + ["eval.at_start=false"] + list(extra) + list(card.cpu.baseline)
    return {"stage": stage, "method": method, "baseline": base} if stage else {"method": method, "baseline": base}


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:  # noqa: BLE001 - provenance only
        return None


def steps_with_gradient(run_dir: Path) -> Optional[int]:
    """Steps of the run in ``run_dir`` whose update had a non-zero gradient (``actor/grad_norm > 0``
    in ``metrics.jsonl``); None when the run left no such metric (a run not trained by rlpost here)."""
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        return None
    seen, n = False, 0
    for line in f.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        g = d.get("actor/grad_norm") if isinstance(d, dict) else None
        if isinstance(g, (int, float)):
            seen = True
            n += int(math.isfinite(g) and g > 0)
    return n if seen else None


def summarize(name: str, card: Card, method_runs: List[Path], base_evals: List[Path], seeds: Sequence[int],
              n_boot: int = 2000, metric: str = "correct") -> Dict[str, Any]:
    """Paired comparison of the two arms' held-out evaluations and the verdict (no training).

    Args:
        method_runs: the method's run directories (``eval.json``), one per seed.
        base_evals: the baseline's ``eval.json`` (or the method runs' ``eval_start.json``), one per seed.
        metric: the per-problem figure compared: ``correct`` (greedy accuracy) or
            ``pass@k`` / ``maj@k`` / ``mean@n`` (the evaluations must hold it).
    Returns:
        The record written to ``recipes/results/NAME.json``: per-seed accuracies,
        ``diff``, ``ci_low``, ``ci_high``, ``p_value``, ``verdict``, ``power``.
    """

    a = [load_run(p, metric) for p in base_evals]
    b = [load_run(p, metric) for p in method_runs]
    for runs in (a, b):
        for r, s in zip(runs, seeds):
            r.seed = s
    cmp = compare_methods(a, b, "baseline", card.method, n_boot=n_boot)
    st = cmp["overall"]
    task = sorted(cmp["tasks"])[0]
    common = sorted(set.intersection(*[set(r.scores[task]) for r in a + b]))
    A = np.array([[r.scores[task][i][1] for i in common] for r in a])
    B = np.array([[r.scores[task][i][1] for i in common] for r in b])
    verdict = judge(st["ci_low"], st["ci_high"], card.cpu.expect, card.cpu.margin)
    rec: Dict[str, Any] = {
        "recipe": name, "method": card.method, "baseline": card.cpu.baseline, "expect": card.cpu.expect,
        "margin": card.cpu.margin, "task": task, "metric": metric, "seeds": list(seeds), "n_problems": len(common),
        "acc_method": [float(x) for x in B.mean(axis=1)], "acc_baseline": [float(x) for x in A.mean(axis=1)],
        "mean_method": float(B.mean()), "mean_baseline": float(A.mean()),
        "diff": st["diff"], "ci_low": st["ci_low"], "ci_high": st["ci_high"], "p_value": st["p_value"],
        "verdict": verdict,
    }
    grads = [steps_with_gradient(p) for p in method_runs]
    if grads and all(g == 0 for g in grads):  # the method never updated: the arms compare starting checkpoints
        verdict = rec["verdict"] = VERDICTS[1]
        rec["caveat"] = ("the method arm never updated (every step's gradient was 0 in every seed, e.g. no reward "
                         "signal), so the comparison tests the starting checkpoint, not the method; verdict held at "
                         "'not resolved'")
    if verdict == VERDICTS[1]:  # distance to the bar the CI must clear: 0, or -margin for no_worse
        shift = abs(card.cpu.margin) if card.cpu.expect == "no_worse" else 0.0
        rec["power"] = seeds_to_resolve(B - A + shift)
    return rec


_METRIC_NAMES = {"correct": "greedy accuracy"}


def format_result(rec: Dict[str, Any]) -> str:
    """The report of one reproduction, a few lines."""
    base = rec["baseline"] if isinstance(rec["baseline"], str) else " ".join(rec["baseline"])
    lines = [
        f"{rec['recipe']}: {rec['method']} vs baseline ({base}), held-out {rec['task']} "
        f"{_METRIC_NAMES.get(rec.get('metric', 'correct'), rec.get('metric'))}, "
        f"{len(rec['seeds'])} matched seed(s) {rec['seeds']} x {rec['n_problems']} problems",
        "  per seed: " + ", ".join(f"seed {s}: {100 * m:.1f}% vs {100 * b:.1f}%"
                                   for s, m, b in zip(rec["seeds"], rec["acc_method"], rec["acc_baseline"])),
        f"  mean {100 * rec['mean_method']:.1f}% vs {100 * rec['mean_baseline']:.1f}%: difference "
        f"{100 * rec['diff']:+.1f} points [95% CI {100 * rec['ci_low']:+.1f}, {100 * rec['ci_high']:+.1f}], "
        f"p={rec['p_value']:.3f}",
        f"  verdict: {rec['verdict']}" + (f" (non-inferiority margin {100 * rec['margin']:.0f} points)"
                                          if rec["expect"] == "no_worse" else ""),
    ]
    if "caveat" in rec:
        lines.append(f"  caveat: {rec['caveat']}")
    if "power" in rec:
        pw = rec["power"]
        lines.append(f"  power: {pw['reason']}" + (f" (need {pw['seeds']} seeds)" if pw.get("seeds") else ""))
    if "wall_s" in rec:
        lines.append(f"  wall time {rec['wall_s']:.0f} s for this call, {rec.get('train_wall_s', 0.0):.0f} s in the runs' "
                     f"training and evaluation (finished runs are reused); budget: "
                     f"{' '.join(rec.get('budget', [])) or 'the recipe as written'}")
    return "\n".join(lines)


def record_result(rec: Dict[str, Any], directory: Optional[Path] = None) -> Path:
    """Append ``rec`` to ``recipes/results/NAME.json`` (``{"runs": [...]}``, newest last)."""
    d = directory or results_dir()
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{rec['recipe']}.json"
    data = json.loads(f.read_text()) if f.is_file() else {"recipe": rec["recipe"], "runs": []}
    data["runs"].append(rec)
    f.write_text(json.dumps(data, indent=1) + "\n")
    return f


def reproduce(name: str, seeds: int = 3, extra: Sequence[str] = (), out: Optional[Path] = None,
              record_dir: Optional[Path] = None, record: bool = True, first_seed: int = 0,
              keep_weights: bool = False, log: Any = print, metric: str = "correct") -> Dict[str, Any]:
    """Train recipe ``name``'s CPU variant and its baseline on ``seeds`` matched seeds and judge the claim.

    Each arm runs through :func:`rlpost.run.runner.train` with seed ``first_seed + i``
    (the same seed gives both arms the same data order and the same held-out
    problems). Finished runs (``DONE``) under ``out`` are reused, so an
    interrupted reproduction continues. Trained weights are deleted afterwards
    unless ``keep_weights`` (the evaluations stay). ``metric`` is the compared
    per-problem figure (``correct``, ``pass@k``, ``maj@k``, ``mean@n``); both arms
    evaluate with the samples it needs (:func:`metric_overrides`). A card with
    ``cpu.after`` (:class:`Stage`) first trains that stage recipe per seed under
    ``out/stage/seedS``; both arms start from its ``final/`` (kept until both have run).

    Raises:
        ConfigError: unknown recipe, no card, a variant recipe (``recipe_of``: reproduce
            its method recipe), or an unknown ``metric``.
    """

    rec = load_recipe(name)
    if rec.card is None:
        raise ConfigError(f"recipe {name} has no card (claim, baseline); add one (docs/RECIPES.md) to reproduce it")
    if isinstance(rec.card, LinkCard):
        raise ConfigError(link_card_note(name, rec.card) + f"; reproduce that one: rlpost reproduce {rec.card.recipe_of}")
    card = rec.card
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: give at least 1 (2 or more for a CI that covers seed variance)")
    root = Path(out) if out else Path("outputs") / "reproduce" / name
    seed_list = [first_seed + i for i in range(seeds)]
    plan = {s: arm_overrides(name, card, s, extra, metric, stage_dir=root / "stage" / f"seed{s}") for s in seed_list}
    for s in seed_list:  # fail before any training on a bad override
        later = set(stage_overrides(card.cpu.after, root / "stage" / f"seed{s}")) if card.cpu.after else set()
        for ov in plan[s].values():  # the stage's weights do not exist yet: the arms are checked without them
            if ov:
                validate_config(compose_config([o for o in ov if o not in later]))
    t0 = time.perf_counter()
    method_runs, base_evals = [], []
    for s in seed_list:
        for arm in ("stage", "method", "baseline"):  # the stage (cpu.after) first: both arms start from its weights
            ov = plan[s].get(arm)
            if not ov:
                continue
            d = root / arm / f"seed{s}"
            if not (d / DONE_MARKER).exists():
                if d.exists():
                    shutil.rmtree(d)
                log(f"[{name}] {arm} seed {s}: training ({' '.join(ov[1:])})")
                t = time.perf_counter()
                train(compose_config(ov), d)
                (d / "wall_s.txt").write_text(f"{time.perf_counter() - t:.1f}\n")
                if not keep_weights:
                    for sub in ("final", "checkpoints") if arm != "stage" else ("checkpoints",):
                        shutil.rmtree(d / sub, ignore_errors=True)
            else:
                log(f"[{name}] {arm} seed {s}: reusing the finished run in {d}")
        if "stage" in plan[s] and not keep_weights and all(
                (root / a / f"seed{s}" / DONE_MARKER).exists() for a in ("method", "baseline") if plan[s][a]):
            shutil.rmtree(root / "stage" / f"seed{s}" / "final", ignore_errors=True)  # both arms have used it
        method_runs.append(root / "method" / f"seed{s}")
        base_evals.append(root / "method" / f"seed{s}" / "eval_start.json" if card.cpu.baseline == UNTRAINED
                          else root / "baseline" / f"seed{s}")
    result = summarize(name, card, method_runs, base_evals, seed_list, metric=metric)
    run_walls = [float((p / "wall_s.txt").read_text()) for p in method_runs + [Path(b) for b in base_evals]
                 if (Path(p) / "wall_s.txt").is_file()]
    result.update({
        "budget": list(extra), "wall_s": time.perf_counter() - t0, "train_wall_s": sum(run_walls), "run_walls": run_walls,
        "runs_dir": str(root), "commit": _git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"rlpost reproduce {name} --seeds {seeds}" + (f" --metric {metric}" if metric != "correct" else "")
                   + (f" {' '.join(extra)}" if extra else ""),
    })
    if record:
        result["record"] = str(record_result(result, record_dir))
    return result


# --------------------------------------------------------------------------- listing


def claim_text(card: Card) -> str:
    """The claim in one line: ``delta unit metric on benchmark vs baseline (source)``.

    A part still ``not checked`` or ``not stated`` is left out of the sentence and named at its
    end in words (``figures, benchmark and source not yet read from the paper``), never printed
    in its place ("accuracy on not checked vs ..." read as if "not checked" were a benchmark).
    """
    c = card.claim
    unread, unstated = [], []

    def known(v: Any, what: str) -> bool:
        if v == NOT_CHECKED:
            unread.append(what)
        elif v == NOT_STATED:
            unstated.append(what)
        return v not in SENTINELS and v not in (None, "")

    fig = ""
    if isinstance(c.delta, (int, float)):
        fig = f"{c.delta:+g} {c.unit}"
    elif isinstance(c.value, (int, float)):
        fig = f"{c.value:g} {c.unit}" + (f" vs {c.baseline_value:g}" if isinstance(c.baseline_value, (int, float)) else "")
    elif isinstance(c.value, str) and c.value not in SENTINELS:
        fig = c.value
    elif c.delta not in SENTINELS and c.delta is not None:
        fig = str(c.delta)
    else:
        known(c.value if c.value in SENTINELS else c.delta, "figures")
    head = " ".join(x for x in (fig, c.metric if known(c.metric, "metric") else "") if x) or "a result"
    if known(c.benchmark, "benchmark"):
        head += f" on {c.benchmark}"
    if known(c.baseline, "baseline"):
        head += f" vs {c.baseline}"
    if known(c.source, "source"):
        head += f" ({c.source})"
    notes = [f"{_and(unread)} not yet read from the paper" if unread else "",
             f"{_and(unstated)} not stated in the paper" if unstated else ""]
    return "; ".join([head] + [n for n in notes if n])


def _and(words: List[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def status_text(res: Optional[Dict[str, Any]]) -> str:
    """``not run`` or ``verdict: +d [lo, hi], N seeds``."""
    if res is None:
        return "not run"
    return (f"{res['verdict']}: {100 * res['diff']:+.1f} pts [{100 * res['ci_low']:+.1f}, {100 * res['ci_high']:+.1f}], "
            f"{len(res['seeds'])} seeds")


def table_rows(names: Optional[Sequence[str]] = None) -> List[Tuple[str, str, str, str]]:
    """``(recipe, kind/method, claim, reproduced status)`` per recipe."""
    rows = []
    for n in names or recipe_names():
        r = load_recipe(n)
        if r.card is None:
            rows.append((n, "-", "no card", "-"))
        elif isinstance(r.card, LinkCard):
            rows.append((n, "variant", f"recipe {r.card.recipe_of}'s (rlpost recipes {r.card.recipe_of})", f"see {r.card.recipe_of}"))
        else:
            rows.append((n, f"{r.card.kind}={r.card.method}", claim_text(r.card), status_text(load_result(n))))
    return rows


def markdown_table(names: Optional[Sequence[str]] = None, directory: Optional[Path] = None) -> str:
    """The recipes as a Markdown table (docs/RECIPES.md): paper, claim, setting fields read, CPU check, status.

    The status column comes from ``recipes/results/NAME.json`` (real ``rlpost reproduce`` runs).
    """
    out = ["| recipe | kind | paper | claim (source) | paper setting read | CPU baseline | reproduced here |",
           "|---|---|---|---|---|---|---|"]
    n_fields = len([f for f in fields(PaperSetting) if f.name not in ("source", "sources", "extra")])
    for n in names or recipe_names():
        r = load_recipe(n)
        if not isinstance(r.card, Card):
            if isinstance(r.card, LinkCard):
                out.append(f"| `{n}` | variant | see `{r.card.recipe_of}` | | | | |")
            continue
        c = r.card
        ref = f"arXiv:{c.arxiv}" if c.arxiv else (c.code or "")
        unread = sum(1 for x in incomplete_fields(c) if x.startswith("paper_setting.") and ".extra." not in x)
        base = c.cpu.baseline if isinstance(c.cpu.baseline, str) else " ".join(f"`{o}`" for o in c.cpu.baseline)
        if c.cpu.expect == "no_worse":
            base += f" (no worse by {100 * c.cpu.margin:.0f} pts)"
        claim = (claim_text(c) if c.claim.source not in SENTINELS
                 else f"{c.claim.summary} (figures and source not yet read from the paper)")
        out.append(f"| `{n}` | {c.kind} | {c.paper.split(':')[0]} ({ref}) | {claim} | {n_fields - unread}/{n_fields} | "
                   f"{base} | {status_text(load_result(n, directory))} |")
    return "\n".join(out)


def check_card_config(cfg: Any) -> None:
    """A recipe's ``card``: every field known, every cited number sourced (:func:`parse_card`).

    Raises:
        ConfigError: as :func:`parse_card`.
    """
    if cfg.get("card") is not None:
        parse_card(cfg.card, "card")
