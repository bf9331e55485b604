"""fxopt's modules import only downward (ARCHITECTURE.md), and no import circle exists."""
from __future__ import annotations

import pathlib

import import_layers


def test_every_module_has_a_layer():
    """A new module must be placed on a layer (import_layers.LAYERS), or the rule cannot check it."""
    assert import_layers.unassigned() == []


def test_no_upward_or_sideways_import():
    """A lower layer importing a higher one (or capture importing analysis) ties the floors together."""
    bad = import_layers.upward(import_layers.imports())
    assert not bad, "imports against the layer rule:\n" + "\n".join(map(str, bad))


def test_no_module_imports_another_packages_private_files():
    """A package's `_name` modules are its own: others reach it through its public modules (checkpointing's
    runtime and price lists stay behind its planner and lowerings)."""
    bad = import_layers.private(import_layers.imports())
    assert not bad, "imports of private modules:\n" + "\n".join(map(str, bad))


def test_no_import_circle():
    """A circle, even through a function-level import, means two modules cannot be understood apart."""
    found = import_layers.imports()
    circles = import_layers.cycles(found)
    detail = [str(i) for c in circles for i in found if i.importer in c and i.imported in c]
    assert not circles, f"import circles: {circles}\n" + "\n".join(detail)


def test_the_checker_sees_upward_and_circular_imports(tmp_path: pathlib.Path):
    """The check itself must catch what it guards against: an upward import and a circle."""
    package = tmp_path / "fxopt"
    (package / "analysis").mkdir(parents=True)
    (package / "pipeline").mkdir()
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "analysis" / "__init__.py").write_text("")
    (package / "analysis" / "costs.py").write_text("from ..pipeline.verify import flatten_tensors\n")
    (package / "pipeline" / "__init__.py").write_text("")
    (package / "pipeline" / "verify.py").write_text(
        "def f():\n    from ..analysis.costs import estimate\n")
    found = import_layers.imports(package)
    assert [str(i) for i in import_layers.upward(found)] == [
        "fxopt.analysis.costs -> fxopt.pipeline.verify (module-level, line 1)"]
    assert import_layers.cycles(found) == [["fxopt.analysis.costs", "fxopt.pipeline.verify"]]
    (package / "pipeline" / "_plan.py").write_text("")
    (package / "analysis" / "flops.py").write_text("from ..pipeline import _plan\n")
    assert [str(i) for i in import_layers.private(import_layers.imports(package))] == [
        "fxopt.analysis.flops -> fxopt.pipeline._plan (module-level, line 1)"]
