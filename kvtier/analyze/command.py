"""``kvtier analyze``: the subcommand (registered in :data:`kvtier.cli._COMMANDS`).

Only argparse at import time: the analysis, numpy, matplotlib and transformers are imported by
the handler, so ``kvtier --help`` stays instant. Results go to stdout (summary or ``--json``),
progress bars and errors to stderr. Exit status: 0 done (or fingerprint unchanged), 1 the
fingerprint changed, 2 bad input (the message names the flag, file or line).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from kvtier.errors import not_utf8

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*$")
_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _counts(text: str, flag: str) -> tuple[float, ...]:
    out = []
    for part in text.split(","):
        m = _SIZE.match(part)
        if not m or float(m.group(1)) <= 0:
            raise argparse.ArgumentTypeError(f"{flag}: {part!r} is not a positive number (suffixes k, M, G, T)")
        out.append(float(m.group(1)) * _MULT[m.group(2).lower()])
    return tuple(out)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze", help="what prefix caching saves on a request log, and what breaks it",
        description="Replay a request log (JSONL: token ids, text with --tokenizer, or a Mooncake "
                    "trace) through kvtier's eviction policies; report the reuse bound, hit ratio "
                    "and savings per capacity and TTL, and the cache breakers found. "
                    "See docs/analyze.md.")
    p.add_argument("log", nargs="?", help="JSONL request log (not needed with --fingerprint)")
    p.add_argument("--tokenizer", metavar="DIR", help="local tokenizer directory for text logs (nothing is downloaded)")
    p.add_argument("--chunk-tokens", type=int, metavar="N",
                   help="tokens per cached chunk (default 256, kvtier's); a Mooncake trace always uses "
                        "its 512-token hash blocks (a warning says so if N differs)")
    p.add_argument("--capacities", metavar="TOKENS", type=lambda s: _counts(s, "--capacities"),
                   help="cache capacities in tokens of KV, e.g. 1M,4M,16M (default: 2..80%% of the log's distinct prefixes)")
    p.add_argument("--policies", metavar="NAMES", help="comma-separated policies (default: every registered one, and belady)")
    p.add_argument("--ttls", metavar="SECONDS", type=lambda s: _counts(s, "--ttls"), help="TTLs to evaluate (default 60,300,900,3600)")
    p.add_argument("--prices", metavar="FILE", help="price table (YAML/JSON; examples in kvtier/analyze/prices/)")
    p.add_argument("--price-model", metavar="NAME", help="entry of the price table (default: its first)")
    p.add_argument("--kv-bytes-per-token", type=int, metavar="N", help="KV bytes per token, to show capacities in bytes")
    p.add_argument("--isolate-tenants", action="store_true", help="no sharing across tenants (a salted deployment)")
    p.add_argument("--breaker-sample", type=int, default=3000, metavar="N", help="requests sampled for breaker detection")
    p.add_argument("--json", action="store_true", help="print the JSON document (keys in docs/analyze.md) instead of the summary")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report with plots")
    p.add_argument("--fingerprint", metavar="TEMPLATE", help="check the stable prefix of a prompt template against its golden value")
    p.add_argument("--golden", metavar="PATH", help="golden file for --fingerprint (default TEMPLATE.fingerprint.json)")
    p.add_argument("--update", action="store_true", help="with --fingerprint: write the golden file")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                   help="processes replaying capacities/policies in parallel (default: the CPUs, at most 8)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_handle)


def _fail(msg: str) -> int:
    print(f"kvtier analyze: error: {msg}", file=sys.stderr)
    return 2


def _fingerprint(ns: argparse.Namespace, tokenizer: Any) -> int:
    from kvtier.analyze import fingerprint as fpm

    template = Path(ns.fingerprint)
    try:
        text = template.read_text(encoding="utf-8")
    except OSError as exc:
        return _fail(f"--fingerprint {str(template)!r}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        return _fail(f"--fingerprint {str(template)!r}: {not_utf8(exc)}")
    encode = (lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])) if tokenizer is not None else None
    fp = fpm.fingerprint(text, encode)
    golden_file = fpm.golden_path(template, Path(ns.golden) if ns.golden else None)
    for w in fpm.warnings(fp):
        print(f"kvtier analyze: warning: {template}: {w}", file=sys.stderr)
    if ns.update:
        try:
            fpm.write_golden(golden_file, fp, template.name)
        except OSError as exc:  # e.g. --golden in a directory that does not exist
            return _fail(f"cannot write golden file {str(golden_file)!r}: {exc.strerror or exc}")
        print(f"{template}: stable prefix {len(fp.stable_prefix)} chars, sha256 {fp.sha256}; wrote {golden_file}")
        return 0
    golden = fpm.load_golden(golden_file)
    if golden is None:
        return _fail(f"no golden file {str(golden_file)!r}: run with --update once and commit it")
    problems = fpm.check(fp, golden)
    if problems:
        print(f"{template}: FAIL\n" + "\n".join(problems))
        print(f"(if the change is intended: kvtier analyze --fingerprint {template} --update)")
        return 1
    print(f"{template}: stable prefix unchanged ({len(fp.stable_prefix)} chars, sha256 {fp.sha256[:16]}…)")
    return 0


def _handle(ns: argparse.Namespace) -> int:
    import json

    from kvtier.analyze import analysis, readers, report
    from kvtier.analyze.cost import PriceError, load_prices, select
    from kvtier.analyze.fingerprint import FingerprintError

    progress = not ns.quiet
    try:
        tokenizer = readers.load_tokenizer(ns.tokenizer) if ns.tokenizer else None
        if ns.fingerprint:
            return _fingerprint(ns, tokenizer)
        if not ns.log:
            return _fail("a LOG file is needed (or --fingerprint TEMPLATE)")
        if ns.jobs < 1:
            return _fail(f"--jobs must be >= 1, got {ns.jobs}")
        if ns.breaker_sample < 2:
            return _fail(f"--breaker-sample must be >= 2, got {ns.breaker_sample}")
        if ns.kv_bytes_per_token is not None and ns.kv_bytes_per_token < 1:
            return _fail(f"--kv-bytes-per-token must be >= 1, got {ns.kv_bytes_per_token}")
        # Empty items (`lru,`) are skipped; none left would mean "every policy", not what was asked.
        policies = tuple(n.strip() for n in (ns.policies or "").split(",") if n.strip())
        if ns.policies is not None and not policies:
            return _fail(f"--policies {ns.policies!r}: no policy name in it")
        price = select(load_prices(ns.prices), ns.price_model) if ns.prices else None
        log = readers.read_log(ns.log, tokenizer=tokenizer, chunk_tokens=ns.chunk_tokens,
                               keep_heads=ns.breaker_sample, isolate_tenants=ns.isolate_tenants,
                               progress=progress)
        C = log.chunk_tokens
        caps = tuple(max(1, -(-int(t) // C)) for t in ns.capacities) if ns.capacities else ()
        decode = (lambda a: str(tokenizer.decode(a.tolist()))) if tokenizer is not None else None
        opts = analysis.Options(
            capacities=caps, policies=policies,
            ttls=ns.ttls or analysis.DEFAULT_TTLS, price=price, kv_bytes_per_token=ns.kv_bytes_per_token,
            breaker_sample=ns.breaker_sample, decode=decode, progress=progress, jobs=ns.jobs)
        doc = analysis.analyze(log, opts)
    except (readers.LogError, PriceError, FingerprintError) as exc:
        return _fail(str(exc))
    except ValueError as exc:  # unknown policy and the like: the message names it
        return _fail(str(exc))
    if ns.html:
        from kvtier.analyze import html

        try:
            Path(ns.html).write_text(html.render(doc))
        except OSError as exc:
            return _fail(f"--html {ns.html!r}: {exc.strerror or exc}")
    if ns.json:
        # allow_nan=False: bare NaN/Infinity is not JSON. The reader refuses non-finite input, so
        # one here is a bug: report it rather than hand a strict parser downstream broken JSON.
        try:
            print(json.dumps(doc, allow_nan=False))
        except ValueError as exc:
            return _fail(f"--json: the result holds a non-finite number ({exc}); please report it")
    else:
        print(report.summary(doc))
    if ns.html and not ns.json:
        print(f"HTML report: {ns.html}")
    return 0
