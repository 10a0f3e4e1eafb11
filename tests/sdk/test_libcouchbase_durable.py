"""Durable writes from a libcouchbase-based SDK (issue 26): Node.js ``couchbase`` 3.x refuses
them with LCB_ERR_UNSUPPORTED_OPERATION unless the bucket config lists ``durableWrite`` in
``bucketCapabilities``.

Opt-in: the package builds libcouchbase from source on install (3 min download and build here,
``npm install couchbase@3`` then ``npm rebuild couchbase`` when npm skips install scripts), so
this runs only when ``CHANGEFEED_NODE_COUCHBASE`` names a directory whose ``node_modules`` has it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from changefeed.cli.node_process import HOST, NodeProcess
from support.clients import PASSWORD, USER

MODULES = os.environ.get("CHANGEFEED_NODE_COUCHBASE")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not MODULES or shutil.which("node") is None,
        reason="set CHANGEFEED_NODE_COUCHBASE to a directory with node_modules/couchbase (3.x)",
    ),
]

# Writes after one plain upsert: libcouchbase refuses a durable write issued before the
# bucket's config arrived (right after connect), whatever the server says.
SCRIPT = """
const couchbase = require('couchbase');
(async () => {
  const [host, port, user, password] = process.argv.slice(2);
  const options = {username: user, password};
  const cluster = await couchbase.connect(`couchbase://${host}:${port}`, options);
  const coll = cluster.bucket('default').defaultCollection();
  await coll.upsert('warm-up', {});
  const out = {ok: 0, errors: {}};
  for (const level of ['Majority', 'MajorityAndPersistOnMaster', 'PersistToMajority']) {
    for (let i = 0; i < 20; i++) {
      try {
        const key = `lcb-${level}-${i}`;
        await coll.upsert(key, {i}, {durabilityLevel: couchbase.DurabilityLevel[level]});
        if ((await coll.get(key)).content.i === i) out.ok++;
      } catch (e) { out.errors[e.message] = (out.errors[e.message] || 0) + 1; }
    }
  }
  console.log(JSON.stringify(out));
  await cluster.close();
})();
"""


def test_durable_writes_from_libcouchbase(node: NodeProcess, tmp_path: Path) -> None:
    assert MODULES is not None
    script = tmp_path / "durable.js"
    script.write_text(SCRIPT)
    result = subprocess.run(
        ["node", str(script), HOST, str(node.port), USER, PASSWORD],
        capture_output=True, text=True, timeout=90, check=False,
        env={**os.environ, "NODE_PATH": str(Path(MODULES) / "node_modules")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"ok": 60, "errors": {}}, outcome
