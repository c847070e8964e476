"""A revision for a checkpoint directory that names no revision of its own.

Why: a namespace is model id + revision (kvtier.keys), and a model loaded from a local
directory has neither a hub commit hash (transformers) nor a revision (vLLM). Keyed by its path
alone, a checkpoint saved again into the same directory (a training loop's ``./out``) would be
served the K/V its predecessor wrote under the same keys: wrong bytes, silently. So connectors
ask :func:`checkpoint_revision` for such a directory: a fingerprint of its config and weights,
computed from the files (not from an engine's in-memory tensors, whose layout differs between
engines), so transformers and vLLM loading the same directory land in the same namespace.

What it reads: ``config.json`` whole; for each ``*.safetensors`` file its header (tensor names,
dtypes, shapes, offsets) and, per tensor, three 256-byte windows of its data (start, middle,
end); for other weight files (``*.bin``, ``*.pt``, ``*.gguf``) the size and 64 windows spread
over the file. A few MiB of reads for a large model; retraining changes every window it covers
with near certainty. What it cannot see: a change confined to bytes between the windows of a
tensor, and weights changed in memory after loading. Where that matters, name the revision.

:func:`model_revision` is the whole rule an engine connector applies to a model name: a hub
model (``org/name``) is named by the commit of the snapshot the hub cache holds for it (a model
updated upstream is another namespace, and the commit is what transformers records as
``_commit_hash``, so engines agree); a directory by :func:`checkpoint_revision`, or by its
commit when it is a hub cache snapshot directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct

import xxhash

log = logging.getLogger(__name__)

WINDOW = 256
TENSOR_WINDOWS = 3  # start, middle, end of each safetensors tensor
FILE_WINDOWS = 64
_HEADER_LIMIT = 100 << 20  # safetensors caps its own header at 100 MB
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SNAPSHOT = re.compile(r"[/\\]snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")  # as transformers reads it


def model_revision(model: str, revision: str | None = None) -> str:
    """The revision that names the weights an engine loaded as ``model`` (a directory or a hub
    id) at ``revision`` (the engine's, may be a branch): a hub snapshot's commit, else a
    directory's :func:`checkpoint_revision`, else ``revision``, else ``""`` (nothing known:
    the caller should ask the user to name one). Raises OSError as checkpoint_revision does."""
    if os.path.isdir(model):
        snapshot = _SNAPSHOT.search(os.path.abspath(model))
        if snapshot is not None:
            return snapshot.group(1)
        return checkpoint_revision(model) or revision or ""
    return hub_commit(model, revision) or revision or ""


def hub_commit(repo_id: str, revision: str | None = None) -> str | None:
    """The commit of the snapshot of ``repo_id`` at ``revision`` (default: main) in the local
    Hugging Face cache, without touching the network; None when it is not cached there, not a
    hub id, or huggingface_hub is not installed."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    except ValueError:  # HFValidationError: not a repo id (a URL, a missing local path)
        return None
    found = _SNAPSHOT.search(path) if isinstance(path, str) else None
    return found.group(1) if found is not None else None


def checkpoint_revision(path: str) -> str | None:
    """``"files-<xxh3-128 hex>"`` for a directory holding weight files, else None (not a
    directory, or no weights in it: the caller keeps whatever revision it had). Raises
    OSError when a weight file cannot be read (a revision from half the files would be a lie).
    """
    if not os.path.isdir(path):
        return None
    names = sorted(n for n in os.listdir(path) if n.endswith(_WEIGHTS))
    if not names:
        return None
    h = xxhash.xxh3_128()
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(b"config.json\0" + f.read())
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            if name.endswith(".safetensors"):
                _safetensors(f.fileno(), h, name)
            else:
                _spread(f.fileno(), h)
    return "files-" + h.hexdigest()


def _safetensors(fd: int, h: xxhash.xxh3_128, name: str) -> None:
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise OSError(f"{name}: not a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(_HEADER_LIMIT, size - 8):
        raise OSError(f"{name}: safetensors header of {n} bytes in a {size}-byte file")
    header = os.pread(fd, n, 8)
    h.update(struct.pack("<Q", size) + header)
    try:
        tensors = json.loads(header)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser
        raise OSError(f"{name}: safetensors header is not JSON: {exc}") from exc
    base = 8 + n
    try:
        spans = sorted((k, v["data_offsets"]) for k, v in tensors.items() if k != "__metadata__")
    except (AttributeError, KeyError, TypeError) as exc:
        raise OSError(f"{name}: safetensors header without data_offsets: {exc!r}") from exc
    for tname, offsets in spans:
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= size - base):
            raise OSError(f"{name}: tensor {tname!r} has data_offsets {offsets!r}, not a span of the file")
        begin, end = offsets
        for at in window_starts(end - begin, TENSOR_WINDOWS):
            h.update(os.pread(fd, min(WINDOW, end - begin - at), base + begin + at))


def _spread(fd: int, h: xxhash.xxh3_128) -> None:
    size = os.fstat(fd).st_size
    h.update(struct.pack("<Q", size))
    for at in window_starts(size, FILE_WINDOWS):
        h.update(os.pread(fd, WINDOW, at))


def window_starts(n: int, count: int, window: int = WINDOW) -> list[int]:
    """Offsets of ``count`` windows of ``window`` bytes spread evenly over ``n`` bytes, first and
    last included (fewer where they would overlap; ``[0]`` when ``n`` fits in one window)."""
    if n <= window:
        return [0] if n else []
    step = (n - window) / max(1, count - 1)
    return sorted({round(i * step) for i in range(count)})
