"""vLLM's KV-cache events as JSON lines: a ZMQ SUB socket per region, each
bound on a loopback port the engine's publisher connects to (its endpoint
`tcp://127.0.0.1:<port>`: an endpoint without `*` is one vLLM's publisher
connects to, so no port is picked before the engine needs it and none is
opened beyond loopback).

Run by the vLLM venv's python (it has pyzmq and msgspec; the test's venv
has neither): `python kv_events_subscriber.py near mid far`. It prints one
line `{"ports": {"near": p, ...}}` once bound, then one line per batch the
engines publish, in the order received:

    {"region": "near", "seq": 7, "events": [
        {"type": "BlockStored", "block_hashes": ["<hex>", ...],
         "parent_block_hash": "<hex>" | null, "token_ids": [...], "block_size": 128},
        {"type": "BlockRemoved", "block_hashes": ["<hex>", ...]},
        {"type": "AllBlocksCleared"}]}

The payload is vLLM 0.32's KVEventBatch (vllm/distributed/kv_events.py):
an array [ts, events, data_parallel_rank], each event a map tagged by
`type` (its class name). Decoded untyped, so that this script does not
import vLLM. A block hash (bytes, or an int in older builds) is written as
hex, or as the int's decimal text.
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq


def hash_text(h) -> str | None:
    if h is None:
        return None
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    return str(h)


def event_json(e) -> dict:
    if isinstance(e, dict):
        kind = e.get("type")
        fields = e
    else:  # an array-like event: [tag, fields...] (not how 0.32 sends them)
        kind, fields = e[0], {}
    out = {"type": kind}
    if kind == "BlockStored":
        out.update(block_hashes=[hash_text(h) for h in fields["block_hashes"]],
                   parent_block_hash=hash_text(fields.get("parent_block_hash")),
                   token_ids=list(fields["token_ids"]), block_size=fields["block_size"],
                   medium=fields.get("medium"), group_idx=fields.get("group_idx"))
    elif kind == "BlockRemoved":
        out.update(block_hashes=[hash_text(h) for h in fields["block_hashes"]],
                   medium=fields.get("medium"), group_idx=fields.get("group_idx"))
    return out


def main(regions: list[str]) -> None:
    ctx = zmq.Context()
    socks = {}
    ports = {}
    poller = zmq.Poller()
    for r in regions:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVHWM, 0)
        ports[r] = s.bind_to_random_port("tcp://127.0.0.1")
        socks[s] = r
        poller.register(s, zmq.POLLIN)
    out = sys.stdout
    out.write(json.dumps({"ports": ports}) + "\n")
    out.flush()
    decode = msgspec.msgpack.Decoder().decode
    while True:
        for s, _ in poller.poll():
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _topic, seq, payload = frames
                batch = decode(payload)
                events = batch[1] if isinstance(batch, list) else batch["events"]
                out.write(json.dumps({"region": socks[s], "seq": int.from_bytes(seq, "big", signed=True),
                                      "events": [event_json(e) for e in events]}) + "\n")
            out.flush()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (KeyboardInterrupt, BrokenPipeError):
        pass
