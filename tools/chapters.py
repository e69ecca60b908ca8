"""A chapter's own module, for the tools that count or run what the chapters do.

The planner follows the chapters' rules rather than copying them: which layers chapter 06 puts in
FP8 (06-fp8/torchao_fp8.py), how chapter 08 cuts the stages (08-pipeline-parallel/pipeline.py). Each
is loaded from its file, by path, under a name of its own: no chapter folder stays on sys.path,
where the modules that several chapters carry under one name (tp.py in 05, 06 and 10, pipeline.py
in 08 and 10) would shadow each other.

    pipeline = chapter_module("08-pipeline-parallel", "pipeline")
    chapter = chapter_module("05-tensor-parallel")  # its train_llm.py

A module imports the modules beside it by their plain names (06's torchao_fp8 imports tp, each
train_llm.py its published): while it loads, its folder comes first on sys.path and the other
chapters' modules of those names step aside in sys.modules; then both are as they were. The modules
it imported stay with it (chapter_module("06-fp8", "torchao_fp8").tp is 06's tp.py), and `common`, a
package of the repository, is shared as usual. Loaded once per process (the chapters' modules keep
no state a tool changes).
"""

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def chapter_module(chapter: str, name: str = "train_llm") -> ModuleType:
    """`chapter`'s module `name` (its folder's name.py, by default its script), loaded from its
    file, registered in sys.modules as chapter<NN>_<name> (chapter08_pipeline)."""
    folder = REPO / chapter
    path = folder / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path.relative_to(REPO)}: no such chapter module")
    beside = {p.stem for p in folder.glob("*.py")}  # the names its imports may find in its folder
    stepped_aside = {n: sys.modules.pop(n) for n in beside if n in sys.modules}
    qualified = f"chapter{chapter[:2]}_{name}"
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module  # dataclasses and pickling look a module up by its name
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]
        raise
    finally:
        sys.path.remove(str(folder))
        for n in beside:  # this chapter's, now held by the modules that imported them
            sys.modules.pop(n, None)
        sys.modules.update(stepped_aside)
    return module
