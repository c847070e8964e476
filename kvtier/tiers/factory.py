"""Build the enabled tiers of a config, fastest first: cpu, disk, redis, grpc.

Imports are lazy so that a deployment without redis-py or grpcio never imports them.
"""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.tiers.base import Tier


def build_tiers(cfg: KVTierConfig) -> list[Tier]:
    tiers: list[Tier] = []
    if cfg.cpu.enabled:
        from kvtier.tiers.cpu import CpuTier

        tiers.append(CpuTier(cfg.cpu))
    if cfg.disk.enabled:
        from kvtier.tiers.disk import DiskTier

        tiers.append(DiskTier(cfg.disk))
    if cfg.redis.enabled:
        from kvtier.tiers.redis import RedisTier

        tiers.append(RedisTier(cfg.redis))
    if cfg.grpc.enabled:
        from kvtier.tiers.remote import GrpcTier

        tiers.append(GrpcTier(cfg.grpc))
    if not tiers:
        raise ValueError("no tier is enabled: enable at least one of cpu, disk, redis, grpc")
    return tiers
