"""docs/architecture.md's module map names every module of the package (issue 33: it had missed a dozen,
and a map that goes stale misleads the next reader)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _map() -> str:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    return doc[doc.index("## What exists") : doc.index("Dependencies point down")]


def _named(block: str, module: Path) -> bool:
    """Named by its file name, or (a folder's list) by its stem followed by '(' ',' or a space."""
    stem = module.stem
    return module.name in block or any(f"{stem}{end}" in block for end in (" (", ",", " "))


def test_the_module_map_names_every_module():
    block = _map()
    modules = [p for p in sorted((ROOT / "lightning_3d").rglob("*.py")) if p.name != "__init__.py"]
    assert len(modules) > 80
    missing = [str(p.relative_to(ROOT)) for p in modules if not _named(block, p)]
    assert not missing, f"docs/architecture.md 'What exists' does not name: {missing}"
