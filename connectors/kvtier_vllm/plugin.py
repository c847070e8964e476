"""vLLM general plugin: registers ``KVTierConnector`` in vLLM's connector factory by name.

Installed as the ``vllm.general_plugins`` entry point ``kvtier`` (pyproject.toml), which vLLM
calls in every process it starts (API server, engine core, workers) before it reads the
connector config. With it, ``{"kv_connector": "KVTierConnector"}`` works without
``kv_connector_module_path``, and the code paths that look connectors up by name only
(``MultiConnector``'s stats aggregation, ``KVConnectorFactory.get_connector_class_by_name``)
find ours; without it, such a lookup raises "Connector 'KVTierConnector' is not registered"
in the API server's stats path.

Contract (vLLM's): idempotent, cheap, safe to call many times per process. The connector
module is imported lazily by the factory, only when a config names it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CONNECTOR_NAME = "KVTierConnector"


def register() -> None:
    """Register ``KVTierConnector`` (module ``kvtier_vllm``) unless it already is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvtier_vllm", CONNECTOR_NAME)
    except ValueError:  # vLLM's answer to a second registration of the same name
        log.debug("%s already registered", CONNECTOR_NAME)
