"""Rules of the source that a fork inherits, read from it (ast), not run.

A collective is joined by every rank of its group, in the same order; a fork that calls one on rank
0 only, or under a condition some ranks skip, hangs with no hint (until --dist-timeout). So every
function of the chapters and common/ that runs one, itself or through the functions it calls, says
so: its docstring's first line is "Every rank calls this" (or its name starts with "agree": it agrees
on something with every rank), and no call of one sits under a condition on the rank.

The primitives are torch.distributed's collectives, DCP's save
and load, a DTensor's full_tensor(), and the few torch functions the chapters call that run them
(PRIMITIVES); a function that calls a function of the same folder, of common/, or of a chapter's
own module (published.x, pipeline.x, ...) that runs one, runs one too.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRIMITIVES = {
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
    "gather_object", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "scatter",
    "send", "recv", "all_to_all_single_autograd", "full_tensor", "new_group", "init_device_mesh",
    "consolidate_safetensors_files_on_every_rank", "set_model_state_dict", "async_save",
}  # fmt: skip
DCP = {"save", "load"}  # dcp.save, dcp.load
SAYS_SO = "Every rank calls this"


def sources() -> list[Path]:
    """What a fork runs, and the tools that run the chapters' collectives (the preflight's)."""
    chapters = sorted(REPO.glob("[0-9][0-9]-*/*.py")) + sorted((REPO / "common").glob("*.py"))
    return chapters + sorted((REPO / "tools").glob("*.py"))


def calls(node) -> set[tuple[str | None, str]]:
    """(base, name) of each call in `node`: dist.barrier() is ("dist", "barrier"), f() (None, "f")."""
    found = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            base = call.func.value.id if isinstance(call.func.value, ast.Name) else "?"  # a.b.f()
            found.add((base, call.func.attr))
        elif isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            found.add((None, call.func.id))
    return found


def functions() -> dict[tuple[Path, str], tuple[ast.AST, str]]:
    """Every function and method by (file, name), with its docstring; a class by its name, standing
    for its __init__, with the class's docstring (where a constructor's collective is said)."""
    found = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name != "__init__":
                found.setdefault((path, node.name), (node, ast.get_docstring(node) or ""))
            elif isinstance(node, ast.ClassDef):
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                found[(path, node.name)] = (init or node, ast.get_docstring(node) or "")
    return found


def resolve(path: Path, base: str | None, name: str) -> list[tuple[Path, str]]:
    """The functions a call may be: f() and self.f() of the same file (and a.b.f(): a method of
    another class of the file), common.f() of common/, pipeline.f() (experts.f(), ...) of the
    chapter's module of that name, published.f() of common/published.py."""
    if base in (None, "self", "?"):
        return [(path, name)]
    if base == "common":
        return [(module, name) for module in sorted((REPO / "common").glob("*.py"))]
    beside = path.parent / f"{base}.py"
    return [(beside if beside.exists() else REPO / "common" / f"{base}.py", name)]  # from common import x


def primitive(base: str | None, name: str) -> bool:
    return (name in PRIMITIVES and base in (None, "dist", "funcol", "?") or name == "full_tensor"
            or base == "dcp" and name in DCP)  # fmt: skip


def collective_functions() -> dict[tuple[Path, str], str]:
    """(file, name) of each function that runs a collective: what it runs, or whose call runs one.
    In a file that imports loss_parallel, a cross-entropy is one: of logits split over the tp ranks,
    it all-reduces their parts (the chapters' loss functions, called under loss_parallel)."""
    defined = functions()
    under_loss_parallel = {path for path in sources() if "loss_parallel" in imported_names(ast.parse(path.read_text()))}
    running = {}
    for key, (node, _) in defined.items():
        for base, name in calls(node):
            if primitive(base, name) or (name == "cross_entropy" and key[0] in under_loss_parallel):
                running[key] = f"{base}.{name}" if base else name
    changed = True
    while changed:
        changed = False
        for key, (node, _) in defined.items():
            if key in running:
                continue
            for base, name in calls(node):
                where = [other for other in resolve(key[0], base, name) if other in running]
                if where:
                    running[key] = f"{name}, which runs {running[where[0]]}"
                    changed = True
                    break
    return running


def test_every_function_that_runs_a_collective_says_so():
    defined = functions()
    silent = []
    for (path, name), why in sorted(collective_functions().items()):
        if name.startswith("_") or name in ("hook", "forward"):
            continue  # not called by a reader: a private helper or a hook, run by its public caller
        node, doc = defined[(path, name)]
        said = doc.startswith("Every rank" if isinstance(node, ast.ClassDef) or node.name == "__init__" else SAYS_SO)
        if name != "main" and not name.startswith("agree") and not said:
            silent.append(f"{path.relative_to(REPO)}: {name} (runs {why})")
    assert not silent, f'docstrings that should begin "{SAYS_SO}":\n' + "\n".join(silent)


def test_no_collective_runs_under_a_condition_on_the_rank():
    """`if rank == 0: evaluate(...)` would leave rank 0 alone in evaluate's all-reduce."""
    running = collective_functions()
    found = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.If) or "rank" not in ast.unparse(node.test):
                continue
            for statement in node.body + node.orelse:
                for base, name in calls(statement):
                    if primitive(base, name) or any(f in running for f in resolve(path, base, name)):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name} under `if {ast.unparse(node.test)}`")
    assert not found, "\n".join(found)


def imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_no_local_name_shadows_an_import():
    """`ring = contextlib.ExitStack()` in a function of a file that imports `ring` makes every
    `ring.check_batch(...)` after it in that function a call on the stack: a trap for a fork."""
    found = []
    for path in [*sources(), *sorted((REPO / "tools").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        imported = imported_names(tree)
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))):
            arguments = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
            stored = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for name in sorted((stored | arguments) & imported):
                found.append(f"{path.relative_to(REPO)}:{function.lineno}: {name}")
    assert not found, "local names that shadow an import:\n" + "\n".join(found)


def test_common_names_no_chapter():
    """common/ is what every chapter shares, and a fork copies it with one chapter: it names none."""
    import re

    named = []
    for path in sorted((REPO / "common").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b[Cc]hapters? \d|\b\d\d-[a-z]", line):
                named.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not named, "\n".join(named)


def test_no_assert_in_what_a_fork_runs():
    """python -O (PYTHONOPTIMIZE) drops every assert, with what its expression does:
    `assert not set_model_state_dict(...).missing_keys` sent no weights at all. A check the chapters
    need raises; nothing they run sits in an assert."""
    found = [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"
             for path in sources() for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert not found, "\n".join(found)


def test_no_chapter_names_a_later_one():
    """No chapter holds code for a later one: its modules and script name no later chapter (a branch,
    a parameter or a comment for chapter 10 in chapter 08's module would be chapter 10's lesson)."""
    import re

    found = []
    for path in sorted(REPO.glob("[0-9][0-9]-*/*.py")):
        number = int(path.parent.name[:2])
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            later = [n for n in re.findall(r"\b[Cc]hapters? (\d\d)\b|\((\d\d)\)", line) for n in n if n]
            if any(int(n) > number for n in later):
                found.append(f"{path.relative_to(REPO)}:{line_number}: {line.strip()}")
    assert not found, "\n".join(found)
