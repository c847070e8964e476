"""A ZMQ subscriber of KV events that decodes every message with vLLM's own classes (tests)."""

from __future__ import annotations

import time
from typing import Any

from tests.redis_servers import free_port


class Subscriber:
    """A SUB socket decoding with vLLM: bound on a free loopback port (the publisher connects
    to ``port``), or connected to ``connect`` (a publisher's bound endpoint)."""

    def __init__(self, topic: bytes = b"kv", connect: str | None = None) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.topic = topic
        self.port = 0
        if connect is not None:
            self.sock.connect(connect)
        else:
            self.port = free_port()
            self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seqs: list[int] = []

    def events(self, timeout: float) -> list[Any]:
        """Every event received within ``timeout`` seconds (decoded by vLLM's classes)."""
        import zmq

        out: list[Any] = []
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000), zmq.POLLIN):
                break
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            out.extend(self.decoder.decode(payload).events)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
