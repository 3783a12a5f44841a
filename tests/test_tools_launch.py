"""Every ``python -m MODULE`` that a benchmark or a test starts names a module Python can
run: a package moved or renamed leaves no launcher behind that fails only when its
benchmark is run (tools/bench_http.py started ``-m delayd.cli``, a package without a
``__main__``, and did not start at all)."""

from __future__ import annotations

import importlib.util
import re

from tests.process_support import ROOT

LAUNCH = re.compile(r"""["']-m["'],\s*["']([\w.]+)["']""")


def launched_modules() -> dict[str, list[str]]:
    """MODULE -> the files (tools/, tests/) that run ``-m MODULE``."""
    found: dict[str, list[str]] = {}
    for path in sorted([*ROOT.glob("tools/*.py"), *ROOT.glob("tests/*.py")]):
        for module in LAUNCH.findall(path.read_text()):
            found.setdefault(module, []).append(str(path.relative_to(ROOT)))
    return found


def runnable(module: str) -> bool:
    """Whether ``python -m module`` finds code to run (a package needs ``__main__``)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    return spec.submodule_search_locations is None or runnable(f"{module}.__main__")


def test_every_module_a_tool_or_test_launches_can_be_run() -> None:
    launched = launched_modules()
    assert "delayd" in launched  # the scan sees the launchers
    broken = {module: files for module, files in launched.items() if not runnable(module)}
    assert broken == {}, f"python -m cannot run these (module: launched by): {broken}"
