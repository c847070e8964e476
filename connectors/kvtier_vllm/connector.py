"""``KVTierConnector``: the thin ``KVConnectorBase_V1`` face vLLM loads by configuration.

    --kv-transfer-config '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier_vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                           "kv_connector_extra_config":{...}}'

vLLM builds one instance per role: SCHEDULER (EngineCore process) delegates to
``scheduler.SchedulerSide``; WORKER (each worker process) to ``worker.WorkerSide``. The
configuration is validated in both, so a bad value fails engine start with a ``ConfigError``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import ConfigError

from .namespace import EngineInfo, engine_revision
from .protocol import KVTierMetadata
from .scheduler import SchedulerSide
from .settings import check_block_size, load_settings
from .stats import KVTierStats
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _setup_logging(level: str) -> None:
    """kvtier's loggers at ``level``, with a stderr handler unless the process configured one
    (vLLM configures only its own ``vllm`` logger)."""
    for name in ("kvtier", "kvtier_vllm"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("(kvtier pid=%(process)d) %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        cfg, settings = load_settings(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        check_block_size(cfg, self._block_size)
        _setup_logging(cfg.log_level)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r; with 'recompute' a chunk that "
                        "cannot be loaded is recomputed instead of failing the request", policy)
        self._cfg, self._settings = cfg, settings
        pc = vllm_config.parallel_config
        kv_events = bool(getattr(vllm_config, "kv_events_config", None)
                         and getattr(vllm_config.kv_events_config, "enable_kv_cache_events", False))
        self._kv_events = kv_events
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                cfg, settings, block_size=self._block_size,
                engine_id=str(self._kv_transfer_config.engine_id),
                dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
                world_size=pc.tensor_parallel_size * pc.pipeline_parallel_size, kv_events=kv_events,
                hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
                model=settings.model_id or str(vllm_config.model_config.model))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True whenever kvtier loads or saves: both run per layer (``wait_for_layer_load``,
        ``save_kv_layer``), and a full CUDA graph replays without those calls, so a decode
        batch holding a fully cached prompt would read its blocks before they land."""
        _, settings = load_settings(extra_config)
        return settings.load or settings.save

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is only a future miss

    # ==== worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        info = self._engine_info(kv_caches)
        worker = WorkerSide(self._cfg, self._settings, info)
        try:
            worker.register(kv_caches)
        except ValueError as exc:
            raise ConfigError(f"kvtier cannot use this engine's KV cache: {exc}") from exc
        self._worker = worker

    def _engine_info(self, kv_caches: dict[str, torch.Tensor]) -> EngineInfo:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        vc = self._vllm_config
        tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        pp = get_pp_group()
        layer = vc.compilation_config.static_forward_context.get(next(iter(kv_caches)))
        backend = layer.attn_backend.get_name() if layer is not None else "unknown"
        return EngineInfo(
            model_id=self._settings.model_id or str(vc.model_config.model),
            model_revision=self._settings.model_revision or engine_revision(vc.model_config),
            block_size=self._block_size, cache_dtype=str(vc.cache_config.cache_dtype),
            rank=pp.rank_in_group * tp + tp_rank, world_size=pp.world_size * tp,
            dp_rank=int(getattr(vc.parallel_config, "data_parallel_rank", 0) or 0),
            engine_id=str(self._kv_transfer_config.engine_id), backend=backend,
            isa=getattr(layer, "isa", None), kv_events=self._kv_events,
            mla=bool(getattr(vc.model_config, "use_mla", False)))

    def _meta(self) -> KVTierMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVTierMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        w = self._worker
        if w is not None and w.enabled and isinstance(connector_metadata, KVTierMetadata):
            # vLLM binds a step's metadata just before its forward pass (start_load_kv comes
            # after the forward when the step has no sync load): the start of the step the
            # worker times the engine's prefill by (loadplan.py).
            w.costs.step_begin(connector_metadata.step_tokens, time.perf_counter())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None and meta.saves:  # most steps save nothing
            self._worker.capture_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return None, self._worker.finished(finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._sched is not None:
            return self._sched.get_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data)

    # ==== scheduler side =========================================================================
    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        assert self._sched is not None
        return self._sched.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request)

    def take_events(self) -> list[Any]:
        """Scheduler side: BlockStored/BlockRemoved for kvtier's tiers (events.py); vLLM
        publishes them with its own GPU events when kv_events_config enables events."""
        return self._sched.take_events() if self._sched is not None else []

    def get_kv_connector_kv_cache_events(self) -> None:
        """Worker side (vLLM >= 0.32 names it so): kvtier's events travel in the worker
        metadata to the scheduler, which alone can describe them (it holds the requests' block
        hashes); returning them here too would publish them twice."""
        return None
