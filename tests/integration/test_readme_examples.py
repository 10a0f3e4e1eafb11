"""README's examples run as printed (issue 30 item 5): the Python consumer example ends once
every stream reached its end (``to_latest``), having read every live key.

The example is taken from README.md itself (the first ``python`` block) with only its port
changed to a test node's, and run in a child process with a deadline.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.nodes import NodeFactory

from .test_cli_errors import changefeed

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_TIMEOUT_S = 60.0


def readme_python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    return str(blocks[0])


@pytest.mark.timeout(180)
def test_the_readme_consumer_example_ends(nodes: NodeFactory) -> None:
    code = readme_python_example()
    assert "port=11210" in code and "range(64)" in code, code
    node = nodes(vbuckets=64, args=["--no-durable"])  # as `changefeed serve` by default
    loaded = changefeed("load", "--port", str(node.port), "--count", "3000")
    assert loaded.returncode == 0, loaded.stderr
    done = subprocess.run(
        [sys.executable, "-c", code.replace("port=11210", f"port={node.port}")],
        capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("done; session state:"), done.stdout[-2000:]
    changes = sum(int(line.split()[0]) for line in lines if line.endswith(" changes"))
    assert changes > 0, done.stdout[-2000:]
