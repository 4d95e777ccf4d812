"""The plugin in front of the engine most of its users run: three regions of
real vLLM 0.32 (its CPU build from PyPI, installed by scripts/vllm-install,
serving a random-weight Llama over the real Llama-3 vocabulary with a
4,096-token context, prefix caching and prompt-token details on, as
docs/INSTALL.md tells operators to run it), behind envoy/envoy.yaml with
every region's `engine` set to `vllm`.

The regions sit on loopback, so their round trips are alike: what decides
is what each engine holds and how loaded it is, read from vLLM's own
`/metrics`, `/v1/models` and usage reports. Every figure the tests compare
the plugin with is the engine's own."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest

import harness
from harness import request

MODEL = harness.VLLM_MODEL
BLOCK = harness.VLLM_BLOCK
LIMIT = 4096
SEQS = 4
# The plugin as shipped (a 1 s probe tick, a 1 s timeout), with a residency
# header so that a test can send a request to a region of its choice.
PINS = {"n": ["near"], "m": ["mid"], "f": ["far"]}
SHIPPED: dict = {"residency": {"header": "x-llm-residency", "allowed": PINS}}


def stat(envoy, name: str) -> int:
    return envoy.stat("wasmcustom.llm_geo_router." + name)


def wait_stat(envoy, name: str, predicate, timeout: float = 20.0) -> int:
    return harness.until(lambda: stat(envoy, name), predicate, timeout, name)


def vllm_metrics(engine: harness.Engine) -> dict[str, float]:
    """vLLM's own /metrics: each sample by name (labels dropped, values of
    one name summed), and cache_config_info's labels under "cache_config"."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=20) as r:
        text = r.read().decode()
    out: dict = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if not m:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        if m.group(1) == "vllm:cache_config_info":
            out["cache_config"] = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
    return out


def direct(engine: harness.Engine, path: str, body: dict) -> harness.Response:
    """The same request straight to the engine, bypassing Envoy."""
    return request(engine.port, "POST", path, body, timeout=120)


@pytest.fixture(scope="module")
def vllm():
    """Three vLLM regions (SEQS sequences each, so requests wait past
    them; mid with its Responses store on, near and far without, as vLLM
    0.32 runs by default) and one Envoy, for the whole module (each engine
    takes 30-60 s to start); each test uses prompts of its own."""
    run_dir = harness.fresh_run_dir("test_vllm")
    fleet = harness.Fleet(run_dir)
    try:
        fleet.start_vllm(SHIPPED, max_model_len=LIMIT,
                         vllm={n: {"max_num_seqs": SEQS, "store": n == "mid"} for n in harness.DEMO_REGIONS})
        yield fleet
    finally:
        fleet.stop()
        for e in fleet.envoys:
            assert not harness.traps(e), harness.traps(e)


def prose(seed: str, n_bytes: int) -> str:
    """English-like text of about n_bytes, distinct per seed."""
    words = ("the harbour master keeps a ledger of every ship that enters and leaves, with its cargo, "
             "its crew and the weather it met on the way").split()
    out, i = [seed], 0
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(words[i % len(words)])
        i += 1
    return " ".join(out)[:n_bytes]


def test_the_openai_client_through_the_plugin_to_vllm(vllm):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{vllm.port}/v1", api_key="sk-demo-free", max_retries=0)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Name a colour."}])
    chat = raw.parse()
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    # vLLM 0.32 always sends the details, 0 included.
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    route = dict(kv.split("=", 1) for kv in raw.headers.get("x-llm-route", "").split("; ") if "=" in kv)
    assert route.get("region") in harness.DEMO_REGIONS, raw.headers
    comp = c.completions.create(model=MODEL, max_tokens=4, prompt="The quick brown fox")
    assert comp.choices[0].text is not None and comp.usage.prompt_tokens > 0
    chunks = list(c.chat.completions.create(
        model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to three."}]))
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1, chunks[-3:]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)
    resp = c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4)
    assert resp.id.startswith("resp_") and resp.usage.input_tokens > 0


def test_the_probe_reads_vllms_own_figures(vllm):
    for name, engine in vllm.engines.items():
        m = vllm_metrics(engine)
        cc = m["cache_config"]
        capacity = int(cc["num_gpu_blocks"]) * int(cc["block_size"])
        assert int(cc["block_size"]) == BLOCK, cc
        assert stat(vllm.envoy, f"region.{name}.kv_capacity_tokens") == capacity, (name, cc)
        assert stat(vllm.envoy, f"region.{name}.max_model_len") == LIMIT
        assert stat(vllm.envoy, f"region.{name}.healthy") == 1
        assert stat(vllm.envoy, f"region.{name}.metrics_scrape_failure") == 0, name
        assert stat(vllm.envoy, f"region.{name}.models_read_failure") == 0, name


class Saturation:
    """More long requests than the engine runs at once, straight to its
    port: vLLM then reports them in vllm:num_requests_waiting. Each
    connection sends its next request as soon as one ends, so the queue
    lasts until `close`, however fast or slow the engine (beside the busy
    load a fixed batch of three generations drained while the test waited
    out a stall, run 20). Streamed, so that `close` can hang up on them
    and vLLM aborts them at once."""

    def __init__(self, engine: harness.Engine, n: int):
        body = json.dumps({"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "stream": True,
                           "messages": [{"role": "user", "content": "Tell a very long story."}]})
        self.closed = False
        self.lock = threading.Lock()  # a request starts, or close() hangs up: never both at once
        self.conns = [http.client.HTTPConnection("127.0.0.1", engine.port, timeout=300) for _ in range(n)]
        self.threads = [threading.Thread(target=self.run, args=(c, body), daemon=True) for c in self.conns]
        for t in self.threads:
            t.start()

    def run(self, conn, body):
        while True:
            try:
                with self.lock:
                    if self.closed:
                        return
                    conn.request("POST", "/v1/chat/completions", body=body,
                                 headers={"content-type": "application/json"})
                r = conn.getresponse()
                while r.read(4096):
                    pass
            except (OSError, http.client.HTTPException, ValueError, AttributeError):
                if self.closed:
                    return  # hung up on by close()
                conn.close()
                time.sleep(0.5)  # the engine refused or dropped it: again, not a storm

    def close(self, engine):
        # vLLM aborts a stream whose client went away.
        with self.lock:
            self.closed = True
            for c in self.conns:
                if c.sock is not None:
                    try:
                        c.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        for t in self.threads:
            t.join(timeout=30)
        deadline = time.time() + 60
        while vllm_metrics(engine).get("vllm:num_requests_running", 0) > 0:
            assert time.time() < deadline, "vLLM kept running the streams it was hung up on"
            time.sleep(0.2)


def test_cold_prompts_move_off_a_region_whose_requests_wait(vllm):
    def send(tag: str, i: int) -> harness.Response:
        r = request(vllm.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"{tag} {i}: hi"}]})
        assert r.status == 200, r.body[:300]
        return r

    def routed(tag: str, i: int) -> dict | None:
        # Streamed, read to its headers only: the router's decision, without
        # waiting for a place in the queue it may have been sent to.
        conn = http.client.HTTPConnection("127.0.0.1", vllm.port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                         body=json.dumps({"model": MODEL, "max_tokens": 1, "stream": True,
                                          "messages": [{"role": "user", "content": f"{tag} {i}: hi"}]}))
            r = conn.getresponse()
            if r.status == 504:
                # Envoy's own answer when the engine stayed silent for the
                # route's per-try idle timeout (the suite's vLLM servers and
                # the busy load on two cores: run 15 saw far's vLLM silent
                # for 35 s). A stall of the engine, not the router's choice:
                # the request is not judged.
                body = json.loads(r.read())
                assert body["error"]["code"] == "upstream_per_try_idle_timeout", body
                return None
            assert r.status == 200, r.read()[:300]
            raw = r.getheader("x-llm-route", "")
        finally:
            conn.close()
        return dict(kv.split("=", 1) for kv in raw.split("; ") if "=" in kv)

    # On loopback the three regions cost nearly alike, so idle cold prompts
    # go wherever the fitted terms put a hair's breadth ahead (seen: all 12
    # to one region, and 5/6/1): the region most of them chose is loaded.
    idle: dict[str, int] = {}
    for i in range(12):
        region = send("idle", i).route["region"]
        idle[region] = idle.get(region, 0) + 1
    busy_region = max(idle, key=idle.get)
    engine = vllm.engines[busy_region]
    gauge = f"region.{busy_region}.engine_waiting"
    # Two generations' worth of waiting requests, kept up until the end.
    load = Saturation(engine, 3 * SEQS)
    judged: dict[str, int] = {}
    unjudged = []
    try:
        deadline = time.time() + 60
        while vllm_metrics(engine).get("vllm:num_requests_waiting", 0) < 2:
            assert time.time() < deadline, vllm_metrics(engine)
            time.sleep(0.2)
        # On a busy machine the probe's scrapes of a starved engine can
        # time out for a while (each is counted).
        waiting = wait_stat(vllm.envoy, gauge, lambda v: v >= 2, timeout=60)
        running = stat(vllm.envoy, f"region.{busy_region}.engine_running")
        assert running == SEQS, running
        # Each request is judged by what the router knew when it decided:
        # the queue in its gauge before and after, the engine's own queue
        # still there, and another region routable (the decision names a
        # runner-up, or is another region). A stall can make the others
        # unhealthy for a while; those requests are not judged.
        deadline = time.time() + 120
        i = 0
        while sum(judged.values()) < 12:
            assert time.time() < deadline, ("too few requests could be judged", judged, unjudged)
            before = stat(vllm.envoy, gauge)
            route = routed("loaded", i)
            i += 1
            if route is None:
                unjudged.append(("engine silent", before))
                continue
            still = vllm_metrics(engine).get("vllm:num_requests_waiting", 0)
            after = stat(vllm.envoy, gauge)
            choice = route["region"] != busy_region or "runner_up" in route
            if before >= 2 and after >= 2 and still >= 2 and choice:
                judged[route["region"]] = judged.get(route["region"], 0) + 1
            else:
                unjudged.append((route["region"], route.get("runner_up"), before, after, still))
                time.sleep(0.3)  # a probe round, not a storm of requests
    finally:
        load.close(engine)
    print("idle:", idle, "judged:", judged, "unjudged:", unjudged, "busy:", busy_region, "waiting:", waiting)
    assert busy_region not in judged, (judged, unjudged)


def test_the_context_rule_is_vllms(vllm):
    rejected = stat(vllm.envoy, "router.context_rejected")
    near = vllm.engines["near"]
    # An output above max_model_len: vLLM refuses it whatever the prompt,
    # and so does the edge, with vLLM's own body byte for byte, for each
    # endpoint and each name of the output's length.
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 4097}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5000}),
    ]:
        edge = request(vllm.port, "POST", path, body)
        engine = direct(near, path, body)
        assert (edge.status, engine.status) == (400, 400), (edge.body, engine.body)
        assert json.loads(edge.body) == json.loads(engine.body), (edge.body, engine.body)
        assert not edge.route.get("region"), edge.headers
    assert stat(vllm.envoy, "router.context_rejected") == rejected + 4
    # A prompt that fits, whatever max_tokens asks (as many as the
    # context): served, the output cut at the context.
    digits = " ".join(f"{i * 7919 % 1000000:06d}" for i in range(700))  # ~3,500 tokens by vLLM's count
    r = request(vllm.port, "POST", "/v1/completions", {"model": MODEL, "prompt": digits, "max_tokens": LIMIT,
                                                       "ignore_eos": True})
    assert r.status == 200, r.body[:300]
    u = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == LIMIT, u
    # A prompt beyond the context: the engine's to count and refuse, in
    # its words; the edge refuses nothing on its byte estimate.
    long = " ".join(f"{i * 7919 % 1000000:06d}" for i in range(1500))  # ~7,500 tokens
    r = request(vllm.port, "POST", "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": long}]})
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", "input_tokens", 400), err
    assert err["message"].startswith(f"This model's maximum context length is {LIMIT} tokens. However, your prompt "
                                     f"contains at least {LIMIT + 1} input tokens"), err
    assert r.route.get("region") in harness.DEMO_REGIONS, r.route
    assert stat(vllm.envoy, "router.context_rejected") == rejected + 4
    # Prose of the same bytes fits (about 0.2 tokens a byte, not 0.5):
    # served, wherever the digits were refused.
    r = request(vllm.port, "POST", "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": prose("fits", len(long))}]})
    assert r.status == 200, r.body[:300]


def test_responses_are_followed_only_where_vllm_keeps_them(vllm):
    # mid keeps its Responses (VLLM_ENABLE_RESPONSES_API_STORE=1), near does
    # not (vLLM 0.32's default). The probe asks each engine for the first
    # response recorded there, and the router follows a response only to
    # an engine that keeps it (issue 45, item 8).
    def create(pin: str) -> str:
        r = request(vllm.port, "POST", "/v1/responses", {"model": MODEL, "input": f"hello from {pin}",
                                                         "max_output_tokens": 4},
                    headers={"x-llm-residency": pin})
        assert r.status == 200 and r.route["region"] == PINS[pin][0], (r.status, r.route, r.body[:200])
        return r.json()["id"]

    kept, lost = create("m"), create("n")
    deadline = time.time() + 20 + harness.STALL_S
    while not all(f"region {n}: its engine {w} the Responses" in vllm.envoy.log()
                  for n, w in (("mid", "keeps"), ("near", "does not keep"))):
        assert time.time() < deadline, [l for l in vllm.envoy.log().splitlines() if "Responses" in l]
        time.sleep(0.1)
    follow = {"model": MODEL, "input": "and then?", "max_output_tokens": 4}
    r = request(vllm.port, "POST", "/v1/responses", {**follow, "previous_response_id": kept})
    assert r.status == 200 and r.route["region"] == "mid" and r.route["reason"] == "response", (r.status, r.route)
    r = request(vllm.port, "GET", f"/v1/responses/{kept}")
    assert r.status == 200 and r.json()["id"] == kept, r.body[:200]
    # near never kept its response: not pinned there; whichever engine
    # takes the follow-up answers in its own words that it does not know it.
    r = request(vllm.port, "POST", "/v1/responses", {**follow, "previous_response_id": lost})
    assert r.route.get("reason") != "response", r.route
    assert r.status == 404, r.body[:300]
    assert r.json()["error"]["message"] == f"Response with id '{lost}' not found.", r.body[:300]


def test_a_conversations_believed_cache_stays_within_one_block_of_vllms(vllm):
    # A conversation with a ~1,100-token system prompt, six turns, pinned to
    # near. Each turn the router states the tokens it believes near holds
    # (x-llm-route cached_tokens) and vLLM reports the ones it reused: in
    # whole 128-token blocks, short of the prompt's last token. Before
    # issue 45 the belief ran ahead by 29 to 129 tokens every turn.
    #
    # The belief is bytes held times the region's engine tokens per byte:
    # near's figure is first taught by prose of its own (an earlier test
    # sent it a table of digits, which takes 2.5x the tokens a byte; with
    # only that and one prose report, the median of two is their mean and
    # the belief ran 4-5 blocks ahead: see the closing note of issue 45).
    reports = stat(vllm.envoy, "usage.reports")
    for i in range(4):
        r = request(vllm.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": prose(f"teach{i}", 3000)}]},
                    headers={"x-llm-residency": "n"})
        assert r.status == 200, r.body[:200]
    wait_stat(vllm.envoy, "usage.reports", lambda v: v >= reports + 4)
    harness.wait_ticks(vllm.envoy, 2)
    messages = [{"role": "system", "content": prose("ledger-belief", 6000)}]
    gaps = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: which ship came next, and why?"})
        r = request(vllm.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 8, "messages": messages}, headers={"x-llm-residency": "n"})
        assert r.status == 200 and r.route["region"] == "near", (r.status, r.route)
        actual = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        believed = int(r.route["cached_tokens"])
        assert actual % BLOCK == 0 and believed % BLOCK == 0, (turn, believed, actual)
        gaps.append(believed - actual)
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "."})
    print("believed - reported, per turn:", gaps)
    assert gaps[0] == 0, gaps
    assert all(abs(g) <= BLOCK for g in gaps), gaps


def restart_vllm(fleet: harness.Fleet, name: str) -> harness.Engine:
    """Kill region `name`'s vLLM and start a new one on the same port, as
    a crashed pod comes back: its cache empty."""
    old = fleet.engines[name]
    old.kill()
    new = harness.launch_vllm(name, fleet.run_dir, max_model_len=LIMIT, max_num_seqs=SEQS, port=old.port)
    fleet.engines[name] = harness.wait_vllm(new)
    fleet.replicas[name] = [new]
    return new


def test_a_killed_region_loses_no_request_and_its_restart_empties_the_cache(vllm):
    # far serves a long prompt twice (the second time from its cache); its
    # engine is then killed: requests keep being answered by the others.
    # It comes back empty: the router must not believe it still holds
    # the prompt (before issue 45 it was routed `far/cache` with ~690
    # believed tokens while vLLM reported 0).
    prompt = [{"role": "system", "content": prose("restart", 6000)}, {"role": "user", "content": "Summarise."}]
    body = {"model": MODEL, "max_tokens": 4, "messages": prompt}
    # The probe has read far's /metrics (its capacity) before the kill, so
    # the restart is one it can see (run first in the module, the kill
    # came before its first good scrape of far).
    wait_stat(vllm.envoy, "region.far.kv_capacity_tokens", lambda v: v > 0, timeout=60)
    for _ in range(2):
        r = request(vllm.port, "POST", "/v1/chat/completions", body, headers={"x-llm-residency": "f"})
        assert r.status == 200 and r.route["region"] == "far", (r.status, r.route)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024, r.json()["usage"]
    assert int(r.route["cached_tokens"]) >= 1024, r.route
    restarts = stat(vllm.envoy, "region.far.engine_restart")
    vllm.engines["far"].kill()
    lost = []
    deadline = time.time() + 30
    while stat(vllm.envoy, "region.far.healthy") != 0:
        assert time.time() < deadline, "far never marked unhealthy"
        r = request(vllm.port, "POST", "/v1/chat/completions",
                    {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "still there?"}]})
        if r.status != 200:
            lost.append((r.status, r.route))
    assert not lost, lost
    restart_vllm(vllm, "far")
    wait_stat(vllm.envoy, "region.far.healthy", lambda v: v == 1, timeout=30)
    # The restart is read at the first good scrape of its /metrics. A
    # freshly started vLLM beside two others on two busy cores can answer
    # /health and still miss the probe's 1 s scrape timeout for a while
    # (CI saw it stay unread 30 s after far was healthy again).
    failed = stat(vllm.envoy, "region.far.metrics_scrape_failure")
    try:
        wait_stat(vllm.envoy, "region.far.engine_restart", lambda v: v > restarts, timeout=120)
    except AssertionError as e:
        raise AssertionError(f"{e}; far's scrapes failed {stat(vllm.envoy, 'region.far.metrics_scrape_failure') - failed} "
                             f"times since it was healthy again") from e
    r = request(vllm.port, "POST", "/v1/chat/completions", body, headers={"x-llm-residency": "f"})
    assert r.status == 200 and r.route["region"] == "far", (r.status, r.route)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.json()["usage"]
    assert int(r.route["cached_tokens"]) == 0 and r.route["reason"] != "cache", r.route


def test_usage_is_read_wherever_vllm_puts_it(vllm):
    # Asked for prompt logprobs and token ids, vLLM writes `usage` before
    # them: with a ~1,100-token prompt, ~300 KB follow it. The router
    # still reads the usage (issue 45, item 6: it read the last 4 KiB).
    reports = stat(vllm.envoy, "usage.reports")
    missing = stat(vllm.envoy, "router.usage_missing")
    r = request(vllm.port, "POST", "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 5, "return_token_ids": True,
                 "messages": [{"role": "user", "content": prose("logprobs", 6000)}]}, timeout=120)
    assert r.status == 200, r.body[:300]
    body = r.body.decode()
    assert len(body) - body.index('"usage"') > 100_000, len(body)
    wait_stat(vllm.envoy, "usage.reports", lambda v: v > reports)
    assert stat(vllm.envoy, "router.usage_missing") == missing
