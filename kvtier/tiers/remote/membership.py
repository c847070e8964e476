"""Which nodes form the cluster: a static list, or DNS names resolved again and again.

A *resolver* is a plain function ``() -> list[str]`` returning node names (``host:port``,
IPv6 hosts in brackets); the tier calls it at start and every ``resolve_interval_s`` from its
background thread, and a name that appears or vanishes is added or drained. Tests inject
their own function; deployments name one in ``grpc.discovery``:

- ``dns:HOST:PORT``: every A/AAAA address of HOST (a Kubernetes headless Service name), each
  with PORT (``socket.getaddrinfo``: the system resolver, no extra dependency).
- ``srv:NAME``: the SRV records of NAME (e.g. ``_grpc._tcp.kvtier.ns.svc.cluster.local``),
  each as ``target:port``. Needs ``dnspython``; without it the tier refuses the setting at
  start with a message saying so.

Failure: a resolver raises :class:`ResolveError` when the name cannot be resolved; the tier
then keeps the node set it has (a DNS hiccup must not drain a healthy fleet).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from importlib import import_module

from kvtier.protocol.addresses import parse_hostport

Resolver = Callable[[], Sequence[str]]


class ResolveError(Exception):
    """The discovery name could not be resolved this time."""


def node_name(host: str, port: int) -> str:
    host = host.rstrip(".")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def static_resolver(nodes: Sequence[str]) -> Resolver:
    fixed = list(nodes)
    return lambda: fixed


def dns_resolver(host: str, port: int) -> Resolver:
    """A/AAAA records of ``host``, each as ``ip:port``, sorted (stable for diffing)."""

    def resolve() -> list[str]:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ResolveError(f"dns:{host}:{port}: {exc}") from exc
        return sorted({node_name(str(info[4][0]), port) for info in infos})

    return resolve


def srv_resolver(name: str) -> Resolver:
    """SRV records of ``name`` through dnspython (imported lazily: an optional dependency)."""
    try:
        resolver = import_module("dns.resolver")
        exception = import_module("dns.exception")
    except ImportError:
        raise ValueError(f"srv:{name}: SRV discovery needs the dnspython package "
                         "(pip install dnspython), or use dns:HOST:PORT") from None

    def resolve() -> list[str]:
        try:
            answer = resolver.resolve(name, "SRV")
        except exception.DNSException as exc:
            raise ResolveError(f"srv:{name}: {exc}") from exc
        return sorted({node_name(str(r.target), int(r.port)) for r in answer})

    return resolve


def resolver_for(discovery: str) -> Resolver:
    """The resolver a ``grpc.discovery`` value names; ValueError naming what is wrong."""
    kind, _, rest = discovery.partition(":")
    if kind == "dns":
        try:
            host, port = parse_hostport(rest)
        except ValueError:
            raise ValueError(f"grpc.discovery: {discovery!r}: expected dns:HOST:PORT") from None
        return dns_resolver(host, port)
    if kind == "srv" and rest:
        return srv_resolver(rest)
    raise ValueError(f"grpc.discovery: {discovery!r}: expected dns:HOST:PORT or srv:NAME")
