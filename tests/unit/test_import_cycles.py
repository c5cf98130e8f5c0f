"""No import circles among pagedllm's modules (issue 44), read with `ast` by
scripts/import_cycles.py: a circle makes import order matter and hides which module is the lower
layer. Module-level imports must form none, and none may hide behind a function-local import
either (`if TYPE_CHECKING:` imports never run and are not counted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_cycles.py"
_spec = importlib.util.spec_from_file_location("import_cycles", _SCRIPT)
import_cycles = importlib.util.module_from_spec(_spec)
sys.modules["import_cycles"] = import_cycles  # dataclasses look their module up by name
_spec.loader.exec_module(import_cycles)


def test_no_module_level_import_circles():
    assert import_cycles.circles() == []


def test_no_new_circle_behind_a_function_local_import():
    found = import_cycles.circles({import_cycles.MODULE_LEVEL, import_cycles.LOCAL})
    assert found == []


def test_finds_a_circle_and_sorts_imports_by_when_they_run(tmp_path):
    """The check can fail: a two-module circle is found at module level, and the same import
    inside a function or under TYPE_CHECKING is no edge of the module-level graph."""
    pkg = tmp_path / "pagedllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pagedllm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm import d\n"
    )
    (pkg / "d.py").write_text("def f():\n    from pagedllm import c\n")
    module_level = {import_cycles.MODULE_LEVEL}
    assert import_cycles.circles(module_level, tmp_path) == [["pagedllm.a", "pagedllm.sub.b"]]
    everything = module_level | {import_cycles.LOCAL, import_cycles.TYPE_CHECKING}
    assert import_cycles.circles(everything, tmp_path) == [
        ["pagedllm.a", "pagedllm.sub.b"], ["pagedllm.c", "pagedllm.d"]]
    kinds = {(e.source, e.target): e.kind
             for e in import_cycles.import_edges(import_cycles.module_names(tmp_path), tmp_path)}
    assert kinds[("pagedllm.c", "pagedllm.d")] == import_cycles.TYPE_CHECKING
    assert kinds[("pagedllm.d", "pagedllm.c")] == import_cycles.LOCAL


def test_an_import_runs_the_packages_above_its_module(tmp_path):
    """Importing `pkg.base` first runs `pkg/__init__.py`: when that imports a module that
    imports the importer, it is a circle; a package's own modules importing their siblings is
    not (the package already ran)."""
    pkg = tmp_path / "pagedllm"
    (pkg / "q").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "q" / "__init__.py").write_text("from pagedllm.q import fmt\n")
    (pkg / "q" / "base.py").write_text("")
    (pkg / "q" / "fmt.py").write_text("from pagedllm.q import base\nfrom pagedllm import layer\n")
    (pkg / "layer.py").write_text("from pagedllm.q.base import *\n")
    assert import_cycles.circles({import_cycles.MODULE_LEVEL}, tmp_path) == [
        ["pagedllm.layer", "pagedllm.q", "pagedllm.q.fmt"]]
    (pkg / "q" / "__init__.py").write_text("")
    assert import_cycles.circles({import_cycles.MODULE_LEVEL}, tmp_path) == []
