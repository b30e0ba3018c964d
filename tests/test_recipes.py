"""Recipes (rlpost/experiments/recipes.py): cards, composition, the verdict, the power estimate, `rlpost reproduce`.

What runs where: every recipe composes through `rlpost config`, and its baseline arm composes and
validates; the CPU variants of a cover of the recipes (every sampler, selector, environment, task,
executor, correction and other non-numeric choice some recipe makes, trained in at least one) plus a
fixed-seed sample of the rest train 2 steps on model=tiny (:func:`trained_variants`).
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rlpost.experiments import recipes as R
from rlpost.core.errors import ConfigError, DataError

NAMES = R.recipe_names()
# short runs: the tiny random model, few tokens, few held-out problems; group sizes stay the recipe's own
TINY_RUN = ["model=tiny", "rollout.max_new_tokens=8", "eval.limit=4", "eval.max_new_tokens=8",
            "task.train_size=64", "task.eval_size=16", "trainer.micro_batch_size=8", "steps=2"]


def _card(name: str) -> R.Card:
    card = R.resolve_card(R.load_recipe(name))
    assert isinstance(card, R.Card), name
    return card


# --------------------------------------------------------------------------- composition


# recipes that need a local checkpoint no package ships: the setting, given a tiny one here
NEEDS_CHECKPOINT = {"scope": "sampler.params.prm_model_path"}


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_and_its_baseline_arm_compose(name, tmp_path):
    """``rlpost config +recipe=NAME`` prints the effective parameters, and the card's baseline arm (its CPU
    baseline overrides on top of the recipe) composes and validates: one test per recipe, so the ~150
    compositions spread over the workers."""
    from rlpost.cli import app
    from rlpost.config.compose import compose_config, validate_config

    extra = []
    if name in NEEDS_CHECKPOINT:
        from test_reward_models import _tiny_classifier

        bare = CliRunner().invoke(app, ["config", f"+recipe={name}", "logger=none"])
        assert bare.exit_code != 0 and NEEDS_CHECKPOINT[name] in bare.output, bare.output  # names the missing setting
        extra = [f"{NEEDS_CHECKPOINT[name]}={_tiny_classifier(tmp_path, token=True)}"]
    r = CliRunner().invoke(app, ["config", f"+recipe={name}", "logger=none", *extra])
    assert r.exit_code == 0, r.output
    assert "# effective component parameters" in r.output
    rec = R.load_recipe(name)
    if isinstance(rec.card, R.Card) and rec.card.cpu.baseline != R.UNTRAINED:
        validate_config(compose_config([f"+recipe={name}", "logger=none", *rec.card.cpu.baseline]))


def test_most_recipes_have_a_trained_baseline_arm():
    """The baseline arms the test above composes: at least 50 recipes compare against a trained baseline."""
    cards = [R.load_recipe(n).card for n in NAMES]
    assert sum(isinstance(c, R.Card) and c.cpu.baseline != R.UNTRAINED for c in cards) >= 50


# --------------------------------------------------------------------------- cards


def test_every_recipe_has_a_complete_card_and_every_number_a_source():
    for name in NAMES:
        rec = R.load_recipe(name)
        assert rec.card is not None, f"recipe {name} has no card"
        card = R.resolve_card(rec)
        assert card.paper and (card.arxiv or card.code), name
        assert card.claim.summary and card.claim.metric and card.claim.baseline, name
        assert R.unsourced_numbers(card) == [], name
        if card.arxiv:
            assert len(card.arxiv.split(".")[0]) == 4, name
        if card.gpu_recipe:
            assert card.gpu_recipe in NAMES


def test_every_method_from_a_paper_has_a_recipe():
    """Each algo preset, selector, sampler and correction that comes from a paper has a recipe for it."""
    import rlpost.algos  # noqa: F401
    import rlpost.samplers  # noqa: F401
    import rlpost.selectors  # noqa: F401
    from rlpost.algos.corrections import CORRECTIONS
    from rlpost.config.compose import group_choices

    covered = {(c.kind, c.method) for c in (R.load_recipe(n).card for n in NAMES) if isinstance(c, R.Card)}
    not_papers = {("algo", "sft"), ("selector", "uniform"), ("sampler", "group"), ("sampler", "single"),
                  ("sampler", "episode"), ("correction", "none")}
    want = {("algo", a) for a in group_choices("algo")} | {("selector", s) for s in group_choices("selector")}
    want |= {("sampler", s) for s in group_choices("sampler")} | {("correction", c.name) for c in CORRECTIONS}
    want |= {("executor", "async"), ("executor", "partial_rollout")}
    # the default recipe covers GRPO's own claim under kind=baseline; grpo.yaml covers the paper
    missing = sorted(want - not_papers - covered)
    assert missing == []


def test_the_paper_settings_that_were_read_hold_their_sources():
    dapo = _card("dapo")
    assert dapo.paper_setting.group_size == 16 and dapo.paper_setting.prompts_per_step == 512
    assert dapo.paper_setting.lr == 1e-6 and "0.28" in dapo.paper_setting.clip
    assert "run_dapo_qwen2.5_32b.sh" in dapo.paper_setting.source
    grpo = _card("grpo")
    assert (grpo.claim.value, grpo.claim.baseline_value, grpo.claim.delta) == (51.7, 46.8, 4.9)
    assert math.isclose(grpo.claim.value - grpo.claim.baseline_value, grpo.claim.delta)
    assert R.is_citation(grpo.claim.source)
    # the deployment recipe reads its claim from the method recipe
    assert R.resolve_card(R.load_recipe("dapo_qwen2.5_32b")) == dapo


def _good_card():
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(R.recipes_dir() / "grpo.yaml")["card"])


def test_misspelt_card_field_is_an_error_naming_the_valid_one():
    d = _good_card()
    d["claim"]["vaule"] = d["claim"].pop("value")
    with pytest.raises(ConfigError, match=r"unknown field 'vaule' \(did you mean 'value'\?\)"):
        R.parse_card(d)
    d = _good_card()
    del d["paper_setting"]["lr"]
    with pytest.raises(ConfigError, match=r"missing field\(s\) lr.*not stated"):
        R.parse_card(d)
    d = _good_card()
    d["cpu"]["expect"] = "better"
    with pytest.raises(ConfigError, match="higher, no_worse"):
        R.parse_card(d)
    d = _good_card()
    d["cpu"]["baseline"] = ["uniform"]
    with pytest.raises(ConfigError, match="untrained"):
        R.parse_card(d)


def test_a_number_without_a_source_is_an_error():
    d = _good_card()
    d["claim"]["source"] = "we remember it"
    with pytest.raises(ConfigError, match="claim.value=51.7 has no source"):
        R.parse_card(d)
    d = _good_card()
    d["paper_setting"]["source"] = R.NOT_CHECKED
    with pytest.raises(ConfigError, match="paper_setting.model"):  # "DeepSeekMath-Instruct 7B" holds a number
        R.parse_card(d)
    d["paper_setting"]["sources"] = {k: "arXiv:2402.03300 Sec. 4.2" for k in
                                     ("model", "data", "prompts_per_step", "group_size", "max_response_len", "lr",
                                      "kl_coef", "policy_updates_per_exploration", "reward_model_lr")}
    assert isinstance(R.parse_card(d), R.Card)  # per-field sources suffice


def test_misspelt_card_field_exits_2_from_the_cli():
    from rlpost.cli import app

    r = CliRunner().invoke(app, ["config", "+recipe=vade", "+card.claim.metrc=x"])
    assert r.exit_code == 2 and "unknown field 'metrc'" in r.output


# --------------------------------------------------------------------------- verdict and power


def test_judge_on_hand_made_intervals():
    assert R.judge(0.01, 0.20) == "reproduced direction"
    assert R.judge(-0.05, 0.20) == "not resolved"
    assert R.judge(-0.20, -0.01) == "contradicted"
    assert R.judge(0.0, 0.1) == "not resolved"  # touching 0 is not excluding it
    # non-inferiority with a 5-point margin
    assert R.judge(-0.04, 0.02, "no_worse", 0.05) == "reproduced direction"
    assert R.judge(-0.08, 0.02, "no_worse", 0.05) == "not resolved"
    assert R.judge(-0.12, -0.06, "no_worse", 0.05) == "contradicted"
    with pytest.raises(ConfigError):
        R.judge(0.2, 0.1)


def test_variance_components_by_hand():
    # seed effect only: seed means 0.1 and 0.3 (var 0.02), no problem effect, no residual
    d = np.array([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
    vc = R.variance_components(d)
    assert math.isclose(vc["mean"], 0.2) and math.isclose(vc["var_seed"], 0.02)
    assert vc["var_problem"] == 0.0 and math.isclose(vc["var_resid"], 0.0, abs_tol=1e-15)
    # a 2x2 with interaction: d = [[1, 0], [0, 1]]: seed and problem means all 0.5, residual MS = 1
    vc = R.variance_components(np.array([[1.0, 0.0], [0.0, 1.0]]))
    assert math.isclose(vc["var_resid"], 1.0) and vc["var_seed"] == 0.0 and vc["var_problem"] == 0.0


def test_seeds_to_resolve_by_hand():
    z = 1.959964 + 0.841621  # z_{0.975} + z_{0.8}
    target = (0.2 / z) ** 2  # 0.0050963
    res = R.seeds_to_resolve(np.array([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]]))
    assert res["seeds"] == math.ceil(0.02 / target) == 4
    # problem-to-problem variance alone too large on 2 problems: seeds cannot help, ~17 problems would
    res = R.seeds_to_resolve(np.array([[0.0, 0.4], [0.0, 0.4]]))
    assert res["seeds"] is None and res["problems"] == math.ceil(0.08 / target) + 1 == 17
    assert "more seeds cannot resolve" in res["reason"]
    res = R.seeds_to_resolve(np.array([[0.1, 0.3]]))
    assert res["seeds"] is None and "one seed" in res["reason"]
    assert R.seeds_to_resolve(np.zeros((3, 4)))["seeds"] is None
    # a smaller effect needs more seeds (the seed term scales as 1/S)
    d = np.array([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
    assert R.seeds_to_resolve(d, effect=0.1)["seeds"] == math.ceil(0.02 / (0.1 / z) ** 2) == 16


def _eval_file(path: Path, scores, seed: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    recs = [{"index": i, "question": f"q{i}", "correct": float(s)} for i, s in enumerate(scores)]
    (path / "eval.json").write_text(json.dumps({"task": "arithmetic", "seed": seed, "records": recs}))


def test_summarize_pairs_seeds_and_problems_and_records(tmp_path):
    card = _card("vade")
    m, b = [], []
    base = [[1, 0, 0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1, 0, 0]]
    meth = [[1, 1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 0, 1, 1, 1, 0]]
    for s in (0, 1):
        _eval_file(tmp_path / "b" / str(s), base[s], s)
        _eval_file(tmp_path / "m" / str(s), meth[s], s)
        m.append(tmp_path / "m" / str(s))
        b.append(tmp_path / "b" / str(s))
    rec = R.summarize("vade", card, m, b, [0, 1])
    assert rec["acc_baseline"] == [0.25, 0.25] and rec["acc_method"] == [0.75, 0.75]
    assert math.isclose(rec["diff"], 0.5) and rec["verdict"] == "reproduced direction"
    assert rec["ci_low"] > 0
    f = R.record_result({**rec, "recipe": "vade"}, tmp_path / "results")
    assert json.loads(f.read_text())["runs"][-1]["diff"] == rec["diff"]
    assert R.load_result("vade", tmp_path / "results")["verdict"] == "reproduced direction"
    assert "reproduced direction: +50.0 pts" in R.status_text(rec)


def test_a_method_arm_that_never_updated_is_not_resolved(tmp_path):
    """RC-GRPO from a weak stage 1 had reward 0 and gradient 0 on every step: equal accuracies are no evidence."""
    card = _card("vade")
    m, b = [], []
    for s in (0, 1):
        _eval_file(tmp_path / "b" / str(s), [1, 0, 0, 0], s)
        _eval_file(tmp_path / "m" / str(s), [1, 1, 1, 1], s)
        m.append(tmp_path / "m" / str(s))
        b.append(tmp_path / "b" / str(s))
    assert R.steps_with_gradient(m[0]) is None  # no metrics.jsonl: nothing known, the verdict stands
    assert R.summarize("vade", card, m, b, [0, 1])["verdict"] == "reproduced direction"
    steps = [{"step": 1, "actor/grad_norm": 0.0}, {"step": 1, "eval/accuracy": 0.5}, {"step": 2, "actor/grad_norm": 0.0}]
    for p in m:
        (p / "metrics.jsonl").write_text("\n".join(json.dumps(d) for d in steps) + "\n")
    assert R.steps_with_gradient(m[0]) == 0
    rec = R.summarize("vade", card, m, b, [0, 1])
    assert rec["verdict"] == "not resolved" and "never updated" in rec["caveat"]
    assert "caveat: the method arm never updated" in R.format_result({**rec, "seeds": [0, 1]})
    # one step with a gradient in one seed: the method ran, the CI decides again
    (m[1] / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/grad_norm": 0.3}) + "\n")
    assert R.steps_with_gradient(m[1]) == 1
    assert R.summarize("vade", card, m, b, [0, 1])["verdict"] == "reproduced direction"


# --------------------------------------------------------------------------- running


def test_reproduce_the_default_recipe_on_tiny(tmp_path):
    """Two matched seeds of the default recipe against the untrained model (its eval_start.json)."""
    res = R.reproduce("cpu_arithmetic_grpo", seeds=2, extra=TINY_RUN, out=tmp_path / "runs",
                      record_dir=tmp_path / "results", log=lambda *_: None)
    assert res["seeds"] == [0, 1] and res["n_problems"] == 4
    assert res["verdict"] in R.VERDICTS
    for s in (0, 1):
        d = tmp_path / "runs" / "method" / f"seed{s}"
        assert (d / "eval_start.json").is_file() and (d / "eval.json").is_file()
        assert not (d / "final").exists()  # weights deleted, evaluations kept
        start = json.loads((d / "eval_start.json").read_text())
        assert math.isclose(res["acc_baseline"][s], start["accuracy"])
    saved = json.loads((tmp_path / "results" / "cpu_arithmetic_grpo.json").read_text())["runs"][-1]
    assert saved["budget"] == TINY_RUN and saved["wall_s"] > 0
    # finished runs are reused: a second call trains nothing and gives the same numbers
    again = R.reproduce("cpu_arithmetic_grpo", seeds=2, extra=TINY_RUN, out=tmp_path / "runs", record=False,
                        log=lambda *_: None)
    assert again["diff"] == res["diff"] and again["acc_method"] == res["acc_method"]


def test_reproduce_trains_the_cards_stage_first_and_both_arms_start_from_it(tmp_path):
    """ERPD's card has ``cpu.after: erpd_teacher``: the stage trains per seed, the method arm distils its final/."""
    from omegaconf import OmegaConf

    seen = []
    res = R.reproduce("erpd", seeds=1, extra=TINY_RUN + ["steps=1"], out=tmp_path / "runs", record=False,
                      log=seen.append)
    stage, method = tmp_path / "runs" / "stage" / "seed0", tmp_path / "runs" / "method" / "seed0"
    assert [m.split(":")[0] for m in seen] == ["[erpd] stage seed 0", "[erpd] method seed 0"]
    assert (stage / "DONE").is_file() and (method / "DONE").is_file()
    assert OmegaConf.load(stage / "config.yaml").algo.name == "erpd_teacher"
    assert OmegaConf.load(method / "config.yaml").model.teacher == str(stage / "final")
    assert not (stage / "final").exists() and not (method / "final").exists()  # both used: weights deleted
    assert not (stage / "eval.json").exists()  # the stage only trains
    assert res["seeds"] == [0] and res["verdict"] in R.VERDICTS
    seen.clear()  # a second call reuses all three runs
    again = R.reproduce("erpd", seeds=1, extra=TINY_RUN + ["steps=1"], out=tmp_path / "runs", record=False,
                        log=seen.append)
    assert all("reusing" in m for m in seen) and again["diff"] == res["diff"]


def test_stage_overrides_need_final_and_a_known_recipe():
    base = _card_dict(R.load_recipe("erpd").card)
    ok = R.parse_card(base)
    assert ok.cpu.after == R.Stage("erpd_teacher", ["model.teacher={final}"])
    assert R.stage_overrides(ok.cpu.after, Path("/r/stage/seed3")) == ["model.teacher=/r/stage/seed3/final"]
    for after, words in (({"recipe": "erpd_teacher", "overrides": ["model.teacher=x"]}, "none mentions {final}"),
                         ({"recipe": "erpd_techer", "overrides": ["model.teacher={final}"]}, "no such recipe"),
                         ({"recipe": "erpd_teacher", "overrides": "model.teacher={final}"}, "list of Hydra overrides"),
                         ({"recipe": "erpd_teacher", "override": ["model.teacher={final}"]}, "unknown field")):
        bad = {**base, "cpu": {**base["cpu"], "after": after}}
        with pytest.raises(ConfigError, match=words):
            R.parse_card(bad)
    r = CliRunner().invoke(__import__("rlpost.cli", fromlist=["app"]).app,
                           ["reproduce", "rc_grpo", "--seeds", "1", "--dry-run", "--out", "/r"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("seed 0 stage: +recipe=rctp seed=0")
    assert all("model.source=hf model.path=/r/stage/seed0/final" in x for x in lines[1:3])


def _card_dict(card):
    """A parsed card back to the plain mapping ``parse_card`` reads (dataclasses to dicts)."""
    from dataclasses import asdict

    d = asdict(card)
    d["cpu"] = {k: v for k, v in d["cpu"].items() if v is not None}
    return d


@functools.lru_cache(maxsize=None)
def _raw(name: str) -> dict:
    """The recipe's YAML as plain data (parsed once per process)."""
    import yaml

    return yaml.load((R.recipes_dir() / f"{name}.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _choices(name: str) -> set:
    """What a recipe chooses besides numbers: ``(group, choice)`` for each group its defaults override (the algo
    preset and the model left out: every preset runs two steps in test_algos_presets.py, and the model here is the
    tiny one), and ``(dotted key, value)`` for each string or boolean it sets (a correction, an executor, a teacher,
    gradient checkpointing). Read from the YAML file, without composing."""
    raw = _raw(name)
    out = set()
    for entry in raw.get("defaults") or []:
        for key, choice in (entry.items() if isinstance(entry, dict) else ()):
            group = key.replace("override", "").strip(" /")
            if group not in ("algo", "model"):
                out.add((group, str(choice)))

    def leaves(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from leaves(v, f"{prefix}{k}.")
        elif isinstance(node, (str, bool)):
            yield prefix[:-1], str(node)

    out |= set(leaves({k: v for k, v in raw.items() if k not in ("card", "name", "defaults")}, ""))
    return out


def trained_variants(names, extra: int = 16, seed: int = 0) -> list:
    """The recipes whose CPU variant trains two steps in the suite: a greedy cover of every choice
    (:func:`_choices`) any recipe makes, so each sampler, selector, environment, task, executor, correction,
    precision, rollout engine and string or boolean setting a recipe uses is trained in at least one recipe, plus
    a fixed-seed sample of ``extra`` of the others (combinations beyond the cover). Every recipe still composes
    and validates with its baseline arm above. The cover replaced all ~150 runs (about 300 s of the suite)."""
    feats = {n: _choices(n) for n in names}
    todo, chosen = set().union(*feats.values()), []
    while todo:
        best = max(sorted(feats), key=lambda n: len(feats[n] & todo))
        chosen.append(best)
        todo -= feats[best]
    rest = [n for n in sorted(names) if n not in chosen]
    return sorted(chosen + random.Random(seed).sample(rest, min(extra, len(rest))))


def _trainable(name: str) -> bool:
    """A recipe with a CPU variant of its own (a link card points to the method recipe; SCOPE needs a PRM
    checkpoint rlpost does not ship, its run is in tests/test_method_scope.py)."""
    if name in NEEDS_A_MODEL_DIR:
        return False
    return "recipe_of" not in (_raw(name).get("card") or {}) or name in ("agent_multiply_sao", "agent_multiply_grpo")


def test_the_trained_variants_cover_every_choice_a_recipe_makes():
    """The cover property by hand: each choice of each trainable recipe appears in some trained recipe, and a
    recipe with a choice no other recipe makes is always trained."""
    trainable = [n for n in NAMES if _trainable(n)]
    chosen = set(TRAINED)
    made = set().union(*(_choices(n) for n in chosen))
    for n in trainable:
        assert _choices(n) <= made, (n, _choices(n) - made)
    only = {n for n in trainable if _choices(n) - set().union(*(_choices(m) for m in trainable if m != n))}
    assert only <= chosen
    assert trained_variants(trainable) == TRAINED  # the fixed seed gives the same sample in every process


#: recipes whose CPU variant needs a checkpoint rlpost does not ship
NEEDS_A_MODEL_DIR = {"scope": "a kind=prm checkpoint in sampler.params.prm_model_path"}

TRAINED = trained_variants([n for n in NAMES if _trainable(n)])


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_cpu_variant_trains_two_steps_on_tiny(name, tmp_path):
    """A recipe's CPU variant, 2 steps on model=tiny (about 2 s each; marked slow for the total)."""
    _cpu_variant_runs(name, tmp_path)


def _cpu_variant_runs(name: str, tmp_path: Path) -> None:
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.run.runner import train

    cfg = compose_config([f"+recipe={name}", "logger=jsonl", "checkpoint.every=0", "eval.at_start=false", *TINY_RUN])
    validate_config(cfg)
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in rows if "reward/mean" in r]
    assert steps == [1, 2]
    assert all(np.isfinite(r["reward/mean"]) for r in rows if "reward/mean" in r)
    assert (tmp_path / "eval.json").is_file()


def test_reproduce_cli_dry_run_and_errors():
    from rlpost.cli import app

    r = CliRunner().invoke(app, ["reproduce", "vade", "--seeds", "2", "--dry-run", "steps=5"])
    assert r.exit_code == 0, r.output
    assert "seed 1 baseline: +recipe=vade seed=1" in r.output and r.output.rstrip().endswith("selector=uniform")
    r = CliRunner().invoke(app, ["reproduce", "vaed", "--dry-run"])
    assert r.exit_code == 2 and "Unknown recipe 'vaed'" in r.output
    r = CliRunner().invoke(app, ["reproduce", "dapo_qwen2.5_32b", "--dry-run"])
    assert r.exit_code == 2 and "points to recipe dapo" in r.output and "rlpost reproduce dapo" in r.output
    r = CliRunner().invoke(app, ["recipes"])
    assert r.exit_code == 0 and "vade  [selector=vade]" in r.output


def test_cpu_agent_recipes_are_not_called_gpu_deployments_and_point_to_their_claim():
    """agent_multiply_sao is a CPU multi-turn recipe with ``card: {recipe_of: sao}``: the listing used to call
    it a "GPU setting of recipe sao" and its card view offered `rlpost reproduce agent_multiply_sao`, which
    then refused it as "a GPU deployment"."""
    from rlpost.cli import app

    rows = {n: (kind, claim, status) for n, kind, claim, status in R.table_rows(["agent_multiply_sao", "vade"])}
    assert rows["agent_multiply_sao"] == ("variant", "recipe sao's (rlpost recipes sao)", "see sao")
    assert rows["vade"][0] == "selector=vade"
    r = CliRunner().invoke(app, ["recipes", "agent_multiply_sao"])
    assert r.exit_code == 0 and "GPU" not in r.output
    assert r.output.splitlines()[-1].startswith("reproduced: see recipe sao (rlpost recipes sao)")
    assert "rlpost reproduce agent_multiply_sao" not in r.output
    r = CliRunner().invoke(app, ["reproduce", "agent_multiply_sao", "--seeds", "1"])
    assert r.exit_code == 2 and "GPU" not in r.output and "Traceback" not in r.output
    assert "has no claim of its own: its card points to recipe sao" in r.output
    assert r.output.strip().endswith("reproduce that one: rlpost reproduce sao")
    md = R.markdown_table(["agent_multiply_sao"]).splitlines()
    assert md[-1] == "| `agent_multiply_sao` | variant | see `sao` | | | | |"


# --------------------------------------------------------------------------- pass@k claims


def test_metric_overrides_by_hand():
    assert R.metric_overrides("correct") == []
    assert R.metric_overrides("pass@4") == ["eval.n_samples=4", "eval.ks=[4]"]
    assert R.metric_overrides("maj@2", ["eval.n_samples=8"]) == ["eval.ks=[2]"]
    assert R.metric_overrides("mean@8") == ["eval.n_samples=8"]
    assert R.metric_overrides("pass@4", ["eval.n_samples=16", "eval.ks=[1,4]"]) == []
    with pytest.raises(ConfigError, match=r"eval.n_samples>=4"):
        R.metric_overrides("pass@4", ["eval.n_samples=2"])
    with pytest.raises(ConfigError, match="pass@K, maj@K or mean@N"):
        R.metric_overrides("pass4")


def test_summarize_compares_the_chosen_metric(tmp_path):
    """pass@2 records decide the verdict; greedy ``correct`` in the same files says the opposite."""
    card = _card("vade")
    m, b = [], []
    for s in (0, 1):
        for arm, greedy, p2 in (("b", 1.0, 0.0), ("m", 0.0, 1.0)):
            d = tmp_path / arm / str(s)
            d.mkdir(parents=True)
            recs = [{"index": i, "question": f"q{i}", "correct": greedy, "pass@2": p2 if i % 2 else 0.5}
                    for i in range(6)]
            (d / "eval.json").write_text(json.dumps({"task": "arithmetic", "seed": s, "records": recs}))
        m.append(tmp_path / "m" / str(s))
        b.append(tmp_path / "b" / str(s))
    rec = R.summarize("vade", card, m, b, [0, 1], metric="pass@2")
    # baseline: (3 x 0.5 + 3 x 0) / 6 = 0.25; method: (3 x 0.5 + 3 x 1) / 6 = 0.75
    assert rec["metric"] == "pass@2" and rec["acc_baseline"] == [0.25, 0.25] and rec["acc_method"] == [0.75, 0.75]
    assert rec["verdict"] == "reproduced direction"
    assert "held-out arithmetic pass@2" in R.format_result({**rec, "seeds": [0, 1]})
    greedy = R.summarize("vade", card, m, b, [0, 1])
    assert greedy["diff"] == -1.0 and greedy["verdict"] == "contradicted"
    with pytest.raises(DataError, match="no 'pass@4'"):
        R.summarize("vade", card, m, b, [0, 1], metric="pass@4")


def test_reproduce_cli_metric_sets_the_samples_each_arm_evaluates():
    from rlpost.cli import app

    r = CliRunner().invoke(app, ["reproduce", "vade", "--seeds", "1", "--dry-run", "--metric", "pass@4", "steps=5"])
    assert r.exit_code == 0, r.output
    for line in r.output.strip().splitlines():
        assert "eval.n_samples=4 eval.ks=[4] eval.at_start=false steps=5" in line
    r = CliRunner().invoke(app, ["reproduce", "vade", "--dry-run", "--metric", "pass@4", "eval.n_samples=2"])
    assert r.exit_code == 2 and "set eval.n_samples>=4" in r.output


def test_reproduce_pass_at_k_on_tiny(tmp_path):
    """One seed of the default recipe judged on pass@2: both evaluations sample twice per problem."""
    res = R.reproduce("cpu_arithmetic_grpo", seeds=1, extra=TINY_RUN, out=tmp_path / "runs", record=False,
                      log=lambda *_: None, metric="pass@2")
    d = tmp_path / "runs" / "method" / "seed0"
    for f in ("eval_start.json", "eval.json"):
        recs = json.loads((d / f).read_text())["records"]
        assert all(len(r["samples"]) == 2 if "samples" in r else "pass@2" in r for r in recs)
    start = json.loads((d / "eval_start.json").read_text())["records"]
    assert math.isclose(res["acc_baseline"][0], sum(r["pass@2"] for r in start) / len(start))
    assert res["metric"] == "pass@2" and "--metric pass@2" in res["command"]


def test_claim_text_says_in_words_what_is_unknown():
    """A sentinel is named at the end ("not yet read from the paper"), never printed as a benchmark."""
    import dataclasses

    import rlpost.experiments.recipes as R

    card = next(r.card for r in map(R.load_recipe, R.recipe_names()) if isinstance(r.card, R.Card))
    claim = R.Claim(summary="s", metric="accuracy", benchmark=R.NOT_CHECKED, baseline="GRPO", value=R.NOT_CHECKED,
                    baseline_value=R.NOT_CHECKED, delta=R.NOT_CHECKED, unit="points", source=R.NOT_CHECKED)
    text = R.claim_text(dataclasses.replace(card, claim=claim))
    assert text == "accuracy vs GRPO; figures, benchmark and source not yet read from the paper"
    claim = dataclasses.replace(claim, delta=2.5, benchmark="AIME24", source="Table 1", metric=R.NOT_STATED)
    assert R.claim_text(dataclasses.replace(card, claim=claim)) == ("+2.5 points on AIME24 vs GRPO (Table 1); "
                                                                    "metric not stated in the paper")
    for n, _, claim_line, _ in R.table_rows():
        assert " on not checked" not in claim_line and "vs not checked" not in claim_line, n
