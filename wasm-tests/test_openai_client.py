"""The demo as a new user drives it: the official `openai` Python package
(sync and async, streaming and not) against the demo Envoy in front of three
emulated regions. Chat and completions; a six-turn Responses API
conversation chained by `previous_response_id` while regions change health
(every turn answered by the region that stores the conversation, or a clear
503 while that region answers that it is down, and still answered there
while its probes only go unanswered); embeddings and the model list while the
default region is unhealthy; and the client's own retry of a 429 with
`Retry-After` from the guard. Probe tick 300 ms."""

import asyncio
import re
import threading
import time

import openai
import pytest

from harness import request
from test_ladder import OPERATOR
from test_routing import wait_stat

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}


def client(fleet, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.port}/v1", api_key="sk-demo-free", **kw)


def aclient(fleet, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{fleet.port}/v1", api_key="sk-demo-free", **kw)


def route(raw) -> dict:
    """The decision header of a raw response, as a dict."""
    return dict(kv.split("=", 1) for kv in raw.headers.get("x-llm-route", "").split("; ") if "=" in kv)


def served_by(raw) -> str:
    """The region whose engine answered: the emulator names itself on
    completions (a region's replicas are <region>-<n>); embeddings and
    model lists name no replica, and x-llm-cluster is no longer forwarded
    for the engine to echo, so for those the router's decision says."""
    replica = raw.headers.get("x-engine-replica")
    if replica is None:
        assert raw.headers["x-echo-x-llm-cluster"] == "-"  # an engine answered
        return route(raw)["region"]
    return re.sub(r"-\d+$", "", replica)


def set_health(fleet, name: str, healthy: bool) -> None:
    fleet.engines[name].set_state(healthy=healthy)
    wait_stat(fleet.envoy, f"region.{name}.healthy", lambda v: v == int(healthy))


def test_chat_and_completions_sync_async_streaming(fleet_factory):
    fleet = fleet_factory(FAST)
    c = client(fleet)
    raw = c.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "hello from the openai client"}], max_tokens=8)
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0
    assert raw.headers["x-engine-replica"] == "near" and route(raw)["reason"] in ("rtt", "cache")

    chunks = list(c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "stream please"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    comp = c.completions.create(model="demo", prompt="Once upon a time", max_tokens=5)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5

    async def run():
        a = aclient(fleet)
        r = await a.chat.completions.create(model="demo", messages=[{"role": "user", "content": "async"}],
                                            max_tokens=4)
        text = ""
        stream = await a.completions.create(model="demo", prompt="async stream", max_tokens=6, stream=True)
        async for ch in stream:
            text += ch.choices[0].text if ch.choices else ""
        await a.close()
        return r, text

    r, text = asyncio.run(run())
    assert r.choices[0].message.content and text
    # Every one of them was read and routed by the router, none passed through.
    assert fleet.envoy.stat("wasmcustom.llm_geo_router.router.passthrough") == 0


def test_responses_conversation_follows_its_region_through_health_changes(fleet_factory):
    fleet = fleet_factory(FAST)
    envoy = fleet.envoy
    c = client(fleet, max_retries=0)
    # Short instructions and short follow-ups: nothing the router hashes
    # holds a full block, so only the stored response keeps the
    # conversation in mid (the engine's own prompt, which includes the
    # stored turns, is long and cached there).
    instructions = "You are the demo assistant."
    opening = "Turn 1: tell me about Envoy. " + "Here is some context about proxies. " * 60
    # Turn 1 while near is down: the conversation is stored in mid.
    set_health(fleet, "near", False)
    raw = c.responses.with_raw_response.create(model="demo", instructions=instructions,
                                               input=opening, max_output_tokens=16)
    first = raw.parse()
    holder = raw.headers["x-engine-replica"]
    assert holder == "mid", raw.headers
    assert first.id and first.output_text
    wait_stat(envoy, "router.responses_recorded", lambda v: v == 1)
    # near is back and cheaper: turns 2 and 3 (one of them streamed) still go
    # to mid, where the conversation is, whatever the other regions do.
    set_health(fleet, "near", True)
    set_health(fleet, "far", False)
    # Clients send the instructions with every turn: vLLM does not carry
    # them over from the stored response (it puts them first in the prompt).
    raw = c.responses.with_raw_response.create(model="demo", instructions=instructions, input="Turn 2.",
                                               previous_response_id=first.id, max_output_tokens=16)
    second = raw.parse()
    assert raw.headers["x-engine-replica"] == holder and route(raw)["reason"] == "response"
    assert second.previous_response_id == first.id
    # The engine prefilled the stored conversation from its cache.
    assert second.usage.input_tokens_details.cached_tokens > 0
    set_health(fleet, "far", True)
    events = list(c.responses.create(model="demo", instructions=instructions, input="Turn 3, streamed.",
                                     previous_response_id=second.id, max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    third = events[-1].response
    assert third.output_text
    wait_stat(envoy, "router.responses_recorded", lambda v: v == 3)
    # The stored response can be read back: from mid, the only engine with it.
    raw = c.responses.with_raw_response.retrieve(third.id)
    assert raw.parse().id == third.id and raw.headers["x-engine-replica"] == holder
    # Turn 4 while mid is down: a clear error, never a silent reroute to an
    # engine that does not have the conversation.
    set_health(fleet, holder, False)
    with pytest.raises(openai.APIStatusError) as err:
        c.responses.create(model="demo", instructions=instructions, input="Turn 4.",
                           previous_response_id=third.id, max_output_tokens=16)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "response_region_unavailable"
    assert holder in err.value.body["message"]
    assert envoy.stat("wasmcustom.llm_geo_router.router.response_holder_unavailable") == 1
    # mid is back: turns 4 and 5 are answered there.
    set_health(fleet, holder, True)
    prev = third.id
    for turn in (4, 5):
        raw = c.responses.with_raw_response.create(model="demo", instructions=instructions, input=f"Turn {turn}.",
                                                   previous_response_id=prev, max_output_tokens=16)
        resp = raw.parse()
        assert raw.headers["x-engine-replica"] == holder and resp.output_text
        prev = resp.id
    # mid's probes go unanswered (a busy engine looks the same): mid is out
    # of routing for new work, but turn 6 still goes there, the one place
    # that can answer it; and no second 503 is counted.
    fleet.engines[holder].set_state(hang_probes=True)
    wait_stat(envoy, f"region.{holder}.healthy", lambda v: v == 0)
    raw = c.responses.with_raw_response.create(model="demo", instructions=instructions, input="Turn 6.",
                                               previous_response_id=prev, max_output_tokens=16)
    assert raw.headers["x-engine-replica"] == holder and route(raw)["reason"] == "response", raw.headers
    assert raw.parse().output_text
    assert envoy.stat("wasmcustom.llm_geo_router.router.response_holder_unavailable") == 1
    fleet.engines[holder].set_state(hang_probes=False)
    assert envoy.stat("wasmcustom.llm_geo_router.router.response_unknown") == 0


def test_embeddings_and_models_avoid_the_unhealthy_default_region(fleet_factory):
    fleet = fleet_factory({**FAST, "default_region": "near"})
    c = client(fleet)
    raw = c.embeddings.with_raw_response.create(model="demo", input=["one", "two"])
    assert served_by(raw) == "near" and route(raw)["reason"] == "default"
    assert len(raw.parse().data) == 2
    set_health(fleet, "near", False)
    for _ in range(5):
        raw = c.embeddings.with_raw_response.create(model="demo", input="while near is down")
        assert served_by(raw) != "near", raw.headers
        assert raw.parse().data[0].embedding
        raw = c.models.with_raw_response.list()
        assert served_by(raw) != "near", raw.headers
        assert [m.id for m in raw.parse().data]


def test_the_client_retries_a_shed_request_after_retry_after(fleet_factory):
    fleet = fleet_factory({**FAST, "ladder": {"retry_after_s": [1, 1]}})
    envoy = fleet.envoy
    path = "/llm-geo-router/ladder"
    assert request(fleet.port, "POST", path, {"level": 5}, headers=OPERATOR).status == 200
    wait_stat(envoy, "ladder.level", lambda v: v == 5)
    # Without retries the client sees the 429 and its Retry-After.
    with pytest.raises(openai.RateLimitError) as err:
        client(fleet, max_retries=0).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "shed me"}], max_tokens=4)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["code"] == "degraded_mode_shed"
    shed = envoy.stat("wasmcustom.llm_geo_router.guard.tier.free.shed")
    assert shed == 1, shed

    # With its retries, it waits the Retry-After and tries again; the
    # operator holds level 0 meanwhile (clearing the override would step the
    # level down one dwell at a time), once the guard has shed the client's
    # first try (not after a guess at how long that takes), and the retry is
    # answered.
    lift_failed = []

    def lift():
        try:
            wait_stat(envoy, "guard.tier.free.shed", lambda v: v == shed + 1)
            request(fleet.port, "POST", path, {"level": 0}, headers=OPERATOR)
            wait_stat(envoy, "ladder.level", lambda v: v == 0)
        except BaseException as e:  # re-raised below, where pytest sees it
            lift_failed.append(e)

    t = threading.Thread(target=lift)
    started = time.time()
    t.start()
    try:
        reply = client(fleet, max_retries=3).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "retry me"}], max_tokens=4)
    finally:
        t.join()
        if lift_failed:
            raise lift_failed[0]
    assert reply.choices[0].message.content
    assert time.time() - started >= 0.9  # it waited the Retry-After
    # Shed once, then answered: the retry came after the operator's level 0.
    assert envoy.stat("wasmcustom.llm_geo_router.guard.tier.free.shed") == shed + 1
