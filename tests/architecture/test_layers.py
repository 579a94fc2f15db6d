"""The dependency layers of DESIGN/STYLE §5.2, checked on the import statements of every module.

protocols  <-  shared  <-  volunteer, backbone     (volunteer and backbone never import each other;
                                                    backbone never imports torch, even indirectly)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocols", "shared", "volunteer", "backbone")
FORBIDDEN = {
    "protocols": {"shared", "volunteer", "backbone"},
    "shared": {"volunteer", "backbone"},
    "volunteer": {"backbone"},
    "backbone": {"volunteer", "torch"},
}


def _imports(path: Path, package: str) -> set[str]:
    module_parts = path.relative_to(ROOT).with_suffix("").parts
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module_parts[: len(module_parts) - node.level]
                found.add(base[0] if base else package)
            elif node.module:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_package_imports_only_what_its_layer_allows(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imports(path, package) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_layers_backbone_never_loads_torch_even_indirectly() -> None:
    code = (
        "import sys, backbone.cli, backbone.service\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_layers_no_pickle_anywhere() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if {"pickle", "cloudpickle", "dill"} & _imports(path, package)
    ]
    assert not offenders


def _reexports(init: Path) -> tuple[set[str], list[str] | None]:
    tree = ast.parse(init.read_text())
    names: set[str] = set()
    declared: list[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            names.update(a.asname for a in node.names if a.asname is not None and a.asname == a.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                declared = [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return names, declared


@pytest.mark.parametrize(
    "init", sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py"))
)
def test_exports_every_package_declares_all_matching_its_reexports(init: str) -> None:
    names, declared = _reexports(ROOT / init)
    assert ast.get_docstring(ast.parse((ROOT / init).read_text())), f"{init} needs a docstring map"
    assert declared is not None, f"{init} has no __all__"
    assert set(declared) == names, f"{init}: __all__ and the explicit re-exports differ"
    assert len(declared) == len(set(declared))
