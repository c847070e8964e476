"""Which peer addresses are this machine: where shared memory and clear text are safe.

Used by the server (clear text only on loopback unless explicitly allowed) and by the remote
tier (``data_path: auto`` takes shared memory only towards a loopback address).
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for a host that can only be this machine (where shared memory and clear text are safe)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other host name may resolve anywhere
