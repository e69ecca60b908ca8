"""Each chapter's lesson is the diff of its train_llm.py against the previous chapter's, and of each
module it grows against the chapter that teaches it.

    python -m tools.diff 01 02      # print the diff between chapters 01 and 02
    python -m tools.diff 04 07      # chapter 07 (context parallel) builds on chapter 04
    python -m tools.diff 04 08      # chapter 08 (pipeline parallel) too
    python -m tools.diff 04 09      # and chapter 09 (expert parallel)
    python -m tools.diff 05 10      # chapter 10 (every parallelism) builds on chapter 05 (FSDP x TP)
    python -m tools.diff 08 10 pipeline  # what chapter 10 adds to chapter 08's pipeline.py
    python -m tools.diff --update   # rewrite the diff embedded in every chapter README

A chapter README embeds its diff between two markers, which `--update` rewrites and the test
suite checks, so the diff a reader sees is never stale:

    <!-- diff: 01-single-gpu/train_llm.py 02-multi-gpu/train_llm.py -->
    ...
    <!-- end diff -->
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- diff: (\S+) (\S+) -->\n.*?<!-- end diff -->", re.DOTALL)


def chapters() -> list[Path]:
    """Chapter folders (`01-single-gpu`, ...) that hold a train_llm.py, in reading order."""
    return sorted(p.parent for p in REPO.glob("[0-9][0-9]-*/train_llm.py"))


# A chapter's README embeds its diff against the chapter before it, or against the one it builds on:
# context parallel is chapter 04's FSDP plus CP, the layout long-context training runs; pipeline parallel
# is chapter 04's FSDP within each stage, plus the stages; expert parallel, chapter 04's FSDP of the
# dense weights, plus the experts over their own ranks. The composed chapter is chapter 05's FSDP x TP,
# plus 07's context parallel and 08's stages on one mesh.
BASES = {"07-context-parallel": "04-fsdp", "08-pipeline-parallel": "04-fsdp", "09-expert-parallel": "04-fsdp",
         "10-nd-parallel": "05-tensor-parallel"}  # fmt: skip


def base(chapter_dir: Path) -> Path:
    """The chapter whose train_llm.py `chapter_dir`'s is diffed against."""
    found = chapters()
    return REPO / BASES[chapter_dir.name] if chapter_dir.name in BASES else found[found.index(chapter_dir) - 1]


def module_sources(chapter_dir: Path) -> dict[str, Path]:
    """The modules beside `chapter_dir`'s script that an earlier chapter teaches, each with the
    first chapter holding a module of that name, the one that teaches it: carried from there
    unchanged, or grown (its diff from there embedded in the chapter's README)."""
    earlier = chapters()[: chapters().index(chapter_dir)]
    found = {}
    for path in sorted(chapter_dir.glob("*.py")):
        sources = [folder for folder in earlier if (folder / path.name).is_file()]
        if path.name != "train_llm.py" and sources:
            found[path.name] = sources[0]
    return found


def chapter(number: str) -> Path:
    found = [p for p in chapters() if p.name.startswith(f"{int(number):02d}-")]
    if not found:
        raise SystemExit(f"error: no chapter {number!r}; chapters: {', '.join(p.name for p in chapters())}")
    return found[0]


def unified_diff(old: str, new: str) -> str:
    """The diff between two files given relative to the repo root, labelled with those paths.
    difflib.unified_diff's matcher treats lines as frequent as blank ones as junk (its autojunk):
    a new function would show the blank lines around it removed and added again. Not here."""
    a, b = ((REPO / path).read_text().splitlines(keepends=True) for path in (old, new))
    lines = [f"--- a/{old}\n", f"+++ b/{new}\n"]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        lines.append(f"@@ -{_range(i1, i2)} +{_range(j1, j2)} @@\n")
        for tag, i1, i2, j1, j2 in group:
            lines += [" " + line for line in a[i1:i2]] if tag == "equal" else []
            lines += ["-" + line for line in a[i1:i2]] if tag in ("replace", "delete") else []
            lines += ["+" + line for line in b[j1:j2]] if tag in ("replace", "insert") else []
    return "".join(lines) if len(lines) > 2 else ""


def _range(start: int, stop: int) -> str:
    """A hunk's lines as unified diffs write them: "start,count" from 1 (difflib's format)."""
    length = stop - start
    return f"{start + 1}" if length == 1 else f"{start + (length > 0)},{length}"


def render_block(old: str, new: str) -> str:
    diff = unified_diff(old, new)
    lines = [line for line in diff.splitlines() if not line.startswith(("+++", "---"))]
    added, removed = sum(line.startswith("+") for line in lines), sum(line.startswith("-") for line in lines)
    size = f"The diff: {added + removed} changed lines, {added} added and {removed} removed."
    return f"<!-- diff: {old} {new} -->\n{size}\n\n```diff\n{diff}```\n<!-- end diff -->"


def updated_readme(text: str) -> str:
    """The README text with every embedded diff block regenerated from the current code."""
    return _BLOCK.sub(lambda m: render_block(m.group(1), m.group(2)), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", nargs="?", help="chapter number, e.g. 01")
    parser.add_argument("new", nargs="?", help="chapter number, e.g. 02")
    parser.add_argument("module", nargs="?", default="train_llm", help="a module of both, e.g. pipeline")
    parser.add_argument("--update", action="store_true", help="rewrite the diffs embedded in chapter READMEs")
    args = parser.parse_args()
    if args.update:
        for readme in REPO.glob("[0-9][0-9]-*/README.md"):
            text = readme.read_text()
            if updated_readme(text) != text:
                readme.write_text(updated_readme(text))
                print(f"updated {readme.relative_to(REPO)}")
    elif args.old and args.new:
        old, new = chapter(args.old), chapter(args.new)
        sys.stdout.write(unified_diff(f"{old.name}/{args.module}.py", f"{new.name}/{args.module}.py"))
    else:
        parser.error("give two chapter numbers (e.g. 01 02), or --update")


if __name__ == "__main__":
    main()
