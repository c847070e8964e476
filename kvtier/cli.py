"""The ``kvtier`` command line.

Subcommands come from two places: the core's own (``_COMMANDS`` below) and the
``kvtier.commands`` entry points of installed packages, which is how a connector adds one
without the core importing it (``kvtier demo`` is the transformers connector's:
``kvtier_hf.demo_cli``). Either is an ``add_parser(subparsers)`` that registers its flags and
``handler`` (parsed namespace -> exit status); it may also set ``progress_logger``, a logger
shown at INFO unless ``-q``. Imports of heavy modules (torch, transformers, the connector)
happen inside handlers, so ``kvtier --help`` stays instant.
Progress and diagnostics go to stderr through ``logging``; results go to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from kvtier import __version__
from kvtier.analyze import command as analyze_command

log = logging.getLogger("kvtier.cli")

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
# The core's own subcommands (the connectors' and kvtier-server's `top` come from entry points).
_COMMANDS: list[AddParser] = [analyze_command.add_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a tiered, distributed KV-cache store for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _COMMANDS:
        add_parser(sub)
    for ep in sorted(entry_points(group="kvtier.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except ImportError as exc:  # a broken plugin must not take the other commands down
            log.warning("command %s (%s) unavailable: %s", ep.name, ep.value, exc)
    return parser


def _setup_logging(ns: argparse.Namespace) -> None:
    verbose, quiet = getattr(ns, "verbose", False), getattr(ns, "quiet", False)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s" if verbose
                        else "kvtier: %(message)s")
    progress = getattr(ns, "progress_logger", None)
    if progress and not quiet and not verbose:
        logging.getLogger(progress).setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _setup_logging(ns)
    return int(ns.handler(ns))


if __name__ == "__main__":
    sys.exit(main())
