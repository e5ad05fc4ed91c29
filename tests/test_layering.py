"""The layout's rules (docs/architecture.md): stages do not import each other, proto
imports nothing of this project, and the control plane never imports the workers. Read
from the source (every import, module level or inside a function), so a lazy import
cannot hide a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The frontend process is api/ + server/; each other stage is its package.
STAGES = {"api": "frontend", "server": "frontend", "tokenizer": "tokenizer",
          "scheduler": "scheduler", "detokenizer": "detokenizer"}
# Shared by every stage that needs a vocabulary: loading tokenizer.json or a GGUF's vocabulary
# (ARCHITECTURE.md: tokenizer/ holds the stage *and* the loaders).
SHARED = ("pocketllm.tokenizer.tokenizer", "pocketllm.tokenizer.gguf_vocab",
          "pocketllm.tokenizer.gguf_pretokenizers")


def imports(path: Path, package: str) -> set[str]:
    """Absolute names of every module ``path`` (a module of ``package``) imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)
    return out


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "pocketllm":
        return STAGES.get(parts[1])
    return None


def test_stages_do_not_import_each_other():
    problems = []
    for pkg, stage in STAGES.items():
        for path in sorted((ROOT / "pocketllm" / pkg).glob("*.py")):
            for name in imports(path, f"pocketllm.{pkg}"):
                other = stage_of(name)
                if other is not None and other != stage and not name.startswith(SHARED):
                    problems.append(f"{path.relative_to(ROOT)} imports {name} ({other} stage)")
    assert not problems, "\n".join(problems)


def test_proto_imports_nothing_of_the_project():
    problems = [f"{path.name} imports {name}" for path in sorted((ROOT / "proto").glob("*.py"))
                for name in imports(path, "pocketllm.proto")
                if name.split(".")[0] == "pocketllm" and not name.startswith("pocketllm.proto")]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..scheduler.grammar import x\n")
    assert stage_of(next(n for n in imports(src, "pocketllm.tokenizer")
                         if n.endswith("grammar"))) == "scheduler"


def test_control_plane_never_imports_the_workers():
    """Everything under pocketllm/ runs without the data plane (and torch) loaded; the
    bench alone drives a worker in-process, as a user's script may."""
    problems = []
    for path in sorted((ROOT / "pocketllm").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "bench":
            continue
        package = ".".join(rel.with_suffix("").parts[:-1]) if path.name != "__init__.py" \
            else ".".join(rel.parent.parts)
        problems += [f"{rel} imports {name}" for name in imports(path, package)
                     if name == "pocketllm.workers" or name.startswith("pocketllm.workers.")]
    assert not problems, "\n".join(problems)
