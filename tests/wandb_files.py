"""Read what W&B wrote offline: the records of an offline run's ``run-ID.wandb`` file.

wandb 0.31 writes an offline run's config, history and summary into that one file (its own
transaction log: a 7-byte header, then LevelDB-log framing of protobuf ``Record`` messages) and
no longer ships a Python reader of it; the messages are parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path):
    """Every ``wandb_internal_pb2.Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < 7:  # not written yet
        return
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # the writer is mid-record
            return
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def finished_records(run_file: str | Path, timeout_s: float = 60.0) -> list:
    """The file's records once its ``exit`` record is in: W&B's writer (the wandb-core process)
    can still be flushing the file for a moment after ``run.finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = list(records(run_file)) if Path(run_file).stat().st_size > 7 else []
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def read_offline_run(run_file: str | Path) -> dict[str, Any]:
    """``{"id", "project", "name", "tags", "config", "history": [row...], "summary", "exited"}`` of
    one finished run file."""
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "exited": False}
    for r in finished_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name, tags=list(r.run.tags))
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "exit":
            out["exited"] = True
    return out


def offline_runs(run_dir: str | Path) -> list[Path]:
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
