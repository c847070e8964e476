"""kvtier-server KV events: what this node stores and evicts, over ZMQ in vLLM's wire format.

Prefix-aware routers (llm-d, Dynamo, vLLM production-stack) subscribe to vLLM engines' KV
events; with ``events_endpoint`` set, a kvtier-server publishes the same messages for the
chunks it holds, so a router can count them as hits for any engine that uses this node.

Wire (vLLM's ``ZmqEventPublisher``): a PUB socket; each message is multipart
``[topic, sequence (8-byte big-endian, from 0), payload]``, the payload being msgpack of
vLLM's ``KVEventBatch`` (``[ts, [event, ...]]``), each event a map tagged
``"type": "BlockStored" | "BlockRemoved"`` with vLLM's field names, so
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` decodes it. As in vLLM an
endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to.

What an event says (a chunk is one block):
- Per tier, as the vLLM connector reports its own: ``BlockStored`` when a tier takes a chunk
  (a Put into disk, or RAM on a RAM-only node; RAM caching of what disk holds; promotion of
  a disk hit), ``BlockRemoved`` when a tier evicts it (capacity, quota, the shared pool),
  refuses it or a Delete removes it. The node serves a chunk while any medium holds it.
  A put is announced before it runs (kvtier.store.StoreListener explains why).
- ``block_hashes``: ``[chunk key]`` (kvtier's 32-byte chained key); ``parent_block_hash``: the
  previous chunk's key when the client sent it (the grpc tier does), else None;
  ``block_size``: the chunk's tokens (from its header); ``medium``: vLLM's ``STORAGE`` (disk)
  or ``CPU`` (RAM-only node); ``ownership``: ``kvtier-server:<node id>``; ``extra_keys``:
  ``[(namespace hex,)]``: the namespace the chain starts from (docs/keys.md), so a router that
  holds a prompt's tokens can compute its chunk keys and score this node's chunks.
- ``token_ids`` is empty: a chunk carries no token ids (its key is a hash of them, its header
  holds layout, namespace and key), and the server never sees prompts. The engines' own
  events (the vLLM connector's) carry the tokens of the same chunks.

Every tenant's chunk keys reach every subscriber: bind the endpoint where only routers reach.

Threads: :meth:`EventSink.stored` / :meth:`removed` are called by request threads and, for
evictions, with a tier's lock held; they only append to a bounded buffer (beyond
``max_queue`` events new ones are dropped and counted). One publisher thread owns the socket
and sends one batch per ``interval_s``. pyzmq and msgspec (the ``events`` extra) are imported
only when events are on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvtier.chunk import decode_header
from kvtier.errors import ChunkError, ConfigError
from kvtier.tiers.base import Entry

log = logging.getLogger(__name__)

MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"  # vLLM's kv_events constants


def medium_of(tier: str) -> str:
    return MEDIUM_CPU if tier == "cpu" else MEDIUM_STORAGE


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and local-transport endpoints, connect to the others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_endpoint(endpoint: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"events_endpoint: {endpoint!r} is not a ZMQ endpoint "
                          "(tcp://*:5557, tcp://router-host:5557, ipc:///path)")


class EventSink:
    """Bounded buffer of this node's events and the thread that publishes them."""

    def __init__(self, endpoint: str, node_id: str, *, topic: str = "", max_queue: int = 100_000,
                 interval_s: float = 0.05) -> None:
        check_endpoint(endpoint)
        try:
            import msgspec
            import zmq
        except ImportError as exc:
            raise ConfigError(f"events_endpoint needs pyzmq and msgspec ({exc}): "
                              "pip install 'kvtier[events]'") from exc
        self.endpoint = endpoint
        self.owner = f"kvtier-server:{node_id}"
        self.topic = topic.encode()
        self.max_queue = max_queue
        self.interval_s = interval_s
        self.published = self.dropped = self.batches = 0
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx: Any = zmq.Context.instance()
        self._pub: Any = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (%s)", endpoint, "bound" if binds(endpoint) else "connected")

    # --- producers (any thread; evictions with a tier lock held) ------------------------------
    def stored(self, tier: str, entries: Sequence[Entry]) -> None:
        events = []
        for e in entries:
            try:
                head = decode_header(e.data)
            except ChunkError as exc:  # the request layer verified it: never expected
                log.warning("KV events: chunk %s has no readable header (%s)", e.key.hex()[:16], exc)
                continue
            events.append({
                "type": "BlockStored", "block_hashes": [bytes(e.key)],
                "parent_block_hash": bytes(e.parent) if e.parent else None, "token_ids": [],
                "block_size": head.shape[2], "lora_id": None, "medium": medium_of(tier),
                "lora_name": None, "extra_keys": [[head.namespace.hex()]], "ownership": self.owner})
        self._add(events)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._add([{"type": "BlockRemoved", "block_hashes": [bytes(k) for k in keys],
                        "medium": medium_of(tier), "ownership": self.owner}])

    def _add(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            room = self.max_queue - len(self._pending)
            if len(events) > room:
                self.dropped += len(events) - max(room, 0)
                events = events[:max(room, 0)]
            self._pending.extend(events)

    # --- the publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        import zmq

        payload = self._encode([time.time(), events])
        try:
            self._pub.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at its high-water mark rather than block; so do we
            self.dropped += len(events)
            return
        except zmq.ZMQError as exc:
            self.dropped += len(events)
            log.warning("KV events: sending a batch of %d failed: %s", len(events), exc)
            return
        self._seq += 1
        self.batches += 1
        self.published += len(events)

    def close(self) -> None:
        """Publish what is buffered, stop the thread, close the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)


def attach(stores: Sequence[Any], sink: EventSink) -> None:
    """Report every tenant store's tiers into ``sink``: evictions through each tier's key-only
    hook, puts (RAM caching and promotions included) and deletes through ``store.events``."""
    for store in stores:
        store.events = sink
        for tier in store.tiers:

            def evicted(key: bytes, name: str = tier.name) -> None:
                sink.removed(name, (key,))

            tier.evicted_key_listener = evicted


class EventsCollector(Collector):
    """``kvtier_server_kv_events_total`` and ``kvtier_server_kv_events_dropped_total``."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("kvtier_server_kv_events", "KV events published over ZMQ",
                                  value=self.sink.published)
        yield CounterMetricFamily("kvtier_server_kv_events_dropped",
                                  "KV events dropped (buffer full or the socket refused them)",
                                  value=self.sink.dropped)
