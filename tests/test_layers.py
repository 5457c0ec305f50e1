"""Layers point down only: a lower package never imports a higher one.

    schemas  ←  streams  ←  consumers  ←  sessions  ←  services  ←  tooling
         ↖   agents  ↗                                    ↑
                                                         demo (an app, like a user's)

(one exception, named below: the command line loads the tooling's commands)

Read from the source (every ``import`` and ``from … import``, at any depth, including the
ones inside functions), so a late import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, set[str]] = {
    "schemas": {"schemas"},
    "streams": {"schemas", "streams"},
    "agents": {"schemas", "agents"},
    "consumers": {"schemas", "streams", "agents", "consumers"},
    "sessions": {"schemas", "streams", "agents", "consumers", "sessions"},
    "services": {"schemas", "streams", "agents", "consumers", "sessions", "services"},
    "demo": {"schemas", "agents", "services", "demo"},
    "tooling": {
        "schemas",
        "streams",
        "agents",
        "consumers",
        "sessions",
        "services",
        "demo",
        "tooling",
    },
}
# The `jetloop` command is the front door of the tooling too (`jetloop bench`, `jetloop
# trials`): its commands load it lazily. Nothing else in the product may.
EXCEPTIONS: dict[str, set[str]] = {"jetloop/services/cli": {"tooling"}}
OURS = set(ALLOWED) | {"jetloop", "tests"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {package_of(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(package_of(node.module))
    return found & OURS


def package_of(module: str) -> str:
    """``jetloop.consumers.x`` → ``consumers``; ``jetloop`` (the face module) → ``jetloop``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "jetloop" and len(parts) > 1 else parts[0]


def test_no_package_imports_a_higher_one() -> None:
    """Each package imports only itself and the packages below it."""
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / "jetloop" / package).rglob("*.py")):
            extra = {n for d, ns in EXCEPTIONS.items() if path.is_relative_to(ROOT / d) for n in ns}
            for name in sorted(imports_of(path) - allowed - extra):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_every_package_is_layered() -> None:
    """A new top-level package must take its place in ALLOWED (and so in the picture)."""
    packages = {p.parent.name for p in (ROOT / "jetloop").glob("*/__init__.py")}
    assert packages == set(ALLOWED)
