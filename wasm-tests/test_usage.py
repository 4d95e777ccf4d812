"""What the engines report, read by the router in a real Envoy: `usage` at
the end of a JSON answer and in a stream's final chunk, never changing what
the client receives; a stream that does not ask for usage is not read (with
`directory.stream_usage: always`, one that ends without it is counted);
the probe calibrates tokens per byte from it. Probe tick 300 ms."""

import json

import harness
from harness import chat, filler
from test_brain import FAST_PROBE
from test_routing import wait_stat


def stat(envoy, name):
    return envoy.stat(f"wasmcustom.llm_geo_router.{name}")


def sse_events(body: bytes) -> list:
    return [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def comparable(answer: dict) -> dict:
    """An answer (or a stream's chunk) less what differs between two sends
    of one request to the same engine: its id, its time and the cached
    tokens it found."""
    out = {k: v for k, v in answer.items() if k not in ("id", "created")}
    if out.get("usage"):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def comparable_events(body: bytes) -> list:
    return [e if e == b"data: [DONE]" else comparable(json.loads(e[len(b"data: "):])) for e in sse_events(body)]


def engines_own(engine: harness.Engine, msgs: list, **fields) -> harness.Response:
    """The engine's answer to the same request sent to it straight, not
    through Envoy: what it sent to the router for the client (the emulator
    answers a request alike every time but for comparable's fields)."""
    r = chat(engine.port, msgs, **fields)
    assert r.status == 200, r.body[:300]
    return r


def test_usage_is_read_at_the_end_of_each_answer_and_the_answer_is_unchanged(fleet_factory):
    fleet = fleet_factory({"probe": FAST_PROBE})
    envoy = fleet.envoy
    assert stat(envoy, "region.near.tokens_per_kib") == 256  # 1024 / the configured 4 bytes a token
    msgs = [{"role": "user", "content": filler("usage-1", 3000)}]

    # Non-streamed: the usage closes the JSON body.
    r = chat(fleet.port, msgs)
    assert r.status == 200 and r.replica == "near"
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    # The client receives the engine's answer as the engine sent it.
    assert comparable(r.json()) == comparable(engines_own(fleet.engines["near"], msgs).json())
    wait_stat(envoy, "usage.reports", lambda v: v == 1)
    # The engines count about 2 bytes a token on this text (their own BPE
    # over their own chat template); the router now prices prompts so.
    tpk = wait_stat(envoy, "region.near.tokens_per_kib", lambda v: v != 256)
    assert abs(tpk - prompt_tokens * 1024 / 3000) <= 0.1 * tpk, (tpk, prompt_tokens)

    # A stream that asks for usage: the last event before [DONE] carries it,
    # and the client receives it, and every token chunk, as the engine sent.
    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    msgs.append({"role": "user", "content": "and then?"})
    stream = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 20}
    r = chat(fleet.port, msgs, **stream)
    assert r.status == 200 and r.replica == "near"
    events = sse_events(r.body)
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > prompt_tokens
    # Every chunk is there: the role's, one per token (20), the usage's and
    # [DONE], each as the engine sent it, and the text is the engine's.
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(chunks) == 1 + 20 and last["usage"]["completion_tokens"] == 20, [c["choices"] for c in chunks]
    own = engines_own(fleet.engines["near"], msgs, **stream)
    own_text = "".join(json.loads(e[len(b"data: "):])["choices"][0]["delta"].get("content") or ""
                       for e in sse_events(own.body)[:-2])
    assert text == own_text, (text, own_text)
    assert comparable_events(r.body) == comparable_events(own.body)
    wait_stat(envoy, "usage.reports", lambda v: v == 2)
    # The second turn was served from the first's cache, and the engine said so.
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stat(envoy, "router.usage_missing") == 0

    # A stream that does not ask carries no usage: not read at all (every
    # chunk read is a host call), so neither missing nor reported.
    answered = stat(envoy, "region.near.upstream_rq_answered")
    r = chat(fleet.port, msgs, stream=True, max_tokens=20)
    assert r.status == 200 and r.replica == "near" and sse_events(r.body)[-1] == b"data: [DONE]"
    assert b'"usage":{' not in r.body
    # The router is done with the stream once it has counted its outcome
    # (after the body's end, where a usage is read or counted missing); a
    # report it had queued would be counted by the probe within two rounds.
    wait_stat(envoy, "region.near.upstream_rq_answered", lambda v: v == answered + 1)
    harness.wait_ticks(envoy, 2)
    assert stat(envoy, "router.usage_missing") == 0
    assert stat(envoy, "usage.reports") == 2

    # A refused request (400) reports nothing either way.
    r = chat(fleet.port, msgs, max_tokens=-1)
    assert r.status == 400
    assert stat(envoy, "router.usage_missing") == 0 and stat(envoy, "usage.reports") == 2


def test_with_stream_usage_always_a_stream_without_usage_is_counted_missing(fleet_factory):
    # The operator says the engines force usage into every stream; one that
    # ends without it (an engine not so configured) is counted, never guessed.
    fleet = fleet_factory({"probe": FAST_PROBE, "directory": {"stream_usage": "always"}})
    envoy = fleet.envoy
    msgs = [{"role": "user", "content": filler("usage-always", 400)}]
    r = chat(fleet.port, msgs, stream=True, max_tokens=10)
    assert r.status == 200 and b'"usage":{' not in r.body
    wait_stat(envoy, "router.usage_missing", lambda v: v == 1)
    assert stat(envoy, "usage.reports") == 0
