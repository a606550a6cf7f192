"""The frames of the agent worker protocol (:mod:`agentrl.rollout.agent.worker`, :mod:`agentrl.rollout.agent.pool`):
a 4-byte big-endian length, then a pickle. Its own module so that the pool (imported by
:mod:`agentrl.rollout.agent.user`) and the worker (which imports :mod:`agentrl.rollout.agent.user`) share it without an
import cycle."""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

__all__ = ["MAX_FRAME", "encode_frame", "read_frame"]

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


def encode_frame(message: Any) -> bytes:
    """One message as a frame: a 4-byte big-endian length, then the pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise ValueError(f"a frame of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None at end of stream (also when it ends inside a frame)."""
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes is over the {MAX_FRAME}-byte limit: the stream is corrupt")
        return pickle.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None
