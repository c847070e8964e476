"""A real ``prometheus`` for tests (Debian package; scripts/test.sh installs it) and the
Grafana dashboard's PromQL as Grafana would send it.

:func:`start_prometheus` runs one on a free loopback port scraping the given targets every
:data:`SCRAPE_S` s (the caller terminates ``proc``); :class:`Prometheus` queries its HTTP API
(an error reply fails the test with Prometheus's reason). :func:`dashboard_queries` lists every
target of deploy/grafana/kvtier-dashboard.json, :func:`resolve_variables` answers its template
variables' ``label_values`` queries and :func:`substitute` fills them in (every value selected).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kvtier_servers import ROOT
from tests.redis_servers import free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier-dashboard.json"
SCRAPE_S = 1

needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (scripts/test.sh installs it)")


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # Prometheus says why (a PromQL parse error, ...)
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] == "vector" else [{"value": result}]

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, f"{expr} -> {result}"
        return float(result[0]["value"][1])


def start_prometheus(workdir: Path, jobs: dict[str, list[str]]) -> Prometheus:
    """Prometheus on a free port scraping ``jobs`` (job -> host:port targets) every second."""
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                                 for job, targets in jobs.items()]}
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = workdir / "prometheus.log"
    for _ in range(3):  # the free port may be taken before Prometheus binds it: try another
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        end = time.monotonic() + 30
        while time.monotonic() < end and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return prom
            except OSError:
                time.sleep(0.2)
        proc.kill()
        proc.wait(10)
    raise RuntimeError(f"prometheus did not start:\n{log.read_text(errors='replace')}")


# --- the dashboard's expressions --------------------------------------------------------------

def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus target in the dashboard JSON."""
    doc = json.loads(DASHBOARD.read_text())
    out = [(p.get("title", "?"), t["expr"]) for p in _panels(doc["panels"]) for t in p.get("targets", [])
           if "expr" in t]
    assert out, f"{DASHBOARD} has no PromQL targets"
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)$")


def resolve_variables(prom: Prometheus) -> dict[str, list[str]]:
    """Each query variable of the dashboard -> the values its label_values() query returns."""
    doc = json.loads(DASHBOARD.read_text())
    out: dict[str, list[str]] = {}
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m, f"variable {var['name']}: {query!r} is not label_values(metric, label)"
        out[var["name"]] = sorted(prom.api(f"label/{m['label']}/values", **{"match[]": m["metric"]}))
    return out


def substitute(expr: str, variables: dict[str, list[str]], rate_interval: str) -> str:
    """Grafana's substitution with every value selected ("All" as the explicit alternation)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):  # $client before a shorter prefix
        # Regex-escaped, then escaped again for the PromQL string literal (as Grafana does).
        alternation = "|".join(re.escape(v).replace("\\", "\\\\") for v in variables[name])
        expr = expr.replace("${" + name + "}", alternation).replace("$" + name, alternation)
    leftover = re.search(r"\$\{?\w+", expr)
    assert leftover is None, f"unsubstituted variable {leftover.group(0)} in {expr}"
    return expr
