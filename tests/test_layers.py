"""The packages import one way: runtime <- checkpointing <- trainer <- verifier <- launch (README's map).

Parsed from the source (every import statement, including those inside functions), so a new
import against the grain fails here before anyone reads it.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each layer may import itself and the layers listed; nothing else of ours.
ALLOWED = {
    "runtime": {"runtime"},
    "checkpointing": {"checkpointing", "runtime"},
    "trainer": {"trainer", "runtime", "checkpointing"},
    "verifier": {"verifier", "trainer", "runtime", "checkpointing"},
    "launch": {"launch", "verifier", "trainer", "runtime", "checkpointing"},
}
OURS = set(ALLOWED) | {"benchmarks", "tests", "examples"}


def imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & OURS


def test_layers_import_one_way():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for package in sorted(imported_packages(path) - allowed):
                wrong.append(f"{path.relative_to(ROOT)} imports {package}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    """The parser finds imports at any depth (a function's body too), in both forms."""
    source = tmp_path / "probe.py"
    source.write_text("import os\ndef f():\n    from trainer import loop\n    import launch.pod\n")
    assert imported_packages(source) == {"trainer", "launch"}


@pytest.mark.parametrize("module", ["runtime.entry", "runtime.distributed", "runtime.exit_codes", "runtime.logs",
                                    "trainer.config", "launch.tpu.recipe", "launch.gke.manifest"])
def test_start_up_and_recipes_import_no_jax(module):
    """The trainer holds SIGTERM before importing JAX (about a second), and the cloud recipes only
    validate and print: none of these may import it."""
    code = f"import sys, {module}; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def checkpointing_imports(path: pathlib.Path) -> list[str]:
    """Every name `path` takes from checkpointing: 'name' for a public one, 'module:x' for the rest."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"module:{a.name}" for a in node.names if a.name.startswith("checkpointing")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "checkpointing":
                found += [alias.name for alias in node.names]
            elif node.module.startswith("checkpointing."):
                found.append(f"module:{node.module}")
    return found


# The service's public modules, by who may use them: a loop (ours in trainer/, a user's in examples/) the
# names of `checkpointing`, its config and errors, and what a workdir holds; our verifier and launchers also
# what a verifier needs. checkpointing/_src/ is private to checkpointing (its own tests and benchmarks aside).
LOOP_MODULES = {"module:checkpointing.config", "module:checkpointing.errors", "module:checkpointing.inspection"}
PUBLIC_MODULES = {"trainer": LOOP_MODULES, "examples": LOOP_MODULES,
                  "verifier": LOOP_MODULES | {"module:checkpointing.verification"},
                  "launch": LOOP_MODULES | {"module:checkpointing.verification"}}


def test_the_trainer_and_the_verifier_use_only_public_names():
    """trainer/ uses the service exactly as a user's loop does (`checkpointing`'s names, its config, errors and
    inspection), the verifier and launchers through `checkpointing.verification` too; none reaches _src/."""
    import checkpointing

    wrong = [f"{path.relative_to(ROOT)}: {name}" for layer, allowed in PUBLIC_MODULES.items()
             for path in sorted((ROOT / layer).rglob("*.py"))
             for name in checkpointing_imports(path) if name not in set(checkpointing.__all__) | allowed]
    assert not wrong, "imports of checkpointing internals:\n" + "\n".join(wrong)
    assert all(getattr(checkpointing, name) is not None for name in checkpointing.__all__)
    assert len(checkpointing.__all__) <= 10, checkpointing.__all__


def test_the_public_names_check_sees_an_internal_import(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from checkpointing import Checkpointer, service\nfrom checkpointing.saver import Saver\n")
    assert checkpointing_imports(source) == ["Checkpointer", "service", "module:checkpointing.saver"]


def module_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere (inside functions and TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            named = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found.update(named or ({node.module} & modules))
    return found


def import_circles(layers: tuple[str, ...]) -> list[list[str]]:
    """The circles of files among these layers' modules (a subpackage's __init__ is its module; a layer's own
    __init__ is left out: checkpointing's loads its names lazily, the others are empty)."""
    paths = {}
    for layer in layers:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if len(parts) > 1:
                paths[".".join(parts)] = path
    graph = {module: module_imports(path, set(paths)) - {module} for module, path in paths.items()}
    circles, seen = [], set()
    for start in sorted(graph):
        reach = _reaches(graph, start)
        if start in reach and start not in seen:
            circle = sorted(m for m in reach if m == start or start in _reaches(graph, m))
            seen.update(circle)
            circles.append(circle)
    return circles


def _reaches(graph: dict, start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    stack, reach = [start], set()
    while stack:
        for nxt in graph[stack.pop()] - reach:
            reach.add(nxt)
            stack.append(nxt)
    return reach


# None (docs/layout.md): trainer/config.py is a leaf; what needs the model registry is above it. Any circle fails.
KNOWN_CIRCLES = []


def test_no_circles_of_files_not_even_through_imports_inside_functions():
    assert import_circles(("runtime", "checkpointing", "trainer", "verifier", "launch")) == KNOWN_CIRCLES


def test_the_circle_check_sees_one_hidden_inside_a_function(tmp_path, monkeypatch):
    package = tmp_path / "runtime"
    package.mkdir()
    (package / "a.py").write_text("from runtime import b\n")
    (package / "b.py").write_text("def f():\n    from runtime.a import thing\n")
    (package / "c.py").write_text("import runtime.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles(("runtime",)) == [["runtime.a", "runtime.b"]]
