"""Read TensorBoard event files without TensorBoard: TFRecord framing (length, CRC, data, CRC) around
`Event` protocol buffers, whose definitions tensorboardX ships."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path


def events(path: Path) -> Iterator:
    """Every Event record of one events.out.tfevents.* file."""
    from tensorboardX.proto import event_pb2

    data, pos = path.read_bytes(), 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        yield event


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("events.out.tfevents.*"))


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file of a folder."""
    out: dict[str, dict[int, float]] = {}
    for path in files(folder):
        for event in events(path):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def steps_per_file(folder: Path, tag: str) -> list[list[int]]:
    """The steps each event file (one per training attempt) logged `tag` at."""
    return [[e.step for e in events(p) for v in e.summary.value if v.tag == tag] for p in files(folder)]
