"""The package's import graph, read from the source with `ast`: the house rules of README's Layout.

Every import counts, those inside functions too (they hide a circle, they do not remove it), except the
ones under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dgemma

ROOT = Path(dgemma.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The dgemma modules `tree` imports at run time: `from a.b import c` is a.b.c when c is a module."""
    found: set[str] = set()

    def visit(node: ast.AST):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    return {name: _imported(ast.parse(path.read_text()), name, path.name == "__init__.py", set(paths)) - {name}
            for name, path in paths.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking_ones():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dgemma.b import X\n"
              "def f():\n    from dgemma import c\n    from .d import Y\n")
    modules = {"dgemma.a", "dgemma.b", "dgemma.c", "dgemma.d", "dgemma"}
    assert _imported(ast.parse(source), "dgemma.a", False, modules) == {"dgemma.c", "dgemma.d"}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_server_and_its_command_import_dgemma_serving():
    outside = {name: sorted(m for m in imports if m == "dgemma.serving" or m.startswith("dgemma.serving."))
               for name, imports in import_graph().items()
               if not (name.startswith("dgemma.serving") or name == "dgemma.commands.serve")}
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_server_knows_no_task():
    """dgemma serve's command reads the model's task and hands the server its codec (ServerSettings.codec): nothing
    in dgemma/serving imports dgemma.tasks."""
    found = {name: sorted(m for m in imports if m == "dgemma.tasks" or m.startswith("dgemma.tasks."))
             for name, imports in import_graph().items() if name.startswith("dgemma.serving")}
    assert {name: tasks for name, tasks in found.items() if tasks} == {}


def test_no_import_circles():
    assert _circles(import_graph()) == []


def test_nothing_imports_the_cli_but_the_entry_point():
    """cli.py sits on top (it dispatches to commands/): an import of it from below runs back up."""
    assert sorted(name for name, imports in import_graph().items() if "dgemma.cli" in imports) == ["dgemma.__main__"]


def test_only_the_cli_imports_the_commands():
    """commands/ sits under cli.py and over everything else: the server takes what it needs of the flags as its
    settings and a model loader (serving/server.py), never by importing a command."""
    found = sorted(name for name, imports in import_graph().items()
                   if not (name == "dgemma.cli" or name.startswith("dgemma.commands"))
                   and any(m == "dgemma.commands" or m.startswith("dgemma.commands.") for m in imports))
    assert found == []


def test_the_device_module_sits_at_the_bottom():
    """dgemma.devices is asked by the model, training and the commands alike: it imports no dgemma module."""
    assert import_graph()["dgemma.devices"] == set()


# What a machine can do, each asked of torch or the OS once, in dgemma/devices.py (memoised there)
PROBES = ("cuda.is_available(", "is_bf16_supported(", "_is_mkldnn_bf16_supported(", "get_cpu_capability(",
          "/proc/cpuinfo", "hasattr(torch.ops")


def test_capability_probes_are_asked_of_dgemma_devices():
    found = {f"{path.relative_to(ROOT.parent)}: {probe}" for path in ROOT.rglob("*.py") if path.name != "devices.py"
             for probe in PROBES if probe in path.read_text()}
    assert sorted(found) == []


# The house, bottom to top: a module imports only from its own room and the rooms below it (README's Layout).
HOUSE = ("config", "devices", "device_sync", "processes", "tokenizer", "images",  # the ground floor
         "model",  # the network alone
         "quant", "compilation", "weights", "parallel",  # what is done to the network: kernels, compiling, files, ranks
         "sampling", "structured", "generation", "engine",  # generating
         "chat", "tasks", "training", "serving",  # the users of generation
         "benchmarking",  # what `dgemma bench` measures with
         "commands", "cli", "__main__")
# Old import paths kept for one release with a DeprecationWarning (CHANGELOG.md): they point up on purpose.
DEPRECATED_ALIASES = {"dgemma.model.parallel", "dgemma.model.parallel_load"}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dgemma"


def test_imports_flow_down_the_house():
    rank = {room: i for i, room in enumerate(HOUSE)}
    found = sorted(f"{name} -> {m}" for name, imports in import_graph().items()
                   if _room(name) != "dgemma" and name not in DEPRECATED_ALIASES
                   for m in imports if _room(m) != "dgemma" and rank[_room(m)] > rank[_room(name)])
    assert found == []
    assert {_room(name) for name in import_graph()} <= set(HOUSE) | {"dgemma"}  # a new room is placed in HOUSE


def test_the_model_room_holds_the_network_alone():
    """dgemma/model/ knows nothing of files, kernels, ranks or compiling: it imports the ground floor only."""
    ground = set(HOUSE[:HOUSE.index("model")])
    found = sorted(f"{name} -> {m}" for name, imports in import_graph().items()
                   if _room(name) == "model" and name not in DEPRECATED_ALIASES
                   for m in imports if _room(m) not in ground | {"model"})
    assert found == []


# Rules written once: each pattern may appear only in the file that defines the rule.
ONE_DEFINITION = {
    "% GROUP_SIZE[": "dgemma/quant/formats.py",  # the int8/int4 group size and its fallback (`group_size`)
    # the default dtype: every caller takes `devices.default_dtype` (which says why); nothing else asks whether
    # bf16 is fast or measures it (tests/test_devices.py holds that each command asks it)
    "fast_bf16(": "dgemma/devices.py", "bf16_per_fp32(": "dgemma/devices.py", "onednn_runs_bf16(": "dgemma/devices.py",
    "/ GROUP_SIZE[": "dgemma/quant/quantize.py",  # a weight's share of its group's scale (`bytes_per_weight`)
}


def test_rules_written_once_stay_where_they_are_defined():
    found = sorted(f"{path.relative_to(ROOT.parent)}: {pattern}" for path in ROOT.rglob("*.py")
                   for pattern, home in ONE_DEFINITION.items()
                   if pattern in path.read_text() and str(path.relative_to(ROOT.parent)) not in (
                       home if isinstance(home, tuple) else (home,)))
    assert found == []


def test_modules_and_functions_stay_readable():
    """No module in dgemma/ over 500 lines, no function over 100."""
    long_modules, long_functions = [], []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 500:
            long_modules.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long_functions.append(f"{path.relative_to(ROOT.parent)}: {node.name} ({node.end_lineno - node.lineno + 1})")
    assert long_modules == [] and long_functions == []


# -- what tests and benchmarks take from the commands, and the rules they share with the package -------------
REPO = ROOT.parent
OUTSIDE = ("tests", "benchmarks", "scripts")  # the folders beside the package that import it


def _outside_files() -> list[Path]:
    """Their Python files, this one aside (it names what it looks for)."""
    return sorted(path for folder in OUTSIDE for path in (REPO / folder).rglob("*.py")
                  if path != Path(__file__).resolve())


def _names_from_commands(tree: ast.AST) -> set[str]:
    """The names a file imports from dgemma.commands (`from dgemma.commands.x import a` -> "x.a"), modules too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] == ["dgemma", "commands"]:
            module = node.module.removeprefix("dgemma.commands").lstrip(".") or "(package)"
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dgemma.commands"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "dgemma.commands" in node.value:
            try:  # a script a test runs in a child process
                found |= _names_from_commands(ast.parse(node.value))
            except SyntaxError:
                pass  # prose
    return found


# What tests and benchmarks may take from commands/: the command line itself (flags, their readers, what a
# command draws on the terminal), to test it. A library function they need comes from a library room; a name
# added here is a decision that it belongs to the command line.
COMMAND_LINE_NAMES = {
    "_common.add_compile_arguments", "_common.add_sampling_arguments", "_common.plot_file",
    "_common.resolve_device_dtype", "_common.step_cache_overrides", "_common.wants_compile",
    "_terminal.DraftView", "chat.AnswerPrinter", "train.config_from_args",
}


def test_tests_and_benchmarks_take_only_the_command_line_from_the_commands():
    found: dict[str, list[str]] = {}
    for path in _outside_files():
        for name in _names_from_commands(ast.parse(path.read_text())) - COMMAND_LINE_NAMES:
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert found == {}


# A process's resident memory is read from /proc in one place, `dgemma.processes.resident_memory` (and its peak
# restarted in `restart_peak_rss`): these strings in code (not in docstrings) anywhere else are another copy.
RSS_READS = ("VmRSS", "VmHWM", "RssAnon", "clear_refs", "/status")


def _code_strings(tree: ast.AST) -> list[str]:
    """String constants outside docstrings (an f-string's literal parts included)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_resident_memory_is_read_in_one_place():
    paths = [*ROOT.rglob("*.py"), *_outside_files()]  # the package, its tests, benchmarks and scripts
    found = sorted(f"{path.relative_to(REPO)}: {text!r}" for path in paths if path != ROOT / "processes.py"
                   for text in _code_strings(ast.parse(path.read_text())) if any(r in text for r in RSS_READS))
    assert found == []
