"""Every module imports only from layers below its own (ARCHITECTURE.md, "Layout").

    limits ← protocol ← failover, vbucket_state, vbmap ← storage ← checkpoint ← vbucket
           ← producer, consumer ← server ← cluster ← cli;   spark and ipc sit on consumer and
    protocol and never reach into server, producer or the store side (spark may use ipc).

Imports are read from the source (including TYPE_CHECKING and function-local ones), so an
upward import fails here even when it would only run on some path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "changefeed"

# Layer of each top-level part of the package; a part may import parts of a lower layer and
# its own. Parts listed in SIDE_PACKAGES have an explicit allow-list instead.
LAYER = {
    "limits": 0,
    "protocol": 1,
    "failover": 2,
    "vbucket_state": 2,
    "vbmap": 2,
    "storage": 3,
    "checkpoint": 4,
    "vbucket": 5,
    "producer": 6,
    "consumer": 6,
    "server": 7,
    "cluster": 8,
    "cli": 9,
    "__main__": 10,
    "__init__": 0,  # the package itself: a docstring and __version__, importing nothing
}
SIDE_PACKAGES = {
    "spark": {"limits", "protocol", "failover", "vbmap", "consumer", "ipc", "spark"},
    "ipc": {"limits", "protocol", "failover", "vbmap", "consumer", "ipc"},
}
# The layers that may use the side packages.
SIDE_USERS = {
    "spark": {"cli", "__main__"},
    "ipc": {"server", "cluster", "spark", "cli", "__main__"},  # ipc sits below spark
}


def part_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "changefeed", module
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("changefeed"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "changefeed":  # a submodule, or a name of the package itself
                for alias in node.names:
                    submodule = SRC / alias.name
                    is_module = submodule.is_dir() or submodule.with_suffix(".py").exists()
                    found.add(f"changefeed.{alias.name}" if is_module else "changefeed")
            elif node.module.startswith("changefeed."):
                found.add(node.module)
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(SRC.parent).with_suffix("")
    return ".".join(relative.parts)


def allowed(source: str, target: str) -> bool:
    if source == target:
        return True
    if source in SIDE_PACKAGES:
        return target in SIDE_PACKAGES[source]
    if target in SIDE_PACKAGES:
        return source in SIDE_USERS[target]
    return LAYER[target] < LAYER[source]


MODULES = sorted(SRC.rglob("*.py"))


def test_every_part_has_a_layer() -> None:
    parts = {part_of(module_name(path)) for path in MODULES}
    unknown = parts - set(LAYER) - set(SIDE_PACKAGES)
    assert not unknown, f"give {sorted(unknown)} a layer in this test and ARCHITECTURE.md"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_upward_import(path: Path) -> None:
    source = part_of(module_name(path))
    upward = sorted(target for target in imports_of(path) if not allowed(source, part_of(target)))
    assert not upward, f"{module_name(path)} ({source}) imports upward: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The test can fail: a storage module importing the server is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from changefeed.server.bucket import Bucket\nimport changefeed.cli\n")
    targets = {part_of(target) for target in imports_of(bad)}
    assert targets == {"server", "cli"}
    assert not allowed("storage", "server")
    assert not allowed("spark", "server")
    assert not allowed("protocol", "failover")
    assert allowed("server", "protocol")
