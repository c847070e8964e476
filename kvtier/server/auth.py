"""Bearer tokens -> tenants.

Tokens file format (one token per line; ``#`` at the start of a line or after a space starts
a comment, so a token may itself contain ``#``; blank lines ignored)::

    <token> <tenant> [<quota>] [admin]

- ``token``: at least 16 printable non-space ASCII characters (e.g. ``openssl rand -hex 24``).
- ``tenant``: 1-64 characters of ``A-Z a-z 0-9 . _ -``, not starting with ``.``. Several tokens may name one tenant
  (rotation); they must then agree on quota and admin.
- ``quota``: the tenant's byte quota, a cap on its RAM and on its disk within the shared budgets
  (``1073741824``, ``512MiB``, ``4GiB``), at least ``MIN_QUOTA_BYTES`` (1 MiB, the smallest tier
  the server keeps: a smaller quota could not be enforced and is refused); when absent the
  server's ``default_quota_bytes`` applies.
- ``admin``: the tenant may read other tenants' Stats (``tenant: "*"`` or a name).

Tokens are compared by SHA-256 digest so that a lookup's timing says nothing about how many
leading characters of a guess were right. The file should be readable by the server's user
only; a group- or world-readable file is logged as a warning.
"""

from __future__ import annotations

import hashlib
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import parse_size
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_TENANT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")  # never "." or ".." (a directory name)
_COMMENT = re.compile(r"(?:^|\s)#")  # "#" inside a token is part of it
_TOKEN = re.compile(r"^[\x21-\x7e]{16,4096}$")
MIN_TOKEN_CHARS = 16
MIN_QUOTA_BYTES = 1 << 20  # a tenant tier's smallest capacity (CpuTierConfig/DiskTierConfig)


@dataclass(frozen=True)
class Tenant:
    name: str
    quota_bytes: int = 0  # 0: the server's default quota
    admin: bool = False


class AuthError(Exception):
    """A request's credentials are missing or wrong; ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Authenticator:
    """Maps ``authorization`` metadata values to tenants. Immutable after construction,
    so any thread (event loop, data-path threads) may call :meth:`authenticate`."""

    def __init__(self, tenants_by_token: dict[str, Tenant] | None) -> None:
        # None: auth disabled, everyone is the one admin tenant "default".
        self.enabled = tenants_by_token is not None
        self._by_digest = {_digest(t): ten for t, ten in (tenants_by_token or {}).items()}
        names: dict[str, Tenant] = {}
        for ten in self._by_digest.values():
            names[ten.name] = ten
        self.tenants: dict[str, Tenant] = names if self.enabled else {
            DEFAULT_TENANT: Tenant(DEFAULT_TENANT, 0, admin=True)}

    @classmethod
    def from_file(cls, path: str | None) -> Authenticator:
        if not path:
            return cls(None)
        return cls(parse_tokens_file(Path(path).expanduser()))

    def authenticate(self, authorization: str | None) -> Tenant:
        """``authorization`` is the metadata value (``Bearer <token>``) or a bare token."""
        if not self.enabled:
            return self.tenants[DEFAULT_TENANT]
        if not authorization:
            raise AuthError("UNAUTHENTICATED", "missing bearer token (metadata 'authorization: Bearer <token>')")
        token = authorization
        if authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        tenant = self._by_digest.get(_digest(token))
        if tenant is None:
            raise AuthError("UNAUTHENTICATED", "unknown bearer token")
        return tenant

    def authorize_stats(self, caller: Tenant, wanted: str) -> list[Tenant]:
        """Tenants whose Stats ``caller`` may read for request value ``wanted``."""
        if wanted in ("", caller.name):
            return [caller]
        if not caller.admin:
            raise AuthError("PERMISSION_DENIED",
                            f"tenant {caller.name!r} may not read stats of {wanted!r} (admin only)")
        if wanted == "*":
            return list(self.tenants.values())
        if wanted not in self.tenants:
            raise AuthError("NOT_FOUND", f"no tenant named {wanted!r}")
        return [self.tenants[wanted]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens_file(path: Path) -> dict[str, Tenant]:
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"tokens_file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("tokens file %s is readable by group/others; chmod 600 it", path)
    tokens = parse_tokens(text, str(path))
    if not tokens:
        raise ConfigError(f"tokens_file {path}: no tokens (auth would refuse every request)")
    return tokens


def parse_tokens(text: str, where: str = "tokens") -> dict[str, Tenant]:
    tokens: dict[str, Tenant] = {}
    by_name: dict[str, Tenant] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.split(raw, 1)[0].strip()
        if not line:
            continue
        at = f"{where}:{lineno}"
        fields = line.split()
        if len(fields) < 2:
            raise ConfigError(f"{at}: expected '<token> <tenant> [<quota>] [admin]'")
        token, name, rest = fields[0], fields[1], fields[2:]
        if not _TOKEN.match(token):
            raise ConfigError(f"{at}: a token is {MIN_TOKEN_CHARS}+ printable non-space ASCII characters")
        if not _TENANT.match(name):
            raise ConfigError(f"{at}: tenant {name!r} must be 1-64 of A-Z a-z 0-9 . _ - (not starting with '.')")
        admin = "admin" in rest
        sizes = [r for r in rest if r != "admin"]
        if len(sizes) > 1:
            raise ConfigError(f"{at}: unexpected fields {sizes[1:]}")
        quota = parse_size(sizes[0], f"{at} quota") if sizes else 0
        if 0 < quota < MIN_QUOTA_BYTES:  # 0 (as absent): the default quota
            raise ConfigError(f"{at}: quota {sizes[0]} is under 1MiB, the smallest tier a tenant gets "
                              "(it could not be enforced); give 1MiB or more, or no quota")
        tenant = Tenant(name, quota, admin)
        if token in tokens:
            raise ConfigError(f"{at}: token repeated")
        if by_name.setdefault(name, tenant) != tenant:
            raise ConfigError(f"{at}: tenant {name!r} is listed with another quota/admin flag")
        tokens[token] = tenant
    return tokens
