"""The engine emulator's `--mode vllm` against a real vLLM 0.32 (its CPU
build, scripts/vllm-install, serving a random-weight Llama over the Llama-3
vocabulary): the same requests go to both, and what comes back is compared.

What is compared: status codes; the JSON shape of every answer (keys,
nesting, value types, key order at the top level), exactly for error bodies
and usage numbers; the chunk sequence of streams; the context rule on the
three generating endpoints; /health, /version, /v1/models, /v1/embeddings;
the metric families the plugin reads (src/engines/families.rs): their type
and label names, and vllm:cache_config_info's numbers.

Every difference found is either fixed in the emulator or declared in
DELIBERATE below with why; the test fails on any other difference, and on a
declaration that no longer matches anything (so the list stays true).

Prompts are chosen so that both tokenizers count alike: token-id prompts on
/v1/completions, and chat contents of " x" repeated (one token per " x" in
both vocabularies; the Llama-3 template adds 10 in both).

One vLLM start (30-60 s on a busy machine), then a few seconds of requests."""

from __future__ import annotations

import fnmatch
import json
import random
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import harness

MODEL = harness.VLLM_MODEL
MAX_LEN = 4096
BLOCK = harness.VLLM_BLOCK
# vLLM's KV space here (VLLM_CPU_KVCACHE_SPACE=1 GiB) holds this many tokens
# of the tiny model (its cache_config_info kv_cache_size_tokens).
KV_TOKENS = 2_097_152
# Chat over this many " x" is this many more tokens, in both tokenizers.
TEMPLATE_TOKENS = 10
TIMEOUT = 180.0

# The emulator as the real one is started: same model name, context,
# block size and cache, the Responses store on, every model name checked.
EMULATOR_FLAGS = ["--model", MODEL, "--max-model-len", str(MAX_LEN), "--block-size", str(BLOCK),
                  "--cache-tokens", str(KV_TOKENS), "--check-model", "--responses-store",
                  "--enable-prompt-tokens-details",
                  "--max-concurrency", "8"]

# Differences that stay, each with why. Keys are fnmatch patterns over the
# difference ids the checks below produce ("CHECK PATH: what").
DELIBERATE = {
    "models /data/0/root": "vLLM's root is the weights' folder; the emulator has none and names the model",
    "context chat fits, default /usage/*": "no max_tokens: vLLM generates until the model stops (random "
                                            "weights never do: up to the context); emulated answers end "
                                            "after 16 tokens, the context permitting",
    "admin /admin/stats status": "the emulator's test controls (/admin/*) are its own",
    "tokenize status": "vLLM's /tokenize is not emulated: the emulator's tokenizer is not vLLM's",
    "metrics <families vllm has, the emulator not>": "vLLM's timing histograms, token counters and other "
                                                     "families the plugin does not read are not emulated",
    "metrics emulator_http_requests_total exists in vllm": "the emulator's own request counter, read by tests",
}

ROOT = Path(__file__).resolve().parent.parent
FAMILIES_RS = ROOT / "src" / "engines" / "families.rs"


# ---------------------------------------------------------------- plumbing

def call(url: str, method: str, path: str, body=None) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def loads(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return {"<not json>": raw[:200].decode(errors="replace")}


def sse_events(raw: bytes) -> list:
    """The data of each SSE event, JSON-decoded ("[DONE]" kept as a string);
    for the Responses stream, (event type, data)."""
    out = []
    for block in raw.decode().split("\n\n"):
        event, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
        if data is None:
            continue
        value = data if data == "[DONE]" else json.loads(data)
        out.append(value if event is None else (event, value))
    return out


def collapse(events: list, key) -> list:
    """Runs of consecutive events of one kind as one: a detokenizer that
    holds back an incomplete character merges two tokens' text into one
    chunk, so how many token chunks a stream has is not the engine's
    contract; their kind and order are."""
    out = []
    for e in events:
        if out and key(out[-1]) == key(e):
            continue
        out.append(e)
    return out


def chunk_kind(c):
    """A chat or completion chunk's kind: its shape."""
    return json.dumps(shape_of(c), sort_keys=True)


def shape_of(v):
    if isinstance(v, dict):
        return {k: shape_of(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape_of(x) for x in v]
    return kind(v)


def kind(v) -> str:
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str",
            list: "list", dict: "object"}.get(type(v), type(v).__name__)


def shape_diff(a, b, path: str = "") -> list[tuple[str, str]]:
    """Where two JSON values differ in shape: (path, what), `a` being
    vLLM's. Numbers differ in value only, which is not shape."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            p = f"{path}/{k}"
            if k not in b:
                out.append((p, f"vllm has it ({kind(a[k])}), the emulator not"))
            elif k not in a:
                out.append((p, f"the emulator has it ({kind(b[k])}), vllm not"))
            else:
                out.extend(shape_diff(a[k], b[k], p))
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [] if len(a) == len(b) else [(path, f"length vllm {len(a)}, emulator {len(b)}")]
        for i, (x, y) in enumerate(zip(a, b)):
            out.extend(shape_diff(x, y, f"{path}/{i}"))
        return out
    if kind(a) != kind(b) and {kind(a), kind(b)} != {"int", "float"}:
        return [(path, f"vllm {kind(a)} {json.dumps(a)[:80]}, emulator {kind(b)} {json.dumps(b)[:80]}")]
    return []


class Diffs:
    """Differences found, by id."""

    def __init__(self):
        self.found: dict[str, str] = {}

    def add(self, check: str, path: str, what: str) -> None:
        self.found[f"{check} {path}".rstrip()] = what

    def shape(self, check: str, a, b) -> None:
        for path, what in shape_diff(a, b):
            self.add(check, path, what)

    def same(self, check: str, path: str, a, b) -> None:
        if a != b:
            self.add(check, path, f"vllm {json.dumps(a)[:400]}, emulator {json.dumps(b)[:400]}")

    def order(self, check: str, a: dict, b: dict) -> None:
        """Top-level key order (vLLM writes usage before prompt_logprobs
        and prompt_token_ids; clients reading a stream of JSON see it)."""
        common = [k for k in a if k in b]
        if common != [k for k in b if k in a]:
            self.add(check, "<key order>", f"vllm {common}, emulator {[k for k in b if k in a]}")


# ------------------------------------------------------------------ engines

@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    run_dir = harness.fresh_run_dir("vllm_conformance")
    vllm = harness.launch_vllm("real", run_dir, max_model_len=MAX_LEN, store=True)
    emulator = None
    try:
        emulator = harness.start_engine("emulated", run_dir, 0, "vllm", EMULATOR_FLAGS, plain=True)
        harness.wait_vllm(vllm)
        yield vllm.url, emulator.url
    finally:
        harness.stop_vllm(vllm)
        if emulator is not None:
            emulator.kill()


def both(engines, method: str, path: str, body=None):
    real, emu = engines
    return call(real, method, path, body), call(emu, method, path, body)


def ids(n: int, seed: int) -> list[int]:
    """A token-id prompt no other request of the run shares (ids within
    both vocabularies, none special)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def xs(n_tokens: int) -> list[dict]:
    """Chat messages of exactly n_tokens prompt tokens in both engines."""
    return [{"role": "user", "content": " x" * (n_tokens - TEMPLATE_TOKENS)}]


# ------------------------------------------------------------------- checks

def check_probes(engines, d: Diffs) -> None:
    (rs, rh, rb), (es, eh, eb) = both(engines, "GET", "/health")
    d.same("health", "status", rs, es)
    d.same("health", "body", rb.decode(), eb.decode())
    d.same("health", "x-release-digest", "x-release-digest" in rh, "x-release-digest" in eh)
    (rs, _, rb), (es, _, eb) = both(engines, "GET", "/version")
    d.same("version", "status", rs, es)
    d.same("version", "body", loads(rb), loads(eb))
    (rs, _, rb), (es, _, eb) = both(engines, "GET", "/v1/models")
    d.same("models", "status", rs, es)
    real, emu = loads(rb), loads(eb)
    d.shape("models", real, emu)
    for key in ("id", "object", "owned_by", "parent", "max_model_len", "root"):
        d.same("models", f"/data/0/{key}", real["data"][0].get(key), emu["data"][0].get(key))
    (rs, _, _), (es, _, _) = both(engines, "GET", "/admin/stats")
    d.same("admin /admin/stats", "status", rs, es)
    (rs, _, _), (es, _, _) = both(engines, "POST", "/tokenize", {"model": MODEL, "prompt": "hi"})
    d.same("tokenize", "status", rs, es)
    # A generative model serves no embeddings.
    (rs, _, rb), (es, _, eb) = both(engines, "POST", "/v1/embeddings", {"model": MODEL, "input": "hi"})
    d.same("embeddings", "status", rs, es)
    d.same("embeddings", "body", loads(rb), loads(eb))
    # An unknown model, on each endpoint.
    for path, body in [("/v1/chat/completions", {"messages": xs(12), "max_tokens": 2}),
                       ("/v1/completions", {"prompt": ids(4, 1), "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2})]:
        (rs, _, rb), (es, _, eb) = both(engines, "POST", path, {**body, "model": "nope"})
        d.same(f"unknown-model {path}", "status", rs, es)
        d.same(f"unknown-model {path}", "body", loads(rb), loads(eb))


def check_answers(engines, d: Diffs) -> None:
    """Non-streamed answers: shape, key order, usage (numbers included:
    the prompts count alike), finish reason; a prefix hit on the second
    sending, in whole blocks."""
    prompt = ids(3 * BLOCK + 20, 2)
    chat = xs(2 * BLOCK + 50)
    for round_ in ("cold", "warm"):
        for path, body in [("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 3})]:
            check = f"answer {path} {round_}"
            (rs, _, rb), (es, _, eb) = both(engines, "POST", path, body)
            d.same(check, "status", rs, es)
            real, emu = loads(rb), loads(eb)
            d.shape(check, real, emu)
            d.order(check, real, emu)
            d.same(check, "/usage", real.get("usage"), emu.get("usage"))
            d.same(check, "/choices/0/finish_reason", real["choices"][0].get("finish_reason"),
                   emu["choices"][0].get("finish_reason"))
    # The same with a cache salt: nothing shared with the unsalted prompt.
    body = {"model": MODEL, "messages": chat, "max_tokens": 2, "cache_salt": "s1"}
    (rs, _, rb), (es, _, eb) = both(engines, "POST", "/v1/chat/completions", body)
    d.same("answer salted", "status", rs, es)
    d.same("answer salted", "/usage", loads(rb).get("usage"), loads(eb).get("usage"))


def check_streams(engines, d: Diffs) -> None:
    """Chunk sequences: one shape per chunk, the usage chunk last with no
    choices, then [DONE]."""
    cases = [
        ("chat+usage", "/v1/chat/completions",
         {"messages": xs(40), "max_tokens": 3, "stream_options": {"include_usage": True}}),
        ("chat", "/v1/chat/completions", {"messages": xs(41), "max_tokens": 3}),
        ("completion+usage", "/v1/completions",
         {"prompt": ids(30, 3), "max_tokens": 3, "stream_options": {"include_usage": True}}),
    ]
    for name, path, body in cases:
        check = f"stream {name}"
        (rs, rh, rb), (es, eh, eb) = both(engines, "POST", path, {"model": MODEL, "stream": True, **body})
        d.same(check, "status", rs, es)
        d.same(check, "content-type", rh.get("content-type"), eh.get("content-type"))
        real, emu = sse_events(rb), sse_events(eb)
        d.shape(check, collapse(real, chunk_kind), collapse(emu, chunk_kind))
        if real and emu and real[-1] == "[DONE]" and emu[-1] == "[DONE]" and "usage" in name:
            d.same(check, "usage", real[-2].get("usage"), emu[-2].get("usage"))


def context_cases() -> list[tuple[str, str, dict]]:
    over, at, fits = MAX_LEN + 1, MAX_LEN, MAX_LEN - 6
    return [
        ("completion prompt>limit", "/v1/completions", {"prompt": ids(over, 4), "max_tokens": 4}),
        ("completion prompt==limit", "/v1/completions", {"prompt": ids(at, 5)}),
        ("completion max_tokens>limit", "/v1/completions", {"prompt": ids(8, 6), "max_tokens": 5000}),
        ("completion max_tokens==0", "/v1/completions", {"prompt": ids(8, 7), "max_tokens": 0}),
        ("completion fits, cut", "/v1/completions", {"prompt": ids(fits, 8), "max_tokens": 100}),
        ("completion fits, default", "/v1/completions", {"prompt": ids(fits, 9)}),
        ("chat fits, default", "/v1/chat/completions", {"messages": xs(MAX_LEN - 40)}),
        ("chat prompt>limit", "/v1/chat/completions", {"messages": xs(over), "max_tokens": 4}),
        ("chat prompt==limit", "/v1/chat/completions", {"messages": xs(at)}),
        ("chat max_tokens>limit", "/v1/chat/completions", {"messages": xs(20), "max_tokens": 5000}),
        ("chat max_completion_tokens>limit", "/v1/chat/completions",
         {"messages": xs(20), "max_tokens": 7, "max_completion_tokens": 5000}),
        ("chat fits, cut", "/v1/chat/completions", {"messages": xs(fits + 1), "max_completion_tokens": 100}),
        ("chat fits, cut, stream", "/v1/chat/completions",
         {"messages": xs(fits + 2), "max_tokens": 100, "stream": True,
          "stream_options": {"include_usage": True}}),
        ("responses prompt>limit", "/v1/responses", {"input": " x" * (over - TEMPLATE_TOKENS)}),
        ("responses prompt==limit", "/v1/responses", {"input": " x" * (at - TEMPLATE_TOKENS)}),
        ("responses max_output_tokens>limit", "/v1/responses", {"input": "hi", "max_output_tokens": 5000}),
        ("responses max_output_tokens==0", "/v1/responses", {"input": "hi", "max_output_tokens": 0}),
        ("responses fits, cut", "/v1/responses",
         {"input": " x" * (fits + 3 - TEMPLATE_TOKENS), "max_output_tokens": 100}),
    ]


def check_context(engines, d: Diffs) -> None:
    for name, path, body in context_cases():
        check = f"context {name}"
        (rs, _, rb), (es, _, eb) = both(engines, "POST", path, {"model": MODEL, **body})
        d.same(check, "status", rs, es)
        if body.get("stream"):
            real, emu = sse_events(rb), sse_events(eb)
            real_usage = real[-2].get("usage") if len(real) > 1 else None
            emu_usage = emu[-2].get("usage") if len(emu) > 1 else None
            d.same(check, "usage", real_usage, emu_usage)
            d.same(check, "finish_reason", [c["choices"][0]["finish_reason"] for c in real[:-2] if c["choices"]][-1:],
                   [c["choices"][0]["finish_reason"] for c in emu[:-2] if c["choices"]][-1:])
            continue
        real, emu = loads(rb), loads(eb)
        if rs != 200 or es != 200:
            d.same(check, "body", real, emu)
            continue
        if path == "/v1/responses":
            for key in ("status", "incomplete_details", "max_output_tokens"):
                d.same(check, f"/{key}", real.get(key), emu.get(key))
            d.same(check, "/usage/output_tokens", real["usage"]["output_tokens"], emu["usage"]["output_tokens"])
            d.same(check, "/usage/input_tokens", real["usage"]["input_tokens"], emu["usage"]["input_tokens"])
        else:
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                d.same(check, f"/usage/{key}", real["usage"][key], emu["usage"][key])
            d.same(check, "/choices/0/finish_reason", real["choices"][0]["finish_reason"],
                   emu["choices"][0]["finish_reason"])


def check_responses(engines, d: Diffs) -> None:
    """Both keep answers (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1, the
    emulator with --responses-store): shape, retrieval, a continuation."""
    body = {"model": MODEL, "input": " x" * 300, "max_output_tokens": 3}
    (rs, _, rb), (es, _, eb) = both(engines, "POST", "/v1/responses", body)
    d.same("responses", "status", rs, es)
    real, emu = loads(rb), loads(eb)
    d.shape("responses", real, emu)
    d.order("responses", real, emu)
    d.same("responses", "/usage", real.get("usage"), emu.get("usage"))
    d.same("responses", "/status", real.get("status"), emu.get("status"))
    rid, eid = real.get("id", "x"), emu.get("id", "x")
    r_get = call(engines[0], "GET", f"/v1/responses/{rid}")
    e_get = call(engines[1], "GET", f"/v1/responses/{eid}")
    d.same("responses get", "status", r_get[0], e_get[0])
    d.shape("responses get", loads(r_get[2]), loads(e_get[2]))
    nxt = {"model": MODEL, "input": "and then", "max_output_tokens": 2}
    r_next = call(engines[0], "POST", "/v1/responses", {**nxt, "previous_response_id": rid})
    e_next = call(engines[1], "POST", "/v1/responses", {**nxt, "previous_response_id": eid})
    d.same("responses continued", "status", r_next[0], e_next[0])
    d.shape("responses continued", loads(r_next[2]), loads(e_next[2]))
    (rs, _, rb), (es, _, eb) = both(engines, "GET", "/v1/responses/resp_nothere")
    d.same("responses unknown", "status", rs, es)
    d.same("responses unknown", "body", loads(rb), loads(eb))
    # A stream: the event types in order, and each event's shape.
    (rs, _, rb), (es, _, eb) = both(engines, "POST", "/v1/responses", {**body, "stream": True})
    d.same("responses stream", "status", rs, es)
    real_ev = collapse(sse_events(rb), lambda e: e[0])
    emu_ev = collapse(sse_events(eb), lambda e: e[0])
    d.same("responses stream", "event types", [e[0] for e in real_ev], [e[0] for e in emu_ev])
    d.shape("responses stream", [e[1] for e in real_ev], [e[1] for e in emu_ev])


def parse_metrics(text: str) -> tuple[dict[str, str], dict[str, set[str]], list[tuple[str, dict]]]:
    """(family -> type, sample name -> label names, samples)."""
    types, labels, samples = {}, {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            types[name] = typ
        elif line and not line.startswith("#"):
            m = re.match(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', line)
            if not m:
                continue
            pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            labels.setdefault(m.group(1), set()).update(pairs)
            samples.append((m.group(1), pairs))
    return types, labels, samples


def family_of(sample: str, types: dict[str, str]) -> tuple[str | None, str | None]:
    if sample in types:
        return sample, types[sample]
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in types:
            base = sample[: -len(suffix)]
            return base, types[base]
    return None, None


def plugin_series() -> list[str]:
    """The vLLM names the plugin reads (VLLM_SERIES in families.rs)."""
    src = FAMILIES_RS.read_text()
    block = src[src.index("const VLLM_SERIES"):src.index("const SGLANG_SERIES")]
    names = re.findall(r'"(vllm:[a-z_:]+)"', block)
    # The one unprefixed series, by its constant.
    if "(PROCESS_START," in block:
        names.append(re.search(r'const PROCESS_START: &str = "([a-z_]+)";', src).group(1))
    return names


def check_metrics(engines, d: Diffs) -> None:
    (rs, rh, rb), (es, eh, eb) = both(engines, "GET", "/metrics")
    d.same("metrics", "status", rs, es)
    d.same("metrics", "content-type", rh.get("content-type"), eh.get("content-type"))
    rt, rl, rsamp = parse_metrics(rb.decode())
    et, el, esamp = parse_metrics(eb.decode())
    for name in plugin_series():
        check = f"metrics {name}"
        d.same(check, "present", name in rl, name in el)
        if name in rl and name in el:
            d.same(check, "family and type", family_of(name, rt), family_of(name, et))
            d.same(check, "label names", sorted(rl[name]), sorted(el[name]))
    info = "vllm:cache_config_info"
    real = next((l for n, l in rsamp if n == info), {})
    emu = next((l for n, l in esamp if n == info), {})
    for key in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "enable_prefix_caching", "engine"):
        d.same(f"metrics {info}", key, real.get(key), emu.get(key))
    # Every family the emulator writes exists in vLLM, and the other way.
    for name in sorted({n for n, _ in esamp} - set(rl)):
        d.add(f"metrics {name}", "exists in vllm", "the emulator writes it, vLLM does not")
    missing = sorted({family_of(n, rt)[0] or n for n, _ in rsamp} - {family_of(n, et)[0] or n for n, _ in esamp})
    if missing:
        d.add("metrics", "<families vllm has, the emulator not>", ", ".join(missing))


def test_emulator_vllm_mode_matches_vllm_032(engines):
    d = Diffs()
    t0 = time.monotonic()
    for check in (check_probes, check_answers, check_streams, check_context, check_responses, check_metrics):
        check(engines, d)
    print(f"requests took {time.monotonic() - t0:.1f} s")
    undeclared = {k: v for k, v in d.found.items() if not any(fnmatch.fnmatchcase(k, p) for p in DELIBERATE)}
    stale = [p for p in DELIBERATE if not any(fnmatch.fnmatchcase(k, p) for k in d.found)]
    for k, v in sorted(d.found.items()):
        print(("DELIBERATE " if k not in undeclared else "DIFFERENT  ") + f"{k}: {v}")
    assert not undeclared, "undeclared differences from vLLM 0.32:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(undeclared.items()))
    assert not stale, f"DELIBERATE entries that no longer match any difference: {stale}"


# ------------------------------------------- the answer, as the engine keeps it

# An answer as a trained model writes it: text the tokenizer would make of
# it again token for token (a random-weight model's answers are not: they
# are token ids the tokenizer never produces, special ones among them,
# which vLLM leaves out of the text).
TRAINED_ANSWER = ("Roman aqueducts carried water over long distances by gravity alone. Engineers surveyed "
                  "gentle gradients, often less than one metre per kilometre, and built channels of stone, "
                  "brick and concrete.\n\n1. **Sources**: springs and rivers in the hills.\n2. **Bridges**: "
                  "arcades such as the Pont du Gard, about 1,000,000 m\u00b3 a day in 97 AD.\n\n"
                  "Na\u00efve r\u00e9sum\u00e9s of their upkeep (\u6771\u4eac, \u041c\u043e\u0441\u043a\u0432\u0430) "
                  "list crews who cleared lime deposits every few years:\n\n```python\n"
                  "def slope(drop_m, length_km):\n    return drop_m / (length_km * 1000)\n```\n\n"
                  "Most of them stayed in use for centuries, and several still carry water today.")


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_vllm_keeps_an_answer_and_a_clients_next_turn_reaches_it(engines):
    """What the router and the simulator believe of a conversation's
    answer (docs/ENGINES.md, "The answer"), against vLLM 0.32:

    1. The engine keeps the blocks it computed for the answer: a next
       request extending prompt + answer (as token ids) is served
       floor((prompt + answer - 1) / B) x B tokens from the cache.
    2. A client's next turn reaches them through the chat template and the
       tokenizer when the answer's text tokenizes back to the answer's
       tokens, as a trained model's answers do: the cache serves the whole
       first turn, answer included, in whole blocks.
    3. A random-weight model's own answer does not come back through its
       text (shown, not asserted: it depends on the weights)."""
    real, _ = engines
    # 1. Token ids: 300 prompt tokens, 200 generated; 499 computed.
    prompt = ids(300, 9001)
    s, _, b = call(real, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 200,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "return_token_ids": True})
    assert s == 200, b[:300]
    first = loads(b)
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 200, first["choices"][0].get("finish_reason")
    s, _, b = call(real, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt + answer + ids(20, 9002),
                                                     "max_tokens": 1})
    assert s == 200, b[:300]
    held = cached(loads(b)["usage"])
    assert held == (300 + 200 - 1) // BLOCK * BLOCK == 384, held  # the prompt alone would be 256
    # 2. A trained model's answer, through the chat template: plant the
    # first turn as the engine would have computed it (the rendered prompt,
    # the answer's tokens and the end of turn the model stops on, sampled
    # but never computed), then send the next turn as a client does.
    turn1 = [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(400))}]
    rendered = loads(call(real, "POST", "/tokenize", {"model": MODEL, "messages": turn1,
                                                      "add_generation_prompt": True})[2])["tokens"]
    text = loads(call(real, "POST", "/tokenize", {"model": MODEL, "prompt": TRAINED_ANSWER,
                                                  "add_special_tokens": False})[2])["tokens"]
    eot = loads(call(real, "POST", "/tokenize", {"model": MODEL, "prompt": "<|eot_id|>",
                                                 "add_special_tokens": False})[2])["tokens"]
    assert len(eot) == 1, eot
    s, _, b = call(real, "POST", "/v1/completions", {"model": MODEL, "prompt": rendered + text + eot,
                                                     "max_tokens": 1})
    assert s == 200, b[:300]
    turn2 = turn1 + [{"role": "assistant", "content": TRAINED_ANSWER},
                     {"role": "user", "content": "And how were they maintained?"}]
    again = loads(call(real, "POST", "/tokenize", {"model": MODEL, "messages": turn2,
                                                   "add_generation_prompt": True})[2])["tokens"]
    assert again[:len(rendered) + len(text) + 1] == rendered + text + eot  # the round trip is exact
    s, _, b = call(real, "POST", "/v1/chat/completions", {"model": MODEL, "messages": turn2, "max_tokens": 1})
    assert s == 200, b[:300]
    held = cached(loads(b)["usage"])
    whole = (len(rendered) + len(text)) // BLOCK * BLOCK
    assert len(rendered) // BLOCK < (len(rendered) + len(text)) // BLOCK  # the answer fills a block
    assert held == whole > len(rendered) // BLOCK * BLOCK, (held, len(rendered), len(text))
    # 3. The random-weight model's own answer, sent back as its text.
    s, _, b = call(real, "POST", "/v1/chat/completions", {"model": MODEL, "messages": turn1, "max_tokens": 128,
                                                          "temperature": 0, "ignore_eos": True})
    assert s == 200, b[:300]
    own = loads(b)
    p1 = own["usage"]["prompt_tokens"]
    turn2 = turn1 + [{"role": "assistant", "content": own["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And how were they maintained?"}]
    s, _, b = call(real, "POST", "/v1/chat/completions", {"model": MODEL, "messages": turn2, "max_tokens": 1})
    assert s == 200, b[:300]
    print(f"random weights: turn 1 {p1} prompt + 128 answer tokens; turn 2 served "
          f"{cached(loads(b)['usage'])} from the cache (the prompt's blocks: {p1 // BLOCK * BLOCK})")
