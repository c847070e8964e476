"""Every kvtier metric follows the Prometheus naming rules of docs/metrics.md, and tenant
labels stay bounded however many tenants come and go.

The registries scanned are the real ones: the library's ``Metrics`` with the vLLM
connector's series on it, and kvtier-server's ``ServerMetrics`` with its storage and
lower-tier collectors, over a real ``Storage``. A metric added anywhere in them that breaks
a rule (unit, ``_total``, an unknown label, undocumented) fails here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvtier_vllm.metrics import ConnectorMetrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvtier.cache import PrefixCache
from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.labelcap import OTHER
from kvtier.metrics import Metrics
from kvtier.server.app import declare_node_capacity
from kvtier.server.auth import Tenant
from kvtier.server.lower import LowerCollector
from kvtier.server.metrics import ServerMetrics
from kvtier.server.storage import Storage
from kvtier.server.usage import UsageAggregator
from kvtier.server.usage_metrics import EngineUsageCollector
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.memory import MemoryTier
from tests.kvtier_servers import ROOT, make_chunk, make_keys

DOC = ROOT / "docs" / "metrics.md"
# Label names whose values are bounded (docs/metrics.md says by what). tenant/model: capped.
BOUNDED_LABELS = {"tier", "reason", "op", "method", "code", "direction", "path", "outcome"}
CAPPED_LABELS = {"tenant", "model", "replica"}  # replica: the usage aggregator's caps
# Unit spellings Prometheus asks to replace by base units (_seconds, _bytes, ratios).
NON_BASE_UNITS = re.compile(r"_(ms|msec|millis|milliseconds|us|usec|microseconds|ns|nanoseconds|"
                            r"minutes|hours|days|kb|mb|gb|kib|mib|gib|kilobytes|megabytes|percent)(_|$)")
TIME_WORDS = re.compile(r"(^|_)(duration|latency|time|wait|elapsed|age)(_|$)")
SIZE_WORDS = re.compile(r"(^|_)(size|memory|capacity|used)(_|$)")


@dataclass(frozen=True)
class Family:
    name: str  # as declared (a counter's without _total, as prometheus_client keeps it)
    type: str
    labels: tuple[str, ...]
    exposed: str  # the name a scrape shows (a counter's with _total)


def _families(registry: CollectorRegistry) -> Iterator[Family]:
    # Label names are read from the declarations (a labelled metric without samples yet
    # exposes none): prometheus_client keeps them in _labelnames on metric objects and on
    # the families a custom collector yields.
    for collector in list(registry._collector_to_names):  # noqa: SLF001 - see above
        if isinstance(collector, MetricWrapperBase):
            [family] = collector.describe()
            labels = tuple(collector._labelnames)  # noqa: SLF001
            yield Family(family.name, family.type, labels, _exposed(family.name, family.type))
            continue
        for family in collector.collect():
            labels = tuple(getattr(family, "_labelnames", ()))
            yield Family(family.name, family.type, labels, _exposed(family.name, family.type))


def _exposed(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Family]]:
    disk = tmp_path_factory.mktemp("names-disk")
    storage = Storage([Tenant("default")], CpuTierConfig(enabled=True, capacity_bytes=1 << 20, slot_bytes=1 << 16),
                      DiskTierConfig(enabled=True, path=str(disk), capacity_bytes=1 << 20))
    client = Metrics()
    ConnectorMetrics(client)
    server = ServerMetrics(storage)
    server.registry.register(LowerCollector(storage, server.tenant_label))
    server.registry.register(EngineUsageCollector(UsageAggregator()))
    declare_node_capacity(server.registry, {"cpu": 1 << 20, "disk": 1 << 20})  # as KVTierServer.start
    try:
        out = [*_families(client.registry), *_families(server.registry)]
        yield out
    finally:
        storage.close()


def test_registries_are_scanned(families: list[Family]) -> None:
    names = {f.exposed for f in families}
    # One known name per declaring module: the scan reaches all of them.
    for name in ("kvtier_lookup_hit_tokens_total", "kvtier_connector_load_tokens_total",
                 "kvtier_server_requests_total", "kvtier_server_tier_used_bytes",
                 "kvtier_server_lower_writes_total", "kvtier_server_engine_prompt_tokens_total"):
        assert name in names, name
    assert len(names) == len(families), "a metric name is declared twice"


def test_names_follow_prometheus_conventions(families: list[Family]) -> None:
    bad = []
    for f in families:
        why = []
        if not re.fullmatch(r"kvtier_[a-z][a-z0-9]*(_[a-z0-9]+)*", f.name):
            why.append("not kvtier_<snake_case>")
        if NON_BASE_UNITS.search(f.name):
            why.append("non-base unit (use _seconds / _bytes / a 0-1 ratio)")
        if f.type == "counter" and f.name.endswith("_total"):
            why.append("counter declared with _total twice")
        if f.type != "counter" and f.name.endswith("_total"):
            why.append(f"a {f.type} must not end _total")
        if f.type == "histogram" and not f.name.endswith(("_seconds", "_bytes", "_tokens", "_chunks")):
            why.append("histogram name must end in its unit")
        if TIME_WORDS.search(f.name) and not f.name.endswith("_seconds"):
            why.append("a time must be in _seconds")
        if SIZE_WORDS.search(f.name) and "bytes" not in f.name and not f.name.endswith("_entries"):
            why.append("a size must be in _bytes")
        if f.type == "gauge" and f.name.endswith(("_count", "_sum", "_bucket")):
            why.append("gauge named like a histogram series")
        if why:
            bad.append(f"{f.exposed} ({f.type}): {'; '.join(why)}")
    assert not bad, "\n".join(bad)


def test_every_label_is_bounded(families: list[Family]) -> None:
    unknown = [f"{f.exposed}: {label}" for f in families for label in f.labels
               if label not in BOUNDED_LABELS | CAPPED_LABELS]
    assert not unknown, ("labels with no known bound (add them to BOUNDED_LABELS and docs/metrics.md "
                         "only if their values are a fixed set):\n" + "\n".join(unknown))


def test_every_metric_is_documented(families: list[Family]) -> None:
    doc = DOC.read_text()
    missing = [f.exposed for f in families if f"`{f.exposed}`" not in doc]
    assert not missing, f"metrics missing from {DOC.name}: {missing}"


def _tenant_values(registry: CollectorRegistry) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if "tenant" in sample.labels:
                out.setdefault(family.name, set()).add(sample.labels["tenant"])
    return out


def test_library_tenant_label_is_capped() -> None:
    spec = NamespaceSpec("names-model", KVLayout(1, 1, 8, chunk_tokens=4), kv_dtype="float16")
    store = TieredStore([MemoryTier(1 << 20)], metrics=Metrics(label_values=3))
    try:
        for i in range(10):  # ten tenants, each with one lookup
            PrefixCache(store, spec, tenant=f"tenant-{i}").lookup(list(range(12)))
        values = _tenant_values(store.metrics.registry)
        assert values, "no tenant-labelled series"
        for name, tenants in values.items():
            assert tenants == {"tenant-0", "tenant-1", "tenant-2", OTHER}, (name, tenants)
        lookups = store.metrics.registry.get_sample_value
        assert lookups("kvtier_lookup_requests_total", {"tenant": OTHER}) == 7
        assert lookups("kvtier_lookup_requests_total", {"tenant": "tenant-1"}) == 1
    finally:
        store.close()


def test_server_tenant_label_is_capped_and_sums_the_rest(tmp_path: Path) -> None:
    tenants = [Tenant(f"t{i}") for i in range(6)]
    storage = Storage(tenants, CpuTierConfig(enabled=True, capacity_bytes=1 << 22, slot_bytes=1 << 16),
                      DiskTierConfig(enabled=False))
    try:
        metrics = ServerMetrics(storage, label_values=2)
        for i, tenant in enumerate(tenants):  # tenant i holds i+1 chunks
            keys = make_keys(i + 1, seed=i)
            assert all(storage.stores[tenant.name].put([Entry(k, make_chunk(k)) for k in keys]))
        values = _tenant_values(metrics.registry)
        assert values["kvtier_server_tier_entries"] == {"t0", "t1", OTHER}
        get = metrics.registry.get_sample_value
        assert get("kvtier_server_tier_entries", {"tenant": "t1", "tier": "cpu"}) == 2
        assert get("kvtier_server_tier_entries", {"tenant": OTHER, "tier": "cpu"}) == 3 + 4 + 5 + 6
    finally:
        storage.close()


def test_local_tier_gauges_are_current_at_each_scrape() -> None:
    """Nobody calls store.stats() in an engine: the scrape itself must read the local tiers."""
    spec = NamespaceSpec("names-model", KVLayout(1, 1, 8, chunk_tokens=4), kv_dtype="float16")
    store = TieredStore([MemoryTier(1 << 20)])
    try:
        cache = PrefixCache(store, spec)
        per_token = math.prod(spec.layout.chunk_shape(1)) * 2
        assert cache.save(list(range(12)), lambda s, e: bytes((e - s) * per_token), full_chunks_only=True) == 3
        get = store.metrics.registry.get_sample_value
        assert get("kvtier_tier_entries", {"tier": "memory"}) == 3
        assert get("kvtier_tier_used_bytes", {"tier": "memory"}) == store.tiers[0].usage().used_bytes > 0
        store.delete(cache.keys(list(range(12)))[:1])
        assert get("kvtier_tier_entries", {"tier": "memory"}) == 2
    finally:
        store.close()
