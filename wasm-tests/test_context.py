"""Context limits at the edge, in a real Envoy: the probe reads each
region's `max_model_len` from its engine's /v1/models; the router prefers
the regions a prompt likely fits (its byte estimate), and answers 400
itself, as the engine would, only for what every allowed region's engine
is sure to refuse whatever the prompt: an output asked for above the
limit. A prompt's length is the engine's to judge. Regions: near (vLLM,
4096 tokens), mid (vLLM, 12288), far (SGLang, 16384). The plugin
estimates 4 bytes per token with a 10 % margin; the emulators' real
tokenizer counts about 2.4 bytes per token of this filler. Probe tick
300 ms. (Real vLLM 0.32's rule, which the emulator copies, is checked in
test_vllm.py.)"""

import pytest

from harness import chat, filler, request, wait_ticks
from test_routing import wait_stat

LIMITS = {"near": 4096, "mid": 12288, "far": 16384}


@pytest.fixture(scope="module")
def fleet():
    import harness

    f = harness.Fleet(harness.fresh_run_dir("test_context"))
    try:
        f.start({"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}},
                engine_extra={n: ["--max-model-len", str(v)] for n, v in LIMITS.items()})
        for name, limit in LIMITS.items():
            wait_stat(f.envoy, f"region.{name}.max_model_len", lambda v, limit=limit: v == limit)
        yield f
    except Exception:
        f.stop()
        raise
    f.stop()


def inference_counts(fleet) -> dict[str, int]:
    return {n: e.stats()["requests"].get("/v1/chat/completions", 0) + e.stats()["requests"].get("/v1/completions", 0)
            for n, e in fleet.engines.items()}


def test_the_limits_are_read_at_start_not_every_tick(fleet):
    wait_ticks(fleet.envoy, 6)
    for name, engine in fleet.engines.items():
        # Read once at start; the next read is due after context.refresh_ticks (60).
        assert engine.stats()["requests"]["/v1/models"] == 1, name
        assert fleet.envoy.stat(f"wasmcustom.llm_geo_router.region.{name}.models_read_failure") == 0
    assert any("region near: context limit 4096 tokens (max_model_len in /v1/models)" in l
               for l in fleet.envoy.log().splitlines())


def test_a_prompt_too_long_for_the_nearest_region_goes_where_it_fits(fleet):
    # ~20 KB: the plugin estimates 5,002 tokens (4,501 after the margin), over
    # near's 4,096; the engines count about 8,300, within mid's 12,288.
    r = chat(fleet.port, [{"role": "user", "content": filler("ctx-long", 20_000)}])
    assert r.status == 200, r.body
    assert r.replica == "mid", r.headers
    assert r.route["reason"] == "context", r.route
    assert int(r.json()["usage"]["prompt_tokens"]) > LIMITS["near"]


def test_a_normal_prompt_is_unaffected(fleet):
    r = chat(fleet.port, [{"role": "user", "content": filler("ctx-short", 2_000)}])
    assert r.status == 200, r.body
    assert r.replica == "near" and r.route["reason"] == "rtt", r.route


def test_a_prompt_beyond_every_region_goes_to_the_largest_limit_and_its_engine_answers(fleet):
    before = inference_counts(fleet)
    rejected = fleet.envoy.stat("wasmcustom.llm_geo_router.router.context_rejected")
    # ~80 KB: 20,002 estimated tokens, over every limit by the estimate; far
    # (16,384, the largest) takes it and SGLang refuses it in its words.
    r = chat(fleet.port, [{"role": "user", "content": filler("ctx-huge", 80_000)}])
    assert r.status == 400, r.body
    assert r.route["region"] == "far" and r.route["reason"] == "context", (r.headers, r.route)
    assert r.json()["message"].startswith("The input ("), r.body
    assert r.json()["message"].endswith("is longer than the model's context length (16384 tokens)."), r.body
    after = inference_counts(fleet)
    assert after["far"] == before["far"] + 1, (before, after)
    assert fleet.envoy.stat("wasmcustom.llm_geo_router.router.context_rejected") == rejected


def test_an_output_above_every_limit_is_refused_at_the_edge_as_the_engine_would(fleet):
    before = inference_counts(fleet)
    rejected = fleet.envoy.stat("wasmcustom.llm_geo_router.router.context_rejected")
    # 20,000 tokens asked for: vLLM refuses any max_tokens above its
    # max_model_len, SGLang any from its whole context on, whatever the
    # prompt. Named after the largest limit's engine: far's SGLang.
    r = chat(fleet.port, [{"role": "user", "content": "hi"}], max_tokens=20_000)
    assert r.status == 400, r.body
    err = r.json()  # SGLang's flat error body
    assert (err["object"], err["code"], err["type"], err["param"]) == ("error", 400, "BadRequestError", None), err
    assert err["message"].startswith("Requested token count exceeds the model's maximum context length of 16384 "
                                     "tokens."), err
    # vLLM 0.32 serves a prompt that fits whatever it asks for, cut at the
    # context: 12,000 with ~8,300 prompt tokens goes to mid (far, SGLang,
    # counts the output), which answers 200 with finish_reason "length".
    r = chat(fleet.port, [{"role": "user", "content": filler("ctx-out", 20_000)}], max_tokens=12_000)
    assert r.status == 200, r.body
    assert r.replica == "mid", r.headers
    assert r.json()["choices"][0]["finish_reason"] == "length", r.body
    u = r.json()["usage"]
    # Cut at the context (the emulator also caps an answer at 4,096 tokens,
    # to keep a test from holding a slot: real vLLM's exact cut is checked in
    # test_vllm.py).
    assert u["prompt_tokens"] + u["completion_tokens"] <= LIMITS["mid"] and u["completion_tokens"] < 12_000, u
    after = inference_counts(fleet)
    assert after["mid"] == before["mid"] + 1 and after["far"] == before["far"], (before, after)
    assert fleet.envoy.stat("wasmcustom.llm_geo_router.router.context_rejected") == rejected + 1


def test_a_residency_pin_keeps_a_long_prompt_where_it_is_pinned(fleet_factory):
    fleet = fleet_factory({"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000},
                           "residency": {"header": "x-llm-residency", "allowed": {"here": ["near"]}}},
                          engine_extra={"near": ["--max-model-len", "4096"]})
    wait_stat(fleet.envoy, "region.near.max_model_len", lambda v: v == 4096)
    long = [{"role": "user", "content": filler("ctx-pin", 20_000)}]
    # Pinned to near, whose 4,096 tokens the estimate says it exceeds: the
    # pin holds, and near's engine refuses it in its own words.
    r = chat(fleet.port, long, headers={"x-llm-residency": "here"})
    assert r.status == 400 and r.route["region"] == "near", (r.status, r.route)
    assert r.json()["error"]["message"].startswith("This model's maximum context length is 4096 tokens."), r.body
    # Unpinned, it goes where it fits.
    r = chat(fleet.port, long)
    assert r.status == 200 and r.replica == "mid", r.headers


def test_a_region_whose_engine_does_not_list_the_model_is_passed_over(fleet_factory):
    """The model lists are read as the limits are: a request naming a LoRA
    adapter only mid serves goes to mid, not to the nearer region whose
    engine would answer 404; a model nobody lists is the engines' to
    refuse (nothing is excluded then)."""
    strict = ["--check-model"]
    fleet = fleet_factory({"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}},
                          engine_extra={"near": strict, "mid": strict + ["--lora-modules", "sql-lora=/adapters/sql"],
                                        "far": strict})
    wait_stat(fleet.envoy, "region.mid.max_model_len", lambda v: v > 0)
    assert any("region mid: 2 model(s) listed in /v1/models" in l for l in fleet.envoy.log().splitlines())
    msgs = [{"role": "user", "content": "which tables hold the orders?"}]
    r = chat(fleet.port, msgs, model="sql-lora")
    assert r.status == 200 and r.replica == "mid", (r.status, r.body, r.headers)
    assert r.route["reason"] == "pin", r.route
    # The base model: nearest, as ever.
    r = chat(fleet.port, msgs)
    assert r.status == 200 and r.replica == "near", (r.status, r.headers)
    # Listed nowhere: near, whose engine answers in its own words.
    r = chat(fleet.port, msgs, model="nobody-serves-this")
    assert r.status == 404, r.body
    assert r.json()["error"]["message"] == "The model `nobody-serves-this` does not exist. Valid aliases: emulated-model.", r.body
    assert r.route["region"] == "near", r.route
