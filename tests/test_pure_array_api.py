"""ntkcore/ is pure array API: no module outside the application layer (the command line,
ntkcore.distributed) imports a framework at run time (imports under ``TYPE_CHECKING`` are
type hints only)."""

import ast
import pathlib

import pytest

import ntkcore

FRAMEWORKS = {"torch", "numpy", "jax", "jaxlib", "cupy", "cupyx", "scipy", "dask", "zarr"}
ROOT = pathlib.Path(ntkcore.__file__).parent
CORE = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
              if not p.relative_to(ROOT).as_posix().startswith(("cli/", "distributed/",
                                                                 "backends/", "__main__")))


def _runtime_imports(tree: ast.AST) -> set[str]:
    """Top-level packages imported anywhere in ``tree`` except under ``if TYPE_CHECKING``."""
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found |= {a.name.split(".")[0] for a in child.names}
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.add(child.module.split(".")[0])
            stack.append(child)
    return found


def test_the_check_sees_imports():
    src = "import torch\nif TYPE_CHECKING:\n    import numpy\ndef f():\n    from jax import numpy\n"
    assert _runtime_imports(ast.parse(src)) == {"torch", "jax"}


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_framework(module):
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    assert not _runtime_imports(tree) & FRAMEWORKS, module


def test_attribution_is_public():
    from ntkcore.attribution import TRAK

    assert "attribution" in ntkcore.__all__ and ntkcore.attribution.TRAK is TRAK
    assert "attribution.py" in CORE and "_api.py" in CORE
