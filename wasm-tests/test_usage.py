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


def test_usage_is_read_at_the_end_of_each_answer_and_the_answer_is_unchanged(fleet_factory):
    fleet = fleet_factory({"probe": FAST_PROBE})
    envoy = fleet.envoy
    assert stat(envoy, "region.near.tokens_per_kib") == 256  # 1024 / the configured 4 bytes a token
    msgs = [{"role": "user", "content": filler("usage-1", 3000)}]

    # Non-streamed: the usage closes the JSON body.
    r = chat(fleet.port, msgs)
    assert r.status == 200 and r.replica == "near"
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    wait_stat(envoy, "usage.reports", lambda v: v == 1)
    # The engines count about 2 bytes a token on this text (their own BPE
    # over their own chat template); the router now prices prompts so.
    tpk = wait_stat(envoy, "region.near.tokens_per_kib", lambda v: v != 256)
    assert abs(tpk - prompt_tokens * 1024 / 3000) <= 0.1 * tpk, (tpk, prompt_tokens)

    # A stream that asks for usage: the last event before [DONE] carries it,
    # and the client receives it, and every token chunk, as the engine sent.
    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    msgs.append({"role": "user", "content": "and then?"})
    r = chat(fleet.port, msgs, stream=True, stream_options={"include_usage": True}, max_tokens=20)
    assert r.status == 200
    events = sse_events(r.body)
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > prompt_tokens
    assert len(events) >= 20  # the token chunks are all there
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
