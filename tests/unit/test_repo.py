"""What a newcomer relies on: the README's commands are the ones CI runs; what a maintainer relies on: the package
has no import cycle, and every private name of an upstream package is used through ``lightning_tp/compat/``."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_tp"
#: Packages whose private names go through lightning_tp/compat/: a release of one that moves them then breaks in one
#: place.
UPSTREAM = {"torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "transformers"}
UPSTREAM.add("peft")
#: Private attributes of upstream objects, caught wherever they are read (the object's type is not known to the AST).
UPSTREAM_PRIVATE_ATTRIBUTES = {
    "_modules",
    "_parameters",
    "_buffers",
    "_flatten",
    "_apply",
    "_is_hf_initialized",
    "_initialize_weights",
    "_keys_to_ignore_on_save",
    "_no_split_modules",
    "_name_or_path",
    "_signal_connector",
    "_checkpoint_connector",
    "_accelerator_connector",
    "_broadcast_sigterm_tensor",
    "_device_mesh",
}
#: The top-level modules or folders of the package where private upstream names may be used (a folder with every
#: module in it): the compat package, whose modules name them each with why.
EXEMPT = {"compat"}


def test_ci_runs_the_readme_test_command():
    """.ci/run's last line is the README's test command, run where pip reads no configuration file (a machine's may
    cap torch or add local wheels): what a new user's pip resolves, the newest releases in the ranges. Neither of the
    README's commands pins torch."""
    script = (ROOT / ".ci/run").read_text()
    ci_command = [line for line in script.splitlines() if line and not line.startswith("#")][-1]
    readme = (ROOT / "README.md").read_text()
    blocks = [block.split("```")[0] for block in readme.split("```bash\n")[1:3]]
    assert ci_command in blocks[1], "the README's second command must be the one .ci/run runs"
    newest = script[script.index('"$scratch/newest"') :]
    assert "export PIP_CONFIG_FILE=/dev/null" in newest and "unset PIP_CONSTRAINT" in newest
    assert all("torch==" not in block for block in blocks), "a new user's pip picks torch from the declared range"
    assert "examples/train_tp.py" in blocks[0]


def test_ci_latest_runs_the_readme_test_arguments():
    """``.ci/run-latest`` (the suite on the newest upstream releases) runs the README's pytest arguments by default."""
    script = (ROOT / ".ci/run-latest").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "set -- tests -q" in script and "python3 -m pytest tests -q" in readme
    assert ".ci/run-latest" in readme
    assert "--system-site-packages" not in script and "python3 -m venv" in script


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path) -> list[str]:
    """``from torch.x import _y``, ``import torch._x``, ``torch._x`` / ``dist.distributed_c10d.y`` on a name bound
    to an upstream package, the private attributes in :data:`UPSTREAM_PRIVATE_ATTRIBUTES` on anything but ``self``
    or spelled as a string (``vars(module)["_modules"]``), and ``getattr``-style access by a private string (other than
    the package's own ``_lightning_tp`` marks)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    upstream_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in UPSTREAM:
                continue
            for alias in node.names:
                upstream_names.add(alias.asname or alias.name)
                if any(_is_private(p) for p in parts) or _is_private(alias.name) or "distributed_c10d" in parts:
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in UPSTREAM:
                    continue
                upstream_names.add(alias.asname or parts[0])
                if any(_is_private(p) for p in parts):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            on_upstream = isinstance(base, ast.Name) and base.id in upstream_names
            if on_upstream and any(_is_private(a) or a == "distributed_c10d" for a in chain):
                found.append(f"{path.name}:{node.lineno} {base.id}.{'.'.join(reversed(chain))}")
            elif node.attr in UPSTREAM_PRIVATE_ATTRIBUTES and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not node.args[1].value.startswith("_lightning_tp")
        ):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Constant) and node.value in UPSTREAM_PRIVATE_ATTRIBUTES:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
    return sorted(set(found))


def test_private_upstream_names_only_in_compat():
    """Every private name of torch, Lightning, Transformers and PEFT is used through ``lightning_tp/compat/``."""
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if _exempt(path) is False for use in _private_uses(path)]
    assert not found, "private upstream names outside compat/ (add them to compat/, with why):\n" + "\n".join(found)


def test_the_private_name_check_catches_each_kind(tmp_path):
    """The check above finds what it claims to (so an empty result means something)."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from lightning.fabric.utilities.data import _set_sampler_epoch\n"
        "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
        "import torch._dynamo\n"
        "def f(mesh, module, t):\n"
        "    torch._foreach_norm([t], 2)\n"
        "    dist.distributed_c10d.get_rank()\n"
        "    mesh._flatten('dp')\n"
        "    module._parameters['w'] = t\n"
        "    getattr(t, '_is_hf_initialized', False)\n"
        "    getattr(t, '_lightning_tp_mesh', None)\n"
        "    self._parameters\n"
        "    module._modules['0'] = None\n"
        "    vars(module)['_parameters']\n"
        "    '_parameters are private'\n"
    )
    found = _private_uses(source)
    lines = sorted({int(line.split(" ")[0].split(":")[1]) for line in found})
    assert lines == [3, 4, 5, 7, 8, 9, 10, 11, 14, 15], found


def test_distributed_is_initialized_is_spelled_once():
    """``dist.is_initialized()`` (which needs ``is_available()`` first) is asked through one helper."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _exempt(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "is_initialized":
                if "cuda" not in ast.unparse(node.value):  # `torch.cuda.is_initialized` is another question
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"use lightning_tp.compat.distributed_is_initialized: {found}"


def _exempt(path: Path) -> bool:
    return path.relative_to(PACKAGE).parts[0] in EXEMPT


def _module_names() -> dict[str, Path]:
    """Each module of the package by its dotted name under ``lightning_tp`` (a subpackage by its ``__init__``), the
    package's own ``__init__`` aside: it imports everything and nothing imports it."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names[".".join(parts)] = path
    return names


def _imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports, at module level and inside functions alike."""
    is_package = path.name == "__init__.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module == "lightning_tp" or (node.module or "").startswith("lightning_tp."):
                target = node.module.removeprefix("lightning_tp").lstrip(".")
            else:
                continue
            imported.add(target)
            imported.update(f"{target}.{a.name}" if target else a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(
                a.name.removeprefix("lightning_tp.") for a in node.names if a.name.startswith("lightning_tp.")
            )
    return imported & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, first = last), or ``None``."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_package_has_no_import_cycle(tmp_path):
    """No module of the package imports, even lazily inside a function, a module that imports it back (``__init__``
    aside: it imports everything and nothing imports it)."""
    modules = _module_names()
    graph = {name: _imports_of(name, path, set(modules)) - {name} for name, path in modules.items()}
    assert graph["export"], "the graph misses imports"  # a sanity check of the parser: export imports checkpoint
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    sample = tmp_path / "strategy.py"  # as if lightning_tp/fabric/strategy.py
    sample.write_text("from . import x\nfrom ..a import b\nimport lightning_tp.c.d\nfrom lightning_tp import e\n")
    modules = {"fabric", "fabric.x", "a", "a.b", "c.d", "e", "unrelated"}
    assert _imports_of("fabric.strategy", sample, modules) == {"fabric", "fabric.x", "a", "a.b", "c.d", "e"}


def _subpackages() -> list[Path]:
    """The subpackages that are layers (each ``__init__`` saying what it may import); a package among
    :data:`BASE_MODULES` (``compat/``) is part of the lowest layer instead, checked module by module there."""
    return sorted(p.parent for p in PACKAGE.glob("*/__init__.py") if p.parent.name not in BASE_MODULES)


#: Modules of the package outside any subpackage that are a layer of their own, their docstring saying what they may
#: import as a subpackage's ``__init__`` does.
LAYER_MODULES = ("parallel_options", "stages", "parallelize")


def _may_import(init: Path) -> set[str]:
    """The layers a subpackage's (or a layer module's) docstring says it may import (its ``May import ...:``
    paragraph)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert "May import" in doc, f"{init}: the docstring must say what the layer may import"
    paragraph = doc.split("May import", 1)[1].split("\n\n", 1)[0]
    return {name.removeprefix("lightning_tp.") for name in re.findall(r"``([\w.]+)``", paragraph)}


def test_each_subpackage_imports_only_the_layers_its_docstring_allows():
    """The folders are layers: a subpackage imports its own modules and the layers its ``__init__`` docstring names,
    and those permissions form no cycle (so no import cycle can form between subpackages), at module level and
    inside functions alike. So does each of :data:`LAYER_MODULES` (``parallel_options.py``, ``stages.py``,
    ``parallelize.py``), by its own docstring."""
    modules = _module_names()
    allowed = {init.name: _may_import(init / "__init__.py") for init in _subpackages()}
    assert allowed, "no subpackage found"
    allowed.update({name: _may_import(modules[name]) for name in LAYER_MODULES})
    assert _cycle({layer: names & set(allowed) for layer, names in allowed.items()}) is None
    wrong = []
    for name, path in modules.items():
        layer = name.split(".")[0]
        if layer not in allowed:
            continue
        for target in _imports_of(name, path, set(modules)):
            other = target.split(".")[0]
            if other != layer and other not in allowed[layer]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, f"imports across layers the subpackages' docstrings do not allow: {wrong}"


def test_each_subpackage_lists_its_modules():
    """``__all__`` of each subpackage names its modules, so ``help(lightning_tp.parallel)`` shows the room."""
    for package in _subpackages():
        tree = ast.parse((package / "__init__.py").read_text())
        found = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"]
        assert found, f"{package.name}/__init__.py has no __all__"
        listed = ast.literal_eval(found[0].value)
        assert sorted(listed) == sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__"), package.name


def test_the_fast_tier_names_tests_that_exist():
    """A renamed test would leave ``pytest -m "not slow"`` without its launches, silently."""
    from tests.distributed.conftest import FAST_TIER

    for node in FAST_TIER:
        file, test = node.split("::")
        function, _, param = test.partition("[")
        source = (ROOT / "tests/distributed" / file).read_text()
        assert f"def {function}(" in source, node
        assert param.rstrip("]") in source or param.rstrip("]") in (ROOT / "tests/helpers/cases.py").read_text(), node


#: The lowest layer: modules every other layer may import, which import nothing of the package above them. A package
#: among them (``compat/``) is so with every module in it.
BASE_MODULES = {"compat", "composition", "layout", "options", "patches", "state"}


def _is_base(name: str) -> bool:
    return name.split(".")[0] in BASE_MODULES


def test_the_lowest_modules_import_nothing_above_them():
    """Each module of the lowest layer, each module of ``compat/`` included, imports only modules of that layer."""
    modules = _module_names()
    assert BASE_MODULES <= set(modules), sorted(BASE_MODULES - set(modules))
    base = sorted(name for name in modules if _is_base(name))
    assert "compat.torch_distributed" in base, "the modules of compat/ are checked too"
    above = {name: {t for t in _imports_of(name, modules[name], set(modules)) if not _is_base(t)} for name in base}
    above = {name: targets for name, targets in above.items() if targets}
    assert not above, f"the lowest modules import upward: {above}"


def test_compat_exports_every_name_of_its_modules():
    """``lightning_tp.compat`` (``compat/__init__.py``) re-exports every name its modules list in ``__all__``, and
    each module's ``__all__`` lists its public names: ``from lightning_tp.compat import X`` works for each of them."""
    import importlib

    compat = importlib.import_module("lightning_tp.compat")
    exported = []
    for path in sorted((PACKAGE / "compat").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"lightning_tp.compat.{path.stem}")
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        public = {name for name in defined if not name.startswith("_")}
        assert public <= set(module.__all__), f"{path.name}: not in its __all__: {sorted(public - set(module.__all__))}"
        for name in module.__all__:
            assert getattr(compat, name, None) is getattr(module, name), f"lightning_tp.compat.{name} ({path.name})"
        exported += module.__all__
    assert sorted(compat.__all__) == sorted(exported)


#: Attributes of objects this package does not own (a Transformers model, its modules, torch's layers, Lightning's
#: plugins) that it changes: each change goes through ``lightning_tp/patches.py`` (recorded, undone by its owner).
FOREIGN_ATTRIBUTES = {
    "loss_function",
    "_loss_function",
    "config",
    "padding_idx",
    "forward",
    "generate",
    "save_pretrained",
    "clip_grad_by_norm",
    "_distribute_tensors",
}
#: Writes to an imported module's attribute outside patches.py, each with why it is not a patch.
MODULE_WRITES_ALLOWED = {
    ("compat/torch_distributed.py", "_random._rng_tracker"): "torch's own lazily created tracker, created early",
}


def _foreign_writes(source: str, where: str) -> list[str]:
    """The direct writes in ``source`` of a foreign attribute (:data:`FOREIGN_ATTRIBUTES`, by assignment or
    ``setattr``/``delattr`` with a literal name) or of an imported module's attribute."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in [t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])]:
            if not isinstance(target, ast.Attribute) or (
                isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
            ):
                continue
            text = ast.unparse(target)
            is_module = isinstance(target.value, ast.Name) and target.value.id in imported
            if target.attr in FOREIGN_ATTRIBUTES or (is_module and (where, text) not in MODULE_WRITES_ALLOWED):
                found.append(f"{where}:{node.lineno}: {text}")
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in FOREIGN_ATTRIBUTES
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_foreign_write_goes_through_patches():
    """Every change of an object this package does not own is a patch (recorded with what it replaced, undone by its
    owner), not a direct assignment: a model's loss function and config, an embedding's padding index, a module's
    forward, torch's functions."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where != "patches.py":
            found += _foreign_writes(path.read_text(), where)
    assert not found, "direct writes to foreign objects (use lightning_tp.patches):\n" + "\n".join(found)


def test_the_foreign_write_check_catches_each_kind():
    source = (
        "import torch.distributed._state_dict_utils as utils\n"
        "def f(model, module, fn):\n"
        "    model.loss_function = fn\n"
        "    module.config = fn\n"
        "    setattr(module, 'padding_idx', 0)\n"
        "    utils._distribute_tensors = fn\n"
        "    self_like = model\n"
        "    self_like.other = 1\n"
    )
    found = _foreign_writes(source, "x.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "model.loss_function",
        "module.config",
        "utils._distribute_tensors",
        "setattr(module, 'padding_idx', 0)",
    ], found


def test_test_files_have_unique_basenames():
    """pytest imports a test module by its basename (the test folders are not packages): two files of one name, one in
    tests/unit and one in tests/distributed, stop the whole suite at collection (found when the dry run's real-rank
    check first shared the unit tests' name)."""
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert not sorted({name for name in names if names.count(name) > 1})
