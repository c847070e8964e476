from typing_extensions import Buffer

HEADER_SIZE: int
KEY_BYTES: int
MORE: int
PARENT: int
SHM: int
REF_SIZE: int
MAX_SLOTS: int

def bind_hash(path: str, /) -> bool: ...
def recv_puts(fd: int, head: bytearray, have: int, keys: bytearray, slots: list[memoryview],
              put_type: int, hash_from: int, piece: int, seg: Buffer, /) -> tuple[list[tuple[int, int, int, int]], int]: ...
def copy_hash(dst: Buffer, src: Buffer, hash_from: int, piece: int, /) -> int: ...
