"""Peer addresses: parsing ``host:port``, and which addresses are this machine (where shared
memory and clear text are safe).

Used by the server (clear text only on loopback unless explicitly allowed) and by the remote
tier (``data_path: auto`` takes shared memory only towards a loopback address).
"""

from __future__ import annotations

import ipaddress


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port in 1..65535); ValueError
    otherwise (callers re-raise it in their own words: a setting's name, an example)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for a host that can only be this machine (where shared memory and clear text are safe)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other host name may resolve anywhere
