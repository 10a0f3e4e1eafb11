"""``changefeed stream``'s state file and the output it marks, without a node.

The state saves the output's synced length beside the sessions (``OutputMark``); a rerun cuts
lines past it (a killed run's unsaved batch, streamed again), refuses an output shorter than
it, and leaves another file (rotated output) to the old rule: only an unfinished last line
goes. These run before any connection, so a closed port is enough to exercise them.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from changefeed.cli.client_commands import (
    OutputMark,
    _check_output,
    _parse_state,
    _state_text,
    stream,
)
from changefeed.consumer import SessionState
from changefeed.consumer.session import VbSession

LINE = '{"vb": 0, "seqno": 1}\n'


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def session() -> SessionState:
    return SessionState({0: VbSession(0, seqno=1, snap_start=1, snap_end=1)})


def mark_of(path: Path) -> OutputMark:
    fd = os.open(path, os.O_RDONLY)
    try:
        return OutputMark.of(path, fd)
    finally:
        os.close(fd)


def run_stream(state: Path, output: Path) -> tuple[int, str]:
    result = CliRunner().invoke(
        stream,
        ["--port", str(closed_port()), "--state", str(state), "--output", str(output)],
    )
    return result.exit_code, result.output


def test_state_round_trips_sessions_and_mark(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text(LINE)
    mark = mark_of(output)
    assert mark.size == len(LINE)
    parsed, parsed_mark = _parse_state(_state_text(session(), mark))
    assert parsed.to_json() == session().to_json()
    assert parsed_mark == mark


def test_first_format_state_still_reads(tmp_path: Path) -> None:
    parsed, mark = _parse_state(session().to_json())
    assert parsed.get(0).seqno == 1
    assert mark is None


def test_rerun_cuts_the_output_back_to_the_saved_length(tmp_path: Path) -> None:
    """What a kill after a commit leaves: lines past the mark. They are cut (and streamed
    again by the rerun), before the rerun connects."""
    output, state = tmp_path / "out.jsonl", tmp_path / "state.json"
    output.write_text(LINE)
    state.write_text(_state_text(session(), mark_of(output)))
    with open(output, "a") as handle:
        handle.write(LINE * 3 + '{"vb": 0, "se')  # the killed run's unsaved batch
    code, printed = run_stream(state, output)
    assert code == 1, printed  # then it could not reach the node
    assert output.read_text() == LINE
    assert "written after its last saved state" in printed


def test_output_shorter_than_the_mark_is_refused(tmp_path: Path) -> None:
    output, state = tmp_path / "out.jsonl", tmp_path / "state.json"
    output.write_text(LINE * 2)
    state.write_text(_state_text(session(), mark_of(output)))
    with open(output, "r+") as handle:
        handle.truncate(len(LINE))
    code, printed = run_stream(state, output)
    assert code == 2, printed
    assert "lines the state covers are gone" in printed
    assert output.read_text() == LINE  # untouched


def test_another_file_at_the_path_only_loses_an_unfinished_line(tmp_path: Path) -> None:
    """A rotated output (a new file where the old one was) is appended to as before."""
    output = tmp_path / "out.jsonl"
    output.write_text(LINE * 5)
    mark = mark_of(output)
    output.rename(tmp_path / "out.jsonl.1")
    output.write_text(LINE + '{"vb"')
    assert not mark.names(output)
    _check_output(output, session(), mark)
    assert output.read_text() == LINE


def test_malformed_mark_is_a_state_error(tmp_path: Path) -> None:
    text = json.dumps({"format": 2, "output": {"path": "x"}, "vbuckets": {}})
    with pytest.raises(ValueError, match="output entry is invalid"):
        _parse_state(text)
    with pytest.raises(ValueError, match="format 3"):
        _parse_state(json.dumps({"format": 3, "vbuckets": {}}))
