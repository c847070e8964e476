"""The ``vllm.general_plugins`` entry point registers KVTierConnector with vLLM's real factory.

Each check runs in a fresh interpreter, so vLLM's process-wide connector registry starts empty
(as in each process vLLM starts), and a control shows the by-name lookup fails without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

_CHECK = textwrap.dedent("""
    import json
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.config import KVTransferConfig
    out = {}
    try:
        KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
        out["before"] = "registered"
    except ValueError as exc:
        out["before"] = str(exc)
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # vLLM's own loader, through the installed entry point
    out["after_plugins"] = "KVTierConnector" in KVConnectorFactory._registry
    from kvtier_vllm.plugin import register
    register()  # a second registration in the same process is harmless
    cls = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
    by_config = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both"))
    from kvtier_vllm.stats import KVTierStats
    data = KVTierStats().data
    data["lookups"] = 3
    multi = MultiConnector.build_kv_connector_stats({"KVTierConnector": data})
    out.update(cls=f"{cls.__module__}.{cls.__name__}", same=by_config is cls,
               stats=type(multi.data["KVTierConnector"]).__name__,
               lookups=multi.data["KVTierConnector"].data["lookups"])
    # kvtier beside vLLM's OffloadingConnector in one MultiConnector: what two steps' serialised
    # stats become in the API server's stats path (aggregate, then reduce for the log line).
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    off = OffloadingConnector.build_kv_connector_stats()
    steps = []
    for n in (3, 4):
        d = KVTierStats().data
        d["lookups"] = n
        steps.append(MultiConnector.build_kv_connector_stats(
            {"KVTierConnector": d, "OffloadingConnector": off.data}))
    both = steps[0].aggregate(steps[1])
    out.update(both_types=sorted(type(v).__name__ for v in both.data.values()),
               both_lookups=both.reduce()["KVTierConnector"]["lookups"])
    print(json.dumps(out))
""")


def test_entry_point_is_declared() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvtier"]
    assert [ep.value for ep in eps] == ["kvtier_vllm.plugin:register"]


def test_plugin_registers_the_connector_for_name_lookups_and_multiconnector_stats() -> None:
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "not registered" in out["before"]  # control: vLLM alone does not know the name
    assert out["after_plugins"]
    assert out["cls"] == "kvtier_vllm.connector.KVTierConnector" and out["same"]
    assert out["stats"] == "KVTierStats" and out["lookups"] == 3
    assert out["both_types"] == ["KVTierStats", "OffloadingConnectorStats"] and out["both_lookups"] == 7
