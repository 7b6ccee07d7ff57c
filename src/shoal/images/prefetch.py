"""Start records: which chunks of a layer its first sandbox read while it started, so that later creates —
a burst of thousands over many nodes — fetch that set in parallel before their sandboxes ask for it.

    <store>/prefetch/<layer hex>.json    {"layer", "chunks": [index, ...], "bytes", "recorded_at", "host"}

`chunks` are indexes into the layer's chunk table, in the order they were first read. A node records a
layer when it mounts it for the first time and no record exists (shoal.images.mounts); it writes the record
once the sandbox that caused the mount finished its first command, closed, or after RECORD_S — whichever
comes first; the first record written wins. A node that mounts a layer with a record asks shoal-chunkd to
fetch the recorded chunks with its fetch workers; the node-local cache then holds them for every later
sandbox of the node (once per node). A record is a hint: every chunk is still checked when read, and a
chunk the record lacks is fetched when a sandbox reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from shoal.fsutil import tmp_name

#: a record covers at most this many bytes of a layer (a first sandbox that reads everything must not make
#: every later node fetch everything)
MAX_RECORD_BYTES = 256 << 20
#: a record is written at the latest this long after the mount that started it
RECORD_S = 30.0


def record_path(store_root: Path, layer_hex: str) -> Path:
    """Where a layer's record lives."""
    return Path(store_root) / "prefetch" / f"{layer_hex}.json"


def load(store_root: Path, layer_hex: str) -> list[int] | None:
    """The recorded chunk indexes of a layer, or None."""
    try:
        d = json.loads(record_path(store_root, layer_hex).read_text())
        return [int(i) for i in d["chunks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(store_root: Path, layer_hex: str, chunks: list[int], nbytes: int) -> bool:
    """Write a record unless one exists (first writer wins); True when this call wrote it."""
    p = record_path(store_root, layer_hex)
    if p.exists() or not chunks:
        return False
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / tmp_name("rec-")
    tmp.write_text(json.dumps({"layer": f"sha256:{layer_hex}", "chunks": chunks, "bytes": nbytes,
                               "recorded_at": time.time(), "host": socket.gethostname()}))
    try:
        os.link(tmp, p)
        return True
    except FileExistsError:
        return False
    except OSError:
        if p.exists():
            return False
        os.rename(tmp, p)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def remove(store_root: Path, layer_hex: str) -> None:
    """Drop a layer's record (gc, layer removal)."""
    with contextlib.suppress(FileNotFoundError):
        record_path(store_root, layer_hex).unlink()
