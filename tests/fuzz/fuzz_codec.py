"""Coverage-guided fuzzing of the codec with atheris (libFuzzer). Optional: atheris is not a
project dependency (``pip install atheris``), and pytest does not collect this file.

The one invariant, as in ``tests/unit/protocol/test_fuzz.py``: for any bytes in any chunking,
``FrameReader`` and every message decoder applied to the frames that come out return a value
(or ``NEED_DATA`` / ``CLOSED``) or raise ``ProtocolError``; anything else is a crash. The reader
must never buffer more than ``HEADER_SIZE + frame_size_max + chunk`` bytes.

Usage::

    .venv/bin/python tests/fuzz/fuzz_codec.py --make-corpus /tmp/cf-corpus   # seed valid frames
    .venv/bin/python tests/fuzz/fuzz_codec.py /tmp/cf-corpus -atheris_runs=1000000
"""

from __future__ import annotations

import pathlib
import random
import sys

import atheris

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))

with atheris.instrument_imports():
    from protocol.helpers import apply_every_decoder  # tests/unit/protocol/helpers.py

    from changefeed import limits
    from changefeed.protocol.errors import ProtocolError
    from changefeed.protocol.frame import Frame
    from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader


def fuzz_one(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    chunk_max = provider.ConsumeIntInRange(1, 4096)
    frame_size_max = provider.PickValueInList([limits.FRAME_SIZE_MAX, 64, 1024])
    stream = provider.ConsumeBytes(provider.remaining_bytes())
    reader = FrameReader(frame_size_max)
    try:
        for pos in range(0, len(stream) + 1, chunk_max):
            chunk = stream[pos : pos + chunk_max]  # the last one is b"" = EOF
            reader.feed(chunk)
            assert reader.buffered_bytes <= limits.HEADER_SIZE + frame_size_max + chunk_max
            while True:  # bounded: each frame consumes >= 24 buffered bytes
                frame = reader.next_frame()
                if frame is NEED_DATA or frame is CLOSED:
                    break
                assert isinstance(frame, Frame)
                apply_every_decoder(frame)
            if not chunk:
                break
    except ProtocolError:
        pass
    batch_reader = FrameReader(frame_size_max)
    try:
        batch_reader.feed(stream)
        batch_reader.feed(b"")
        while batch_reader.read_batch().consumed:  # bounded by len(stream)
            pass
    except ProtocolError:
        pass


def make_corpus(directory: pathlib.Path) -> None:
    from protocol.test_fuzz import valid_stream

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for index in range(500):
        data, _ = valid_stream(rng)
        # The first bytes choose chunk size and frame limit; the rest is the stream.
        (directory / f"seed-{index:04d}").write_bytes(b"\x00\x10\x00" + bytes(data))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(pathlib.Path(sys.argv[2]))
        return
    atheris.Setup(sys.argv, fuzz_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
