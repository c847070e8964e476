"""The engines' usage reports as Prometheus series on kvtier-server's /metrics.

A collector over :class:`kvtier.server.usage.UsageAggregator`: at each scrape it exposes, per
``tenant``, ``model`` and ``replica`` (sources of one replica summed), the totals the node
holds. Cardinality is bounded by the aggregator's caps (256 replicas, 32 models, 64 tenants,
the rest under ``other``; 16 tiers or reasons per replica). Every replica reports to every node
it uses, so the same series appears on several nodes: take ``max by (tenant, model, replica)``
before summing across replicas, e.g. the cluster's prompt-token hit ratio::

    sum(max by (tenant, model, replica) (rate(kvtier_server_engine_hit_tokens_total[5m])))
      / sum(max by (tenant, model, replica) (rate(kvtier_server_engine_prompt_tokens_total[5m])))

Series: ``kvtier_server_engine_{prompt,restored,prefill_saved}_tokens_total``,
``kvtier_server_engine_hit_tokens_total{tier}``, ``kvtier_server_engine_miss_tokens_total{reason}``,
``kvtier_server_engine_load_failures_total``, ``kvtier_server_engine_save_drops_total`` and the
gauge ``kvtier_server_engine_replica_reporting`` (0 once a replica stopped reporting).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.server.usage import UsageAggregator

_LABELS = ["tenant", "model", "replica"]
_PLAIN = (("prompt_tokens", "prompt_tokens", "Prompt tokens the engines looked up"),
          ("restored_tokens", "restored_tokens", "Prompt tokens restored into the engines"),
          ("prefill_saved_tokens", "prefill_tokens_saved", "Prompt tokens the engines did not prefill"),
          ("load_failures", "load_failures", "Restores that fell short"),
          ("save_drops", "save_drops", "Save jobs the engines dropped"))


class EngineUsageCollector(Collector):
    def __init__(self, usage: UsageAggregator) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        totals: dict[tuple[str, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        reporting: dict[tuple[str, str, str], bool] = {}
        for r in self.usage.document()["replicas"]:
            key = (r["tenant"], r["model"], r["replica"])
            for name, v in r["totals"].items():
                totals[key][name] += v
            reporting[key] = reporting.get(key, False) or not r["stale"]
        for metric, counter, doc in _PLAIN:
            fam = CounterMetricFamily(f"kvtier_server_engine_{metric}", doc, labels=_LABELS)
            for key, t in totals.items():
                fam.add_metric(list(key), t.get(counter, 0.0))
            yield fam
        for metric, base, label, doc in (("hit_tokens", "hit_tokens", "tier", "Prompt tokens found, by tier"),
                                         ("miss_tokens", "miss_tokens", "reason", "Prompt tokens missed, by reason")):
            fam = CounterMetricFamily(f"kvtier_server_engine_{metric}", doc, labels=[*_LABELS, label])
            for key, t in totals.items():
                for name, v in t.items():
                    if name.startswith(base + "/"):
                        fam.add_metric([*key, name.split("/", 1)[1]], v)
            yield fam
        gauge = GaugeMetricFamily("kvtier_server_engine_replica_reporting",
                                  "1 while a replica reports, 0 after 3 silent intervals", labels=_LABELS)
        for key, ok in reporting.items():
            gauge.add_metric(list(key), 1.0 if ok else 0.0)
        yield gauge
