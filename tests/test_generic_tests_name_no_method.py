"""The generic (registry-wide) test files name no method: a component's special needs live at its registration
(``example_inputs=``, ``zero_variance=``, tags; docs/ARCHITECTURE.md, "What a component declares for the generic
tests"), so a new method never edits these files.

A name is a registered method (``METHODS``) or a paper-specific advantage estimator, policy loss or correction
(``ADV_ESTIMATORS``, ``POLICY_LOSSES``, ``CORRECTIONS``), matched as a whole identifier, case-sensitive (the
spelling a config or a test would use). ``BASELINES`` are the few names a generic test may use as defaults.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

from rlpost.algos.corrections import CORRECTIONS
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.methods.base import METHODS

TESTS = Path(__file__).resolve().parent

#: the registry-wide test files (each runs every entry of a registry, or every preset)
GENERIC_FILES = [
    "test_algo_properties.py",  # every estimator, loss and aggregation against shared invariants
    "test_microbatch_invariance.py",  # every loss and aggregation through the trainer
    "test_preset_microbatch_invariance.py",  # every preset through the trainer
    "test_algos_presets.py",  # every preset two steps end to end
    "test_params.py",  # every component's declared parameters, every preset's restated defaults
    "test_pipeline.py",  # every sampler and selector through the rollout/reward pipeline
    "test_samplers.py",  # sampler rules on a fake engine
    "test_selectors.py",  # every selector's shared properties
]

#: names a generic test may use, each with its reason
BASELINES: Dict[str, str] = {
    "none": "the correction default (precision.correction=none), and a plain English word",
}

#: registered names that are also ordinary identifiers of test code: matched only as a name is written in a
#: config or a lookup (quoted, or as an override's value: algo=<name>, algo.loss=<name>), not as a variable
ORDINARY_WORDS: Dict[str, str] = {
    "seed": "a random seed (torch.manual_seed(seed), seed=3)",
    "rec": "a record (rec = ...)",
}


def registered_names() -> List[str]:
    """Every method name and every estimator, loss and correction name, less the declared baselines."""
    names = set(METHODS.names()) | set(ADV_ESTIMATORS.names()) | set(POLICY_LOSSES.names()) | set(CORRECTIONS.names())
    return sorted(names - set(BASELINES))


def named_methods(text: str, names: List[str]) -> List[Tuple[int, str]]:
    """``(line number, name)`` of each occurrence of a name in ``text``: a whole identifier, or for
    :data:`ORDINARY_WORDS` a quoted one or the value of a config override (``algo=<name>``, ``algo.loss=<name>``)."""
    plain = [n for n in names if n not in ORDINARY_WORDS]
    words = [n for n in names if n in ORDINARY_WORDS]
    pats = [re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, plain)) + r")(?![A-Za-z0-9_])")]
    if words:
        alt = "|".join(map(re.escape, words))
        pats.append(re.compile(r"(?:(?<=[\"'`])(" + alt + r")(?=[\"'`])|(?:\balgo|\b\w+\.[\w.]+)=(" + alt
                               + r")(?![A-Za-z0-9_]))"))
    return sorted((i, next(g for g in m.groups() if g)) for i, line in enumerate(text.splitlines(), 1)
                  for p in pats for m in p.finditer(line))


def test_generic_test_files_name_no_method():
    names = registered_names()
    found = [f"tests/{f}:{line}: {name}" for f in GENERIC_FILES
             for line, name in named_methods((TESTS / f).read_text(), names)]
    assert not found, ("a generic test names a method; declare its need at the registration instead "
                       "(example_inputs=, zero_variance=, a tag):\n" + "\n".join(found))


def test_the_scan_finds_a_name_and_ignores_longer_identifiers():
    names = registered_names()
    some = names[0]
    assert named_methods(f'x = "{some}"\n', names) == [(1, some)]
    assert named_methods(f"{some}_extra = 1\nmy_{some} = 2\n", names) == []
    for word in ORDINARY_WORDS:  # as a variable it is no method's name; quoted or in an override it is
        if word in names:
            assert named_methods(f"{word} = 3\nf({word}={word})\n", names) == []
            assert named_methods(f'a = "{word}"\nb = ["algo.loss={word}"]\n', names) == [(1, word), (2, word)]
    assert set(BASELINES) <= set(METHODS.names()) | set(ADV_ESTIMATORS.names()) | set(POLICY_LOSSES.names()) | set(
        CORRECTIONS.names()), "a baseline that is no longer registered: drop it"
