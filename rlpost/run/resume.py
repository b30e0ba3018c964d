"""Resuming a run with the config it was started with.

``rlpost train resume=auto hydra.run.dir=DIR`` composes its config from the overrides on
its own command line. When they are not the run's own (the run had ``model=tiny steps=50``
and the command repeats neither), the checkpoint does not fit the model and the run's
``config.yaml`` and ``.hydra/overrides.yaml`` would be overwritten with the wrong config.
:func:`plan_resume` therefore runs before Hydra writes anything: it puts the run's saved
overrides (``DIR/.hydra/overrides.yaml``) in front of the command's, so a bare
``resume=auto`` continues the run as it was started (and says so), and refuses, naming the
differing keys, when the command's own overrides change the run's saved config (other than the
:data:`CHANGEABLE` keys: how long the run goes on and how it is evaluated, logged, checkpointed).
:func:`continue_command` is the command that the interrupt message prints.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlpost.config.compose import compose_config
from rlpost.core.errors import ConfigError
from rlpost.run.checkpoint import find_resume_checkpoint

#: keys whose values may differ between a run and its resume (they say how to resume, not what runs)
IGNORED_KEYS = ("resume",)
#: keys a resume may change: how long the run goes on and how it is evaluated, logged and checkpointed,
#: not what it trains (``steps=100`` extends a finished 60-step run); they are named in the log
CHANGEABLE = ("steps", "eval.", "logger.", "checkpoint.")


@dataclass
class ResumePlan:
    """What :func:`plan_resume` decided.

    Attributes:
        overrides: the overrides to launch with (the run's saved ones first, then the command's).
        run_dir: the run directory whose checkpoint is resumed, or None (nothing to resume).
        note: lines for the log (the run's saved overrides that were added, the :data:`CHANGEABLE`
            keys the command changes), else None.
    """

    overrides: List[str]
    run_dir: Optional[Path] = None
    note: Optional[str] = None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        if not d and prefix:
            out[prefix[:-1]] = {}
    else:
        out[prefix[:-1]] = d
    return out


def saved_overrides(run_dir: Path) -> Optional[List[str]]:
    """The task overrides a run was started with (``run_dir/.hydra/overrides.yaml``), without
    ``resume=...``; None when the file is missing."""
    from omegaconf import OmegaConf

    f = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    return [str(o) for o in (OmegaConf.load(f) or []) if _key(str(o)) not in IGNORED_KEYS]


def continue_command(run_dir: Path) -> str:
    """The shell command that continues ``run_dir``: its own overrides, ``resume=auto`` and its directory."""
    ovs = saved_overrides(run_dir) or []
    ovs = [o for o in ovs if not _key(o).startswith("hydra.")]
    parts = ["rlpost", "train", *ovs, "resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(p) for p in parts)


def _changeable(key: str) -> bool:
    return any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE)


def config_differences(saved: Dict[str, Any], requested: Dict[str, Any], changeable: bool = False) -> List[str]:
    """``key (saved A, requested B)`` for each dotted key whose value differs (:data:`IGNORED_KEYS` left out).

    ``changeable``: list only the :data:`CHANGEABLE` keys; else only the others.
    """
    a, b = _flatten(saved), _flatten(requested)
    out = []
    for k in list(a) + [k for k in b if k not in a]:
        if k.split(".", 1)[0] in IGNORED_KEYS or _changeable(k) != changeable:
            continue
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            out.append(f"{k} (saved {a.get(k, '<absent>')!r}, requested {b.get(k, '<absent>')!r})")
    return out


def _requested(overrides: List[str]) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    cfg = compose_config([o for o in overrides if not o.startswith("hydra.")])
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def _run_dir_of(overrides: List[str]) -> Path:
    """The run directory Hydra will use for ``overrides`` (``hydra.run.dir``, else the composed default)."""
    given = [o.split("=", 1)[1] for o in overrides if _key(o) == "hydra.run.dir"]
    if given:
        return Path(given[-1].strip("'\""))
    from omegaconf import OmegaConf

    cfg = compose_config([o for o in overrides if not o.startswith("hydra.")], return_hydra_config=True)
    return Path(str(OmegaConf.select(cfg, "hydra.run.dir")))


def plan_resume(overrides: List[str]) -> ResumePlan:
    """Check a ``resume=...`` command against the run it resumes, before anything is written.

    Without ``resume`` (or when no checkpoint is found, so the run starts fresh) the
    overrides are returned unchanged. Otherwise the run's saved overrides are put first and
    the composed config is compared with the run's ``config.yaml``.

    Raises:
        ConfigError: the command's overrides change the saved config (the message names the
            differing keys and the command that resumes the run), or the run's config differs
            and it has no ``.hydra/overrides.yaml`` to take the right one from.
    """
    from omegaconf import OmegaConf

    resume = [o.split("=", 1)[1] for o in overrides if _key(o) == "resume"]
    if not resume or resume[-1] in ("", "none", "null"):
        return ResumePlan(list(overrides))
    ckpt = find_resume_checkpoint(resume[-1], _run_dir_of(overrides))
    if ckpt is None:
        return ResumePlan(list(overrides))
    run_dir = ckpt.parent.parent
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():  # a run from before config.yaml was written: nothing to compare with
        return ResumePlan(list(overrides), run_dir)
    saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=False)
    own = saved_overrides(run_dir)
    cmd = continue_command(run_dir)
    if own is None:
        req = _requested(overrides)
        diff = config_differences(saved, req)
        if not diff:
            return ResumePlan(list(overrides), run_dir, _changed_note(resume[-1], saved, req))
        raise ConfigError(f"resume={resume[-1]}: {run_dir}/config.yaml differs from this command's config in "
                          f"{_listing(diff)}, and the run has no .hydra/overrides.yaml to take its own from. "
                          f"Fix: repeat the run's overrides (see {saved_file}) or start a new run elsewhere.")
    named = {_key(o) for o in overrides}
    added = [o for o in own if _key(o) not in named and not _key(o).startswith("hydra.")]
    merged = added + list(overrides)  # the command's own keys once each (Hydra refuses a key given twice)
    req = _requested(merged)
    diff = config_differences(saved, req)
    if diff:
        raise ConfigError(f"resume={resume[-1]}: this command would change the config of the run in {run_dir}: "
                          f"{_listing(diff)}. Nothing was written. Fix: resume it as it was started, "
                          f"{cmd}, or start a new run in another hydra.run.dir.")
    notes = [f"resume={resume[-1]}: using the run's own overrides from {run_dir}/.hydra/overrides.yaml: "
             f"{' '.join(added)}" if added else None, _changed_note(resume[-1], saved, req)]
    return ResumePlan(merged, run_dir, "\n".join(n for n in notes if n) or None)


def _changed_note(resume: str, saved: Dict[str, Any], requested: Dict[str, Any]) -> Optional[str]:
    """The log line naming the :data:`CHANGEABLE` keys this resume changes, or None."""
    diff = config_differences(saved, requested, changeable=True)
    return f"resume={resume}: changed from the run's saved config: {_listing(diff, 8)}" if diff else None


def _listing(diff: List[str], most: int = 4) -> str:
    head = "; ".join(diff[:most])
    return head + (f"; and {len(diff) - most} more keys" if len(diff) > most else "")
