"""``kvtier demo``'s command line, registered with the ``kvtier`` CLI through the
``kvtier.commands`` entry point (pyproject.toml): the core CLI never imports a connector.

This module imports nothing heavy; the demo itself (:mod:`kvtier_hf.demo`, torch,
transformers) is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket

from kvtier.errors import KVTierError
from kvtier.protocol.addresses import parse_hostport

log = logging.getLogger("kvtier.cli")

DEMO_EPILOG = """\
what it does:
  1. cold run (this process): builds a random-weight Llama (no download), prefills the whole
     prompt, saves its K/V chunks into a cpu tier written through to a disk tier, decodes.
  2. warm run (a fresh process, sharing only the disk directory): restores the prefix from the
     store, prefills only the last prompt token, decodes.
  It prints the prefill tokens saved, both times to first token, hits per tier, and whether the
  two greedy outputs are identical. No GPU, Redis or config file is needed.

examples:
  kvtier demo                         # defaults: 3072-token prefix + 64-token question
  kvtier demo --json                  # last stdout line is one JSON object
  kvtier demo --prefix-tokens 1024    # quicker
  kvtier demo --dir /tmp/kv           # keep the disk tier there; a rerun's cold phase then hits
  kvtier-server --port 50051 &        # then: kvtier demo --server 127.0.0.1:50051
"""


def _positive(text: str) -> int:
    # Our own message for a non-number too: argparse's would name this function
    # ("invalid _positive value").
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _hostport(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:50051)") from None
    return text


def _unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why nothing listens at ``address`` (host:port), or "" when a TCP connection opens."""
    try:
        socket.create_connection(parse_hostport(address), timeout=timeout_s).close()
    except OSError as exc:
        return str(exc)
    return ""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``demo`` on the ``kvtier`` CLI's subparsers (the entry point's target)."""
    p = sub.add_parser(
        "demo", help="cold vs warm run of a real engine over a shared long prefix",
        description="Run a real engine (transformers, random-weight Llama) over a long shared "
                    "prefix twice, cold and then warm in a fresh process, and show what kvtier saved.",
        epilog=DEMO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="end the output with one JSON line of results")
    p.add_argument("--prefix-tokens", type=_positive, default=3072, metavar="N",
                   help="length of the shared prefix (default 3072)")
    p.add_argument("--question-tokens", type=_positive, default=64, metavar="N",
                   help="tokens after the prefix (default 64)")
    p.add_argument("--new-tokens", type=_positive, default=16, metavar="N",
                   help="greedy tokens to generate (default 16)")
    p.add_argument("--chunk-tokens", type=_positive, default=128, metavar="N",
                   help="tokens per cached chunk (default 128: 2 MiB chunks of the demo model)")
    p.add_argument("--preset", choices=("demo", "test"), default="demo",
                   help="model size: demo (~32M params, default) or test (tiny, for smoke tests)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens (default 0)")
    p.add_argument("--dir", metavar="PATH",
                   help="directory for the disk tier (default: a fresh temporary one, removed after)")
    p.add_argument("--server", metavar="HOST:PORT", type=_hostport,
                   help="use a running kvtier-server (grpc tier) instead of the disk tier; the "
                        "server keeps the chunks, so a rerun's cold phase hits too")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    # Internal: run one phase in this process and print its result as JSON (the warm phase's
    # fresh process is started this way).
    p.add_argument("--_phase", choices=("cold", "warm"), help=argparse.SUPPRESS)
    p.set_defaults(handler=_run_demo, progress_logger="kvtier_hf.demo")


def _run_demo(ns: argparse.Namespace) -> int:
    from kvtier_hf import demo

    opts = demo.DemoOptions(prefix_tokens=ns.prefix_tokens, question_tokens=ns.question_tokens,
                            new_tokens=ns.new_tokens, chunk_tokens=ns.chunk_tokens, preset=ns.preset,
                            seed=ns.seed, dir=ns.dir, server=ns.server)
    try:
        if ns._phase:
            result = demo.run_phase(opts, ns._phase)
            print(json.dumps(demo.asdict(result)), flush=True)
            return 0
        why = _unreachable(ns.server) if ns.server else ""
        if why:  # else both phases would run against a tier that misses everything
            log.error("demo: no kvtier-server answers at %s (%s); start one with "
                      "`kvtier-server --port PORT` and pass its grpc port", ns.server, why)
            return 2
        child_flags = ["-v"] if ns.verbose else ["-q"] if ns.quiet else []
        report = demo.run_demo(opts, child_flags)
    except ModuleNotFoundError as exc:
        if exc.name not in ("torch", "transformers", "safetensors"):
            raise
        log.error("kvtier demo needs torch and transformers (%s): pip install 'kvtier[hf]'", exc)
        return 2
    except KVTierError as exc:  # e.g. a --dir where the disk tier cannot be created
        log.error("demo: %s", exc)
        return 2
    except RuntimeError as exc:  # the warm-phase process failed; its own errors came first
        log.error("%s", exc)
        return 1
    print(demo.format_report(report), flush=True)
    if ns.json:
        print(json.dumps(report.to_dict()), flush=True)
    return 0 if report.outputs_identical else 1
