"""The plugin in front of an engine nobody here wrote: three regions of
llama.cpp's real `llama-server` (built from the pinned PyPI sdist's source by
scripts/llama-server-build, serving a tiny random-weight model over the real
Llama-3 vocabulary, 4 slots of 4096 tokens each), behind the demo's Envoy
configuration with every region's `engine` set to `llamacpp`.

The regions sit on loopback, so their round trips are alike: what decides is
what each engine holds and how loaded it is, read from llama.cpp's own
`/metrics`, `/v1/models` and usage reports."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request

import openai
import pytest

import harness
from harness import request

FAST = {"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}}
MODEL = harness.LLAMA_MODEL
SLOTS = 4


def stat(envoy, name: str) -> int:
    return envoy.stat("wasmcustom.llm_geo_router." + name)


def wait_stat(envoy, name: str, predicate, timeout: float = 15.0) -> int:
    return harness.until(lambda: stat(envoy, name), predicate, timeout, name)


def engine_metrics(engine: harness.Engine) -> dict[str, float]:
    """The llamacpp: samples of a llama-server's own /metrics."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(llamacpp:[a-z_]+) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class LlamaFleet(harness.Fleet):
    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="sk-demo-free", max_retries=0)


@pytest.fixture(scope="module")
def llama():
    """Three llama-server regions and one Envoy, for the whole module (the
    engines take seconds to start); each test uses prompts of its own."""
    run_dir = harness.fresh_run_dir("test_llamacpp")
    fleet = LlamaFleet(run_dir)
    try:
        fleet.start_llama(FAST, slots=SLOTS)
        yield fleet
    finally:
        fleet.stop()
        for e in fleet.envoys:
            assert not harness.traps(e), harness.traps(e)


def route(headers) -> dict:
    return dict(kv.split("=", 1) for kv in headers.get("x-llm-route", "").split("; ") if "=" in kv)


def prose(seed: str, n_bytes: int) -> str:
    """English-like text of about n_bytes (about 0.19 tokens a byte in the
    Llama-3 vocabulary), distinct per seed."""
    words = ("the harbour master keeps a ledger of every ship that enters and leaves, with its cargo, "
             "its crew and the weather it met on the way").split()
    out, i = [seed], 0
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(words[i % len(words)])
        i += 1
    return " ".join(out)[:n_bytes]


def test_the_openai_client_through_the_plugin_to_llama_server(llama):
    c = llama.client
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Name a colour."}])
    chat = raw.parse()
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens_details.cached_tokens is not None
    assert route(raw.headers).get("region") in harness.DEMO_REGIONS, raw.headers
    comp = c.completions.create(model=MODEL, max_tokens=4, prompt="The quick brown fox")
    assert comp.choices[0].text is not None and comp.usage.prompt_tokens > 0
    chunks = list(c.chat.completions.create(
        model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to three."}]))
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1, chunks[-3:]
    assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)


def test_a_conversation_stays_on_the_region_holding_its_prefix(llama):
    # A ~1,100-token system prompt: its first turn goes wherever nothing
    # cached decides; every next turn goes back there for its cache, and the
    # engine confirms the tokens it reused.
    messages = [{"role": "system", "content": prose("ledger", 6000)},
                {"role": "user", "content": "Which ship came first?"}]
    first = request(llama.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 4, "messages": messages})
    assert first.status == 200, first.body[:300]
    home = first.route["region"]
    for turn in range(3):
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"] or "."},
                     {"role": "user", "content": f"And after that, question {turn}?"}]
        r = request(llama.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 4, "messages": messages})
        assert r.status == 200, r.body[:300]
        assert r.route["region"] == home and r.route["reason"] == "cache", (home, r.route)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 1000, (cached, r.json()["usage"])


class Saturation:
    """More long requests than the engine has slots, straight to its port:
    llama-server then reports them as llamacpp:requests_deferred."""

    def __init__(self, engine: harness.Engine, n: int):
        body = json.dumps({"model": MODEL, "max_tokens": 3000, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "Tell a very long story."}]})
        self.conns = [http.client.HTTPConnection("127.0.0.1", engine.port, timeout=120) for _ in range(n)]

        def run(conn):
            try:
                conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                pass  # closed below

        self.threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in self.conns]
        for t in self.threads:
            t.start()

    def close(self):
        for c in self.conns:
            if c.sock is not None:
                try:
                    c.sock.shutdown(2)
                except OSError:
                    pass
        for t in self.threads:
            t.join(timeout=10)


def test_load_moves_away_from_a_region_whose_engine_defers_requests(llama):
    # Idle, short cold prompts all go to the region the cost prefers (the
    # regions are equally near; a prompt shorter than a block ties on the
    # same key); with that region's slots full and requests deferred
    # behind them, none goes there, and the probe shows the engine's own
    # figures.
    def regions_of(tag: str, n: int) -> list[str]:
        """The region each of n short cold prompts went to, in order."""
        seq = []
        for i in range(n):
            r = request(llama.port, "POST", "/v1/chat/completions",
                        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"{tag} {i}: hi"}]})
            assert r.status == 200, r.body[:300]
            seq.append(r.route["region"])
        return seq

    def count(seq: list[str]) -> dict[str, int]:
        return {region: seq.count(region) for region in dict.fromkeys(seq)}

    idle_seq = regions_of("idle", 24)
    idle = count(idle_seq)
    busy_region = max(idle, key=idle.get)
    engine = llama.engines[busy_region]
    load = Saturation(engine, SLOTS + 4)
    try:
        deadline = time.time() + 20 + harness.STALL_S
        while engine_metrics(engine).get("llamacpp:requests_deferred", 0) < 2:
            assert time.time() < deadline, engine_metrics(engine)
            time.sleep(0.1)
        waiting = wait_stat(llama.envoy, f"region.{busy_region}.engine_waiting", lambda v: v >= 2)
        running = stat(llama.envoy, f"region.{busy_region}.engine_running")
        assert running == SLOTS, running
        loaded = count(regions_of("loaded", 24))
    finally:
        load.close()
    print("idle:", idle_seq, "loaded:", loaded, "busy:", busy_region, "waiting:", waiting)
    # Idle, the cost sends the short cold prompts to one region (equal
    # round trips; the rendezvous tie-break on a shared key), not a spread:
    # one region at a time, in one run of requests, or two if a probe round
    # reorders the near-alike round trips once during the run. So the busy
    # region took every idle prompt but those after (or before) one switch,
    # and at least half of them. A spread (8/8/8, or two regions taking
    # turns) switches at every few requests.
    switches = [i for i in range(1, len(idle_seq)) if idle_seq[i] != idle_seq[i - 1]]
    assert len(switches) <= 1, ("idle prompts spread, not concentrated", switches, idle_seq)
    assert idle[busy_region] >= len(idle_seq) // 2, idle
    assert busy_region not in loaded, loaded


def test_a_prompt_the_engine_refused_is_never_believed_cached(llama):
    # Six-digit numbers take about 0.4 tokens a byte in the Llama-3
    # vocabulary, twice what the router calibrated on prose: its estimate
    # lets this ~14 KB prompt through, and llama-server, counting ~6,000
    # tokens against its 4,096, refuses it itself. The router must not
    # then believe that region holds the prompt: the same prompt again is
    # no `cache` decision, however often it is sent.
    text = " ".join(f"{i * 7919 % 1000000:06d}" for i in range(2000))
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    for attempt in range(3):
        r = request(llama.port, "POST", "/v1/chat/completions", body)
        assert r.status == 400, (attempt, r.status, r.body[:300])
        err = r.json()["error"]
        # The engine's own refusal (it states the prompt's real length), not the edge's.
        assert err["type"] == "exceed_context_size_error" and err.get("n_prompt_tokens", 0) > 4096, err
        assert r.route.get("reason") != "cache" and r.route.get("cached_tokens", "0") == "0", (attempt, r.route)


def test_an_over_context_prompt_is_the_engines_to_refuse(llama):
    # llama-server's /v1/models states each slot's context (meta.n_ctx):
    # the probe reads it. A prompt far beyond it by the router's estimate
    # is still the engine's to judge (only the engine counts its tokens):
    # one engine refuses it, in its own words, and the edge refuses
    # nothing (issue 45, item 2).
    for n in harness.DEMO_REGIONS:
        assert stat(llama.envoy, f"region.{n}.max_model_len") == 4096
    rejected = stat(llama.envoy, "router.context_rejected")
    r = request(llama.port, "POST", "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": prose("long", 60000)}]})
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] > 4096, err
    assert r.route.get("region") in harness.DEMO_REGIONS, r.route
    assert stat(llama.envoy, "router.context_rejected") == rejected
    # Nor any max_tokens: llama-server stops when the slot is full.
    r = request(llama.port, "POST", "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200, r.body[:300]
    assert stat(llama.envoy, "router.context_rejected") == rejected
