"""The subscriber side of one replica's event stream, for routers: live batches from
the PUB socket in sequence order with every gap filled from the replay socket (a
subscriber that joins late, or misses batches, asks for them from the last number it
has). Works with any publisher of vLLM's format (kvdist's, vLLM's own)."""

from __future__ import annotations

import msgspec
import zmq

from .wire import KVEventBatch, decoder

__all__ = ["EventSubscriber"]


class EventSubscriber:
    """SUB socket on ``endpoint`` (and a DEALER on ``replay_endpoint``, if any).

    ``poll`` returns ``(seq, batch)`` pairs, each number once and in order from
    ``next_seq`` (0: the start of the stream). ``lost`` counts numbers that could not be
    had (no replay socket, or the publisher's buffer no longer holds them): a router
    should forget the replica's blocks and start again from a full replay then.
    ``undecodable`` counts payloads that were not a KVEventBatch (skipped)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 context: zmq.Context | None = None, replay_timeout_ms: int = 2000):
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._decode = decoder().decode
        self._timeout = replay_timeout_ms
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self.sub.connect(endpoint)
        self.replay_sock: zmq.Socket | None = None
        if replay_endpoint is not None:
            self.replay_sock = self._ctx.socket(zmq.DEALER)
            self.replay_sock.connect(replay_endpoint)
        self.next_seq = 0
        self.lost = 0
        self.undecodable = 0

    def poll(self, timeout_ms: int = 0) -> list[tuple[int, KVEventBatch]]:
        """Every batch that arrived (waiting up to ``timeout_ms`` for the first), with
        the gaps before them filled by replay."""
        out: list[tuple[int, KVEventBatch]] = []
        wait = timeout_ms
        while self.sub.poll(wait):
            wait = 0
            frames = self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.undecodable += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq < self.next_seq:
                continue  # had it already (from a replay)
            if seq > self.next_seq:
                out.extend(self.replay(self.next_seq, upto=seq))
            self._take(seq, frames[2], out)
        return out

    def catch_up(self) -> list[tuple[int, KVEventBatch]]:
        """Everything the publisher still keeps from ``next_seq`` on, by replay (a late
        subscriber's first call; needs a replay socket)."""
        return self.replay(self.next_seq)

    def replay(self, start: int, upto: int | None = None) -> list[tuple[int, KVEventBatch]]:
        """Batches ``start .. upto-1`` (or to the end of the publisher's buffer) from the
        replay socket; numbers that cannot be had count in ``lost``."""
        out: list[tuple[int, KVEventBatch]] = []
        sock = self.replay_sock
        if sock is not None:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(self._timeout):
                frames = sock.recv_multipart()  # (b"", topic, seq, payload)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:
                    break
                if self.next_seq <= seq and (upto is None or seq < upto):
                    if seq > self.next_seq:
                        self.lost += seq - self.next_seq
                        self.next_seq = seq
                    self._take(seq, frames[3], out)
        if upto is not None and self.next_seq < upto:
            self.lost += upto - self.next_seq
            self.next_seq = upto
        return out

    def _take(self, seq: int, payload: bytes, out: list) -> None:
        self.next_seq = seq + 1
        try:
            out.append((seq, self._decode(payload)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.undecodable += 1

    def close(self) -> None:
        for sock in (self.sub, self.replay_sock):
            if sock is not None:
                sock.close(linger=0)
