"""scripts/setup.sh's output filter: packaging notices from pip's build step are dropped, everything else kept."""

from __future__ import annotations

import subprocess

from conftest import REPO

# what `pip install -e .` printed on a clean clone (setuptools 80): the editable build's notice
EDITABLE_NOTICE = """\
  /tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
"""
DEPRECATION_NOTICE = """\
  /tmp/x/setuptools/config/_apply_pyprojecttoml.py:82: SetuptoolsDeprecationWarning: `project.license` as a TOML table is deprecated
  !!

          ********************************************************************************
          Please use a simple string containing a SPDX expression for `project.license`.
          ********************************************************************************

  !!
    corresp(dist, value, root_dir)
"""


def _quiet(text: str) -> str:
    script = f'eval "$(sed -n "/^quiet() {{/,/^}}/p" {REPO / "scripts" / "setup.sh"})"; quiet'
    return subprocess.run(["bash", "-c", script], input=text, capture_output=True, text=True, check=True).stdout


def test_setup_filter_drops_packaging_notices_and_keeps_the_rest():
    text = "Collecting gguf\n" + EDITABLE_NOTICE + "ERROR: no matching distribution\n" + DEPRECATION_NOTICE + "done\n"
    assert _quiet(text) == "Collecting gguf\nERROR: no matching distribution\ndone\n"
    assert _quiet("rlpost ready: torch 2.13.0+cpu\n") == "rlpost ready: torch 2.13.0+cpu\n"
