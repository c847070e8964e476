"""A chunk file's lineage (its depth and parent key) kept with the file, so that a restarted
disk tier, and a tier adopting a file another process wrote, tell their eviction policy what
the tier that took the put was told (``policy.insert(key, size, depth, parent)``): prefix-aware
policies evict leaves before the prefixes they extend only if they know the links.

Where it lives: an extended attribute (:data:`NAME`) of the chunk file, set on the temp file
before the ``os.replace`` that publishes it. Weighed against:

- a sidecar file per chunk: a second create, write and rename per put and a second unlink per
  eviction (an unlink on a ``discard`` mount costs about what writing the file does), two
  names to keep in step through crashes, victim-file reuse and sharers (an older version
  evicting a chunk would leave its sidecar behind for ever);
- a journal: appends shared by several processes, compaction as chunks go, a tail to read at
  each adoption: the recovery code that one file per chunk exists to avoid;
- an extended attribute: one ``fsetxattr`` per put (3-6 us measured here, about 1% of a
  64 KiB put and less of a larger one), atomic with the file (published by the same rename,
  removed by the same unlink; a ``kill -9`` leaves a file with its record or no file), and
  the chunk bytes a read returns are unchanged, so older versions and other readers see the
  same files. Small on purpose: the name and a 48-byte value fit in an ext4 inode's own
  xattr space (256-byte inodes), so no block is allocated for it (a longer name or value
  spills into a 4 KiB block per file: measured here).

The record (little-endian, :data:`SIZE` bytes)::

    off size field
      0   1  version         1
      1   3  reserved        0
      4   4  depth           uint32
      8  32  parent key      32 zero bytes: none (a first chunk)
     40   8  seal            xxh3-64 of the chunk's own key followed by bytes 0..39

The seal binds the record to the key of the file it is on, so a record that is torn (a power
loss), altered, or another chunk's (an older version reusing a victim's file keeps the
victim's attribute) never passes. Anything that does not pass, and a missing record or a
file system without user xattrs (tmpfs before Linux 6.6, some network mounts), reads as "no
parent known" (0, b""): the chunk is indexed as a root, as before records existed; a record
that is present but bad is logged. A record that passes is right: a key is a chained hash of
its whole prefix, so a key has one parent and one depth, whichever put wrote it. The seal is
a checksum, not a signature: like the chunk files, a record is only as trusted as the private
(0700) directory; a forged parent can misorder evictions, never serve wrong bytes.

Failure: nothing here raises for the medium; a record that cannot be written leaves the put
to succeed without one (logged once per directory when the file system refuses xattrs).
"""

from __future__ import annotations

import errno
import logging
import os
import struct

import xxhash

from kvtier.keys import KEY_BYTES

__all__ = ["NAME", "NONE", "SIZE", "BadLineage", "attach", "decode", "encode", "fetch", "parse"]

log = logging.getLogger("kvtier.tiers.disk")

NAME = "user.kvtier"
VERSION = 1
_BODY = struct.Struct(f"<B3sI{KEY_BYTES}s")
_SEAL = struct.Struct("<Q")
SIZE = _BODY.size + _SEAL.size
assert SIZE == 48
NONE: tuple[int, bytes] = (0, b"")  # no parent known
_NO_PARENT = bytes(KEY_BYTES)
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)
_unsupported_roots: set[str] = set()  # directories already logged as keeping no records


class BadLineage(ValueError):
    """A lineage record that is present but not one this chunk's put wrote."""


def _seal(key: bytes, body: bytes) -> bytes:
    return _SEAL.pack(xxhash.xxh3_64_intdigest(key + body))


def encode(key: bytes, depth: int, parent: bytes) -> bytes:
    """The record of ``key``'s chunk, or b"" when there is nothing to keep (a first chunk with
    no parent) or nothing that can be kept (a parent that is not a key, a depth past uint32)."""
    if (not depth and not parent) or len(parent) not in (0, KEY_BYTES) or parent == key:
        return b""
    if not 0 <= depth < 1 << 32:
        return b""
    body = _BODY.pack(VERSION, b"\0\0\0", depth, parent or _NO_PARENT)
    return body + _seal(key, body)


def decode(raw: bytes, key: bytes) -> tuple[int, bytes]:
    """``(depth, parent)`` of a record read from ``key``'s file; raises :class:`BadLineage`
    (its message says why) for anything :func:`encode` did not write for ``key``."""
    if len(raw) != SIZE:
        raise BadLineage(f"{len(raw)} bytes, a record has {SIZE}")
    version, reserved, depth, parent = _BODY.unpack_from(raw)
    if version != VERSION:
        raise BadLineage(f"version {version}, this version reads {VERSION}")
    if raw[_BODY.size:] != _seal(key, raw[: _BODY.size]):
        raise BadLineage("seal does not match this chunk's key (torn, altered, or another chunk's record)")
    if reserved != b"\0\0\0":
        raise BadLineage("reserved bytes are not zero")
    if parent == key:
        raise BadLineage("names the chunk as its own parent")
    return depth, b"" if parent == _NO_PARENT else parent


def fetch(file: int | str) -> bytes | None:
    """The raw record of ``file``, an open descriptor or a path (never through a
    symlink: the tier's files are regular files); None when it has none (or the file system
    keeps no xattrs, the file is gone, or reading it failed)."""
    try:
        if isinstance(file, str):
            return os.getxattr(file, NAME, follow_symlinks=False)
        return os.getxattr(file, NAME)
    except OSError:  # ENODATA (none), ENOENT, ENOTSUP, EIO...: no parent known
        return None


def parse(raw: bytes | None, key: bytes, path: str) -> tuple[int, bytes]:
    """:func:`decode` of a record read from ``path``, or :data:`NONE` (a bad one logged)."""
    if raw is None:
        return NONE
    try:
        return decode(raw, key)
    except BadLineage as exc:
        log.warning("disk tier: ignoring the lineage record of %s (indexed with no parent): %s", path, exc)
        return NONE


def attach(fd: int, record: bytes, reused: bool, root: str) -> None:
    """Give the temp file ``fd`` its ``record``; with no record, a ``reused`` victim's file
    loses the victim's (its seal would not pass anyway: this spares the log line). Never raises."""
    try:
        if record:
            os.setxattr(fd, NAME, record)
        elif reused:
            os.removexattr(fd, NAME)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            if root not in _unsupported_roots:
                _unsupported_roots.add(root)
                log.info("disk tier %s: the file system keeps no user xattrs: chunk parents are not "
                         "kept across restarts or shared with other processes", root)
        elif exc.errno != errno.ENODATA:
            log.debug("disk tier: no lineage record for %s: %s", root, exc)
