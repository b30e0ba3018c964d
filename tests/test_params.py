"""Typed component parameters: one declaration per component, its cited paper defaults, presets that restate none.

Parametrised over the registries, so a newly registered loss, estimator,
correction, selector or sampler is covered without editing this file. Named papers' headline values and the
messages of misspelt parameters are in tests/test_params_paper_values.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import rlpost.algos  # noqa: F401  (registers)
import rlpost.samplers  # noqa: F401
import rlpost.selectors  # noqa: F401
from rlpost.algos.corrections import CORRECTIONS
from preset_configs import preset_config  # noqa: E402  (tests/preset_configs.py)
from rlpost.algos.registries import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from rlpost.config.compose import conf_dir, group_choices
from rlpost.core.errors import ConfigError
from rlpost.core.registry import defaults_of, param_rows
from rlpost.samplers import SAMPLERS
from rlpost.selectors import SELECTORS

REGISTRIES = {"loss": POLICY_LOSSES, "adv_estimator": ADV_ESTIMATORS, "correction": CORRECTIONS,
              "selector": SELECTORS, "sampler": SAMPLERS}
ENTRIES = [(kind, e.name) for kind, reg in REGISTRIES.items() for e in reg]

# A number a field's doc line attributes to its source ("GSPO paper: 3e-4", "authors: 1").
_CITED = re.compile(r"(?:paper|authors|authors' release|release|REINFORCE\+\+|LLM PPO|PPO|DAPO)[^:;()]*:\s*([-+]?\d[\d.e+-]*)")


#: components that cannot be built without a model directory rlpost does not ship (tested with one in their own files)
NEEDS_A_MODEL_DIR = {("sampler", "scope"): "tests/test_method_scope.py (a tiny PRM)",
                     ("sampler", "s2l"): "tests/test_method_s2l.py (an explorer model)"}


def _construct(kind: str, name: str):
    """Build the component from its name alone (declared defaults only)."""
    obj = REGISTRIES[kind].get(name)
    if (kind, name) in NEEDS_A_MODEL_DIR:
        return obj
    if kind == "selector":
        return obj(10, 2, 0)
    if kind == "sampler":
        return obj(4)
    return obj  # functions: their installed keyword defaults are checked below


@pytest.mark.parametrize("kind,name", ENTRIES)
def test_every_component_built_from_its_name_gets_its_declared_paper_defaults(kind, name):
    reg = REGISTRIES[kind]
    entry = reg.entry(name)
    declared = defaults_of(entry.params)
    # one declaration: every field documented, and the values cited in the docs are the defaults
    for pname, _t, default, doc in param_rows(entry.params):
        assert doc, f"{kind} {name}.{pname} has no doc line"
        m = _CITED.search(doc)
        if m and isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(m.group(1).rstrip(".")) == pytest.approx(float(default)), (kind, name, pname, doc)
    # the config path (name alone) resolves to exactly the declaration
    resolved = reg.resolve(name, {}, "test")
    assert {k: getattr(resolved, k) for k in declared} == declared
    assert reg.kwargs(name) == declared
    # the registered callable carries the same defaults (a direct call sees the paper values)
    obj = _construct(kind, name)
    if kind in ("selector", "sampler"):
        assert obj is not None
    else:
        kwd = obj.__kwdefaults__ or {}
        assert kwd == declared, (kind, name)


def test_schema_enums_mirror_the_registries():
    from rlpost.config.schema import KLEstimator, LossAgg

    assert sorted(m.value for m in LossAgg) == LOSS_AGGS.names()
    assert sorted(m.value for m in KLEstimator) == KL_ESTIMATORS.names()


@pytest.mark.parametrize("preset", group_choices("algo"))
def test_presets_set_only_what_differs_from_their_components(preset):
    a = preset_config(preset).algo
    for key, reg, name in (("loss_params", POLICY_LOSSES, a.loss), ("adv_params", ADV_ESTIMATORS, a.adv_estimator)):
        d = defaults_of(reg.params_of(name))
        for k, v in dict(a[key]).items():
            assert not (k in d and d[k] == v), f"conf/algo/{preset}.yaml restates {key}.{k}={v}, the declared default"
    assert all(v is None for v in dict(a.clip).values()), f"conf/algo/{preset}.yaml: set the clip in loss_params"
    assert (conf_dir() / "algo" / f"{preset}.yaml").read_text().startswith("#")


def test_registration_refuses_a_second_declaration_or_a_catch_all():
    from rlpost.core.registry import NoParams, Registry, param

    reg = Registry("thing", typed_params=True)

    @dataclasses.dataclass(frozen=True)
    class P:
        a: float = param(1.0, "a doc")

    with pytest.raises(ValueError, match="defaults only in the declaration"):
        @reg.register("x", params=P)
        def x(*, a: float = 2.0):  # noqa: ANN202
            return a

    with pytest.raises(ValueError, match="must not take \\*\\*kwargs"):
        @reg.register("y", params=NoParams)
        def y(**_):  # noqa: ANN202
            return 0

    @reg.register("z", params=P)
    def z(*, a: float):  # noqa: ANN202
        return a

    assert z() == 1.0 and reg.kwargs("z", {"a": 3}) == {"a": 3}
    with pytest.raises(ConfigError, match="unknown parameter b for thing 'z'. Valid keys: a \\(default 1.0\\)"):
        reg.kwargs("z", {"b": 1})
