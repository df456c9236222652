"""The repository's shape: the library in recipe/, one folder per concern, each saying what it owns; imports, inside
functions too, run one way through the layers below, with no cycle between modules; the root keeps what a user runs."""

import ast
from pathlib import Path

from recipe.model.model_files import REPO_DIR

# The package's folders from the lowest to the highest: a module imports its own folder's and lower folders' modules
LAYERS = ["compat", "platform", "model", "data", "planning", "engines", "settings", "reporting"]
ROOT = {"train", "utils", "evaluate", "export", "memory", "distributed"}  # the recipe, its builders and the commands


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in (REPO_DIR / "recipe").rglob("*.py"):
        parts = path.relative_to(REPO_DIR).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(path: Path) -> set[str]:
    """The recipe's modules (and root modules) `path` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    modules = package_modules()
    return {name for name in names if name in modules or name in ROOT}


def layer(module: str) -> int:
    if module in ROOT:
        return len(LAYERS)
    folder = module.split(".")[1] if module.count(".") else "compat"
    return LAYERS.index(folder)


def test_every_import_runs_down_the_layers():
    upward = {(module, target) for module, path in package_modules().items() if module != "recipe"
              for target in imported(path) if layer(target) > layer(module)}
    assert not upward, upward


def test_no_module_imports_one_that_imports_it_back():
    graph = {module: {t for t in imported(path) if t in package_modules() and t != module}
             for module, path in package_modules().items()}
    graph = {module: {t for t in targets if not package_modules()[t].name == "__init__.py"}
             for module, targets in graph.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return trail + [start]
                if nxt not in trail:
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [cycle for module in graph if (cycle := cycle_from(module))]
    assert not cycles, cycles[0]


def test_the_root_keeps_what_a_user_runs_and_each_folder_says_what_it_owns():
    assert {path.stem for path in REPO_DIR.glob("*.py")} == ROOT
    for folder in ["recipe", *(f"recipe/{name}" for name in LAYERS if name != "compat")]:
        docstring = ast.get_docstring(ast.parse((REPO_DIR / folder / "__init__.py").read_text()))
        assert docstring and len(docstring) > 80, folder


def test_no_line_of_code_or_config_passes_120_columns():
    """Python, shell, YAML and the Makefile (Markdown tables may be wider)."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.yaml", "*.sbatch", "Makefile"], cwd=REPO_DIR,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked
    long = [f"{name}:{number}" for name in tracked if (REPO_DIR / name).is_file()
            for number, line in enumerate((REPO_DIR / name).read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def test_only_the_launch_module_and_the_hardware_probe_touch_the_environment():
    """Everyone else is handed the settled launch (recipe/platform/launch.py); what the recipe writes into the
    environment for a library to read is a patch in recipe/compat.py."""
    allowed = {REPO_DIR / "recipe" / "platform" / "launch.py", REPO_DIR / "recipe" / "platform" / "hardware.py"}
    touching = []
    for path in [*REPO_DIR.glob("*.py"), *(REPO_DIR / "recipe").rglob("*.py")]:
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
                touching.append(f"{path.relative_to(REPO_DIR)}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    alias.name in ("environ", "getenv") for alias in node.names):
                touching.append(f"{path.relative_to(REPO_DIR)}:{node.lineno}")
    assert not touching, touching


def test_rank_0_is_asked_one_way():
    """`Launch.is_rank0` of the settled launch; compat mirrors accelerate's own test inside the function it wraps."""
    asked = []
    for path in [*REPO_DIR.glob("*.py"), *(REPO_DIR / "recipe").rglob("*.py")]:
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("get_rank", "is_main_process", "is_local_main_process",
                                                                  "is_world_process_zero", "process_index"):
                asked.append(f"{path.relative_to(REPO_DIR)}:{node.lineno}")
    assert not asked, asked
