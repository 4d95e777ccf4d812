"""Hostile requests through one real Envoy with the plugin: about 11,000
generated (seeded, so every run sends the same bytes) malformed, oversized,
oddly framed or oddly encoded requests, with valid ones interleaved, sent
concurrently over raw HTTP/1.1 sockets and over HTTP/2 (curl, prior
knowledge). Every request must get its documented answer within a bound:

| kind | documented answer |
|---|---|
| valid chat / completion, HTTP/1.1 or 2 | 200 from an engine, decision header set |
| invalid body on an OpenAI path (truncated or invalid JSON, deep nesting, wrong types, non-UTF-8, empty) | 400, OpenAI error JSON (`invalid_request_error`), the engine never sees it |
| compressed body, non-JSON body, other `/v1/` path or method | passed untouched to `default_region` (near); the engine answers |
| a path outside `/v1/` (the engines' `/metrics`, `/health`, admin) | 404 from Envoy (a direct response), OpenAI error JSON |
| free tier over its prompt cap (the run holds ladder level 2) | 413 `context_length_exceeded` from the guard |
| body over the 4 MiB buffer limit, HTTP/1.1 or 2 | 413 from Envoy |
| malformed HTTP (bad chunk framing, bad method, non-ASCII path, CL with TE) | 400 from Envoy's codec, connection closed |
| Content-Length shorter than the body | the declared body is answered as above; the excess is the next request (Envoy 400) or a partial one, closed once the client closes |
| Content-Length longer than the body | no answer while the body is incomplete; the connection closes once the client closes |

Counted: VM traps (Envoy's log and its wasm stats), hangs (no answer or
close within 10 s), and statuses per category. The summary is printed and
written to wasm-tests/_runs/hostile.json.
"""

from __future__ import annotations

import gzip
import json
import re
import random
import selectors
import socket
import subprocess
import threading
import time
import urllib.request
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import harness

SEED = 20261129
THREADS = 24
HANG_S = 10.0
# The probe's period and callout timeout in this run, ms.
TICK_MS = 1000
LIMIT = 4 * 1024 * 1024  # the listener's per_connection_buffer_limit_bytes
CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"
KEYS = {"free": None, "paid": "sk-demo-paid", "critical": "sk-demo-critical"}
FREE_PROMPT_CAP_BYTES = 16384 * 4  # level 2: free prompts <= 16384 tokens at 4 bytes per token


# ------------------------------------------------------------------ cases

@dataclass
class Case:
    category: str
    expect: str  # key of CHECKS
    path: bytes = CHAT
    method: bytes = b"POST"
    body: bytes = b""
    headers: list = field(default_factory=list)  # [(bytes, bytes)]
    framing: str = "length"  # length | chunked | none | raw
    raw: bytes = b""  # framing "raw": the exact bytes (own connection)
    lie: int = 0  # framing "length": Content-Length minus the body's length
    param: str | None = None  # expected OpenAI error param, when known
    h2: bool = False
    pause_s: float = 0.0  # lying_long: how long no answer is expected


def wire(c: Case) -> bytes:
    h = [(b"host", b"hostile.test"), *c.headers]
    if c.framing == "length":
        h.append((b"content-length", str(len(c.body) + c.lie).encode()))
        payload = c.body
    elif c.framing == "chunked":
        h.append((b"transfer-encoding", b"chunked"))
        payload = c.body
    else:
        payload = b""
    head = c.method + b" " + c.path + b" HTTP/1.1\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in h)
    return head + b"\r\n" + payload


def chunk(body: bytes, rnd: random.Random) -> bytes:
    out, i = [], 0
    while i < len(body):
        n = rnd.choice([1, 3, 17, 100, 4096, 65536])
        part = body[i:i + n]
        ext = b";ext=1" if rnd.random() < 0.1 else b""
        out.append(b"%x%s\r\n%s\r\n" % (len(part), ext, part))
        i += n
    return b"".join(out) + b"0\r\n\r\n"


WORDS = ("route the prompt to the region with the lowest expected time to first token while caches "
         "stay warm and queues stay short across distant replicas").split()


def text(rnd: random.Random, n_words: int) -> str:
    s = " ".join(rnd.choice(WORDS) for _ in range(n_words))
    if rnd.random() < 0.2:
        s += " ünïcödé 漢字 😀 \u2028 \"quoted\" \\ back\\slash\n\ttabs"
    return s


def valid_chat(rnd: random.Random, i: int, content_bytes: int | None = None) -> dict:
    if content_bytes:
        return {"messages": [{"role": "user", "content": f"req {i}: " + harness.filler(f"h{i}", content_bytes)}],
                "max_tokens": 1}
    msgs = []
    if rnd.random() < 0.3:
        msgs.append({"role": "system", "content": "You are terse."})
    for t in range(rnd.randint(1, 3)):
        body = f"req {i} turn {t}: " + text(rnd, rnd.randint(1, 60))
        if rnd.random() < 0.2:
            content = [{"type": "text", "text": body}, {"type": "image_url", "image_url": {"url": f"https://x/{i}.png"}}]
        else:
            content = body
        msgs.append({"role": "user", "content": content})
        if rnd.random() < 0.3:
            msgs.append({"role": "assistant", "content": text(rnd, 5)})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "and?"})
    req = {"model": "emulated-model", "messages": msgs, "max_tokens": rnd.randint(1, 4)}
    if rnd.random() < 0.2:
        req["stream"] = True
    if rnd.random() < 0.2:
        req["user"] = f"user-{rnd.randint(0, 50)}"
    if rnd.random() < 0.2:
        req["temperature"] = 0.5
        req["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return req


def valid_completion(rnd: random.Random, i: int) -> dict:
    kind = rnd.random()
    if kind < 0.6:
        prompt = f"completion {i}: " + text(rnd, rnd.randint(1, 60))
    elif kind < 0.8:
        prompt = [f"c{i}", text(rnd, 5)]
    else:
        prompt = [rnd.randint(0, 50000) for _ in range(rnd.randint(1, 40))]
    return {"model": "emulated-model", "prompt": prompt, "max_tokens": rnd.randint(1, 4)}


def tier_headers(rnd: random.Random, tier: str | None = None) -> list:
    tier = tier or rnd.choice(["free", "free", "paid", "critical"])
    key = KEYS[tier]
    h = [(b"content-type", b"application/json")]
    if key:
        h.append((b"authorization", b"Bearer " + key.encode()))
    if rnd.random() < 0.3:
        h.append((b"x-session-id", f"s-{rnd.randint(0, 200)}".encode()))
    return h


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


# Wrong types for every field the router (and the guard) reads; each is a 400
# naming the field. `None` for the messages/prompt value means "leave as is".
WRONG = {
    "messages": ['"hello"', "42", "{}", "null", "true", "[]", "[42]", '["x"]', "[null]", "[[]]",
                 '[{"content": "no role"}]', '[{"role": 42, "content": "x"}]', '[{"role": null, "content": "x"}]',
                 '[{"role": {}, "content": "x"}]', '[{"role": "user", "content": 42}]',
                 '[{"role": "user", "content": true}]', '[{"role": "user", "content": {}}]',
                 '[{"role": "user", "content": [42]}]', '[{"role": "user", "content": ["x"]}]',
                 '[{"role": "user", "content": [{"type": 42}]}]', '[{"role": "user", "content": [{"text": 42}]}]',
                 '[{"role": "user", "role": "user", "content": "x"}]',
                 '[{"role": "user", "content": "x", "content": "y"}]'],
    "model": ["42", "null", "[]", "{}", "true", "1.5"],
    "max_tokens": ['"100"', "-5", "1.5", "true", "{}", "[]", "1e30", '"1"', "18446744073709551616"],
    "max_completion_tokens": ['"100"', "-1", "0.5", "false", "[1]"],
    "stream": ['"yes"', "1", "0", "{}", "[]", '"true"'],
    "user": ["42", "{}", "[]", "true", "-1"],
    "prompt": ['42', "{}", "true", "null", "[]", "[{}]", "[[-1]]", "[1.5]", "[true]", "[4294967296]", "[[1, \"x\"]]",
               "[null]", "-3"],
}


def gen_cases() -> list[Case]:
    rnd = random.Random(SEED)
    cases: list[Case] = []
    add = cases.append

    for i in range(1600):
        add(Case("valid_chat", "ok", body=dumps(valid_chat(rnd, i)), headers=tier_headers(rnd)))
    for i in range(300):
        add(Case("valid_completion", "ok", path=COMPLETIONS, body=dumps(valid_completion(rnd, i)),
                 headers=tier_headers(rnd)))
    # A query string or a trailing slash is still the inference path.
    for i in range(100):
        path = rnd.choice([CHAT + b"?api-version=1", CHAT + b"/", COMPLETIONS + b"?x=1&y=2"])
        body = valid_completion(rnd, i) if path.startswith(COMPLETIONS) else valid_chat(rnd, i)
        # The router takes a trailing slash as the inference path; this
        # engine does not (404), which is the engine's answer to give.
        add(Case("valid_chat", "routed" if path.endswith(b"/") else "ok", path=path, body=dumps(body),
                 headers=tier_headers(rnd)))

    for i in range(1200):
        full = dumps(valid_chat(rnd, i)) if rnd.random() < 0.8 else dumps(valid_completion(rnd, i))
        path = COMPLETIONS if b'"prompt"' in full else CHAT
        cut = rnd.randint(1, len(full) - 1)
        add(Case("truncated_json", "plugin_400", path=path, body=full[:cut], headers=tier_headers(rnd)))

    syntax = [
        lambda b: b.replace(b":", b"=", 1),
        lambda b: b.replace(b'"', b"'", 2),
        lambda b: b[:-1] + b",}",
        lambda b: b + b" trailing",
        lambda b: b + b"{}",
        lambda b: b.replace(b"[", b"[,", 1),
        lambda b: b.replace(b'"messages"', b"messages", 1) if b'"messages"' in b else b"{prompt: 1}",
        lambda b: b[:1] + b"/* c */" + b[1:],
        lambda b: b[:-1] + b', "n": NaN}',
        lambda b: b[:-1] + b', "n": Infinity}',
        lambda b: b[:-1] + b', "n": 01}',
        lambda b: b[:-1] + b', "n": "\\x41"}',
        lambda b: b[:-1] + b', "n": "tab\there"}',
        lambda b: b[:-1] + b', "n": "\x00"}',
        lambda b: b[:-1] + b"]",
        lambda b: b"{" + b,
        lambda b: b"{}" + b[2:],
        lambda b: b.replace(b"}", b"", 1),
        lambda b: b[:-1] + b', "a": [1, 2}',
        lambda b: b[:-1] + b', "a": tru}',
        lambda b: b[:-1] + b', "a" "b"}',
        lambda b: b[:-1] + b', "messages": [], "prompt": "x", "messages": 1}',
        lambda b: b[:-1] + b', "max_tokens": 1, "max_tokens": 2}',
    ]
    for i in range(1200):
        base = valid_chat(rnd, i)
        base.pop("max_tokens", None)
        b = dumps(base)
        f = syntax[i % len(syntax)]
        add(Case("invalid_json", "plugin_400", body=f(b), headers=tier_headers(rnd)))

    for i in range(400):
        depth = rnd.choice([129, 200, 1000, 10_000, 100_000])
        nest = rnd.choice([b"[", b'{"a":'])
        close = b"]" if nest == b"[" else b"}"
        deep = nest * depth + b"1" + close * depth
        where = i % 4
        if where == 0:
            body = b'{"x":' + deep + b',"messages":[{"role":"user","content":"x"}]}'
        elif where == 1:
            body = b'{"messages":[{"role":"user","content":"x","extra":' + deep + b"}]}"
        elif where == 2:
            body = b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":' + deep + b"}]}]}"
        else:
            body = b'{"prompt":' + deep + b"}"
        # Members the router skips are skipped without recursion (serde_json's
        # ignore_value), so any depth there is valid JSON the router routes and
        # the engine judges (this one refuses beyond depth 128); depth in what
        # the router reads hits serde_json's recursion limit (128): 400.
        add(Case("deep_nesting", "routed" if where < 2 else "plugin_400", path=COMPLETIONS if where == 3 else CHAT,
                 body=body, headers=tier_headers(rnd)))

    for i in range(45):
        size = rnd.choice([300_000, 1_000_000, 2_000_000, 3_000_000])
        if i % 3 == 0:
            # Valid, for a tier without a prompt cap at level 2: the engine answers.
            body = dumps(valid_chat(rnd, i, content_bytes=size))
            add(Case("huge_string", "ok", body=body, headers=tier_headers(rnd, rnd.choice(["paid", "critical"]))))
        elif i % 3 == 1:
            # Valid, free tier: over the level-2 prompt cap.
            body = dumps(valid_chat(rnd, i, content_bytes=size))
            add(Case("huge_string", "prompt_cap_413", body=body, headers=tier_headers(rnd, "free")))
        else:
            # Invalid after the huge string: wrong type, bad escape, unterminated.
            s = "x" * size
            h = s[:size // 2]
            bad = rnd.choice([
                f'{{"messages":[{{"role":"user","content":"{h}"}}],"max_tokens":"{h}"}}',
                f'{{"messages":[{{"role":"user","content":"{s}\\q"}}]}}',
                f'{{"messages":[{{"role":"user","content":"{s}',
                f'{{"{s}":1}}',
            ])
            add(Case("huge_string", "plugin_400", body=bad.encode(), headers=tier_headers(rnd)))

    fields = list(WRONG)
    for i in range(1500):
        name = fields[i % len(fields)]
        value = rnd.choice(WRONG[name])
        if name == "prompt":
            body = f'{{"model":"m","prompt":{value},"max_tokens":2}}'
            path = COMPLETIONS
        elif name == "messages":
            body = f'{{"model":"m","messages":{value},"max_tokens":2}}'
            path = CHAT
        else:
            msgs = '[{"role":"user","content":"x"}]'
            if rnd.random() < 0.5:
                body, path = f'{{"{name}":{value},"messages":{msgs}}}', CHAT
            else:
                body, path = f'{{"prompt":"p","{name}":{value}}}', COMPLETIONS
        add(Case("wrong_types", "plugin_400", path=path, body=body.encode(), headers=tier_headers(rnd), param=name))

    bad_bytes = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"]
    for i in range(600):
        bb = rnd.choice(bad_bytes)
        where = i % 6
        msgs = b'[{"role":"user","content":"x"}]'
        body = [
            b'{"messages":[{"role":"user","content":"ok ' + bb + b' ok"}]}',
            b'{"messages":[{"role":"us' + bb + b'er","content":"x"}]}',
            b'{"model":"m' + bb + b'","messages":' + msgs + b"}",
            b'{"user":"' + bb + b'","messages":' + msgs + b"}",
            b'{"messages":' + msgs + b',"tools":[{"t' + bb + b'ype":1}]}',
            b'{"prompt":["a","' + bb + b'"]}',
        ][where]
        add(Case("non_utf8_body", "plugin_400", path=COMPLETIONS if where == 5 else CHAT, body=body,
                 headers=tier_headers(rnd)))

    for i in range(400):
        h = tier_headers(rnd)
        bad = b"v" + bytes(rnd.randint(0x80, 0xFF) for _ in range(rnd.randint(1, 8)))
        name = rnd.choice([b"x-session-id", b"authorization", b"x-llm-tier", b"x-llm-residency", b"user-agent",
                           b"x-llm-pool", b"x-llm-cluster", b"content-type"])
        h = [(k, v) for k, v in h if k != name] + [(name, b"Bearer " + bad if name == b"authorization" else bad)]
        add(Case("non_utf8_header", "ok", body=dumps(valid_chat(rnd, i)), headers=h))

    for i in range(300):
        body = dumps(valid_chat(rnd, i))
        enc = rnd.choice([b"gzip", b"gzip", b"deflate", b"br", b"gzip, identity", b"GZIP"])
        if enc.lower().startswith(b"gzip") and rnd.random() < 0.8:
            body = gzip.compress(body)
        elif enc == b"deflate":
            body = zlib.compress(body)
        elif rnd.random() < 0.5:
            body = bytes(rnd.randint(0, 255) for _ in range(rnd.randint(0, 300)))
        add(Case("compressed", "passthrough", body=body, headers=tier_headers(rnd) + [(b"content-encoding", enc)]))

    for i in range(500):
        if i % 2 == 0:
            body, expect = dumps(valid_chat(rnd, i)), "ok"
        else:
            full = dumps(valid_chat(rnd, i))
            body, expect = full[:rnd.randint(1, len(full) - 1)], "plugin_400"
        add(Case("chunked", expect, body=chunk(body, rnd), headers=tier_headers(rnd), framing="chunked"))
    malformed_chunks = [b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n-1\r\n\r\n", b"ffffffffffffffffff\r\nx\r\n",
                        b"\r\n\r\n", b"0x5\r\nhello\r\n0\r\n\r\n"]
    for i in range(100):
        add(Case("chunked", "envoy_400", body=malformed_chunks[i % len(malformed_chunks)], headers=tier_headers(rnd),
                 framing="chunked"))

    for i in range(300):
        kind = i % 3
        h = tier_headers(rnd)
        if kind == 0:
            add(Case("empty_body", "plugin_400", body=b"", headers=h))
        elif kind == 1:
            add(Case("empty_body", "plugin_400", body=b"", headers=h, framing="none"))
        else:
            add(Case("empty_body", "plugin_400", body=rnd.choice([b" ", b"\r\n\t ", b"\n" * 100]), headers=h))

    paths = [b"/v1/embeddings", b"/v1/models", b"/v2/chat/completions", b"/v1/chat/completions/x", b"/v1/chat",
             b"/V1/CHAT/COMPLETIONS", b"/v1/chat/completions/../completions", b"/v1//chat/completions",
             b"/v1/chat%2Fcompletions", b"/health", b"/metrics", b"/", b"/favicon.ico", b"/v1/responses",
             b"/%00", b"/a?b=c&d", b"/" + b"a" * 4000]
    for i in range(700):
        if i % 2 == 0:
            method = rnd.choice([b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"])
            path = rnd.choice([CHAT, COMPLETIONS, CHAT + b"?q=1"])
        else:
            method = rnd.choice([b"POST", b"GET", b"POST"])
            path = rnd.choice(paths)
        body = dumps(valid_chat(rnd, i)) if method in (b"POST", b"PUT", b"PATCH") else b""
        # Only /v1/ reaches the engines (envoy.yaml); any other path gets
        # Envoy's 404 with an OpenAI error body.
        expect = "passthrough" if path.startswith(b"/v1/") else "not_found_404"
        param = None
        if method == b"POST" and path == b"/v1/responses":
            # The Responses API is read: a chat body there lacks `input`.
            expect, param = "plugin_400", "input"
        add(Case("other_path_or_method", expect, method=method, path=path, body=body,
                 headers=tier_headers(rnd), param=param))
    # The operator endpoint exists (ladder.operator_keys is set): without the
    # operator's token it is refused, whatever the method.
    for i in range(100):
        add(Case("other_path_or_method", "forbidden_403", method=rnd.choice([b"POST", b"GET", b"PUT"]),
                 path=b"/llm-geo-router/ladder" + rnd.choice([b"", b"?x=1"]), body=b'{"level": 5}',
                 headers=tier_headers(rnd) + ([(b"authorization", b"Bearer guess")] if i % 2 else [])))

    for i in range(300):
        body = rnd.choice([b"prompt=hello&max_tokens=1", b"[1,2,3]", b'"a string"', b"null", b"42",
                           bytes(rnd.randint(0, 255) for _ in range(100)).lstrip(b" \t\r\n\x0c{"),
                           b"<xml>" + text(rnd, 5).encode() + b"</xml>"])
        if not body or body[:1] == b"{":
            body = b"x" + body
        add(Case("non_json_body", "passthrough", body=body, headers=tier_headers(rnd)))

    for i in range(30):
        size = LIMIT + rnd.choice([1, 1000, 1 << 20, 4 << 20])
        body = b'{"messages":[{"role":"user","content":"' + b"y" * size + b'"}]}'
        add(Case("over_limit", "envoy_413", body=body, headers=tier_headers(rnd),
                 framing=rnd.choice(["length", "chunked"]) if i % 4 else "length"))
    for c in cases:
        if c.category == "over_limit" and c.framing == "chunked":
            c.body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(c.body), c.body)

    codec = [
        b"FOO /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        b"POST /v1/chat/completions\xff HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\ncontent-length: 0\r\n\r\n",
        b"GARBAGE\r\n\r\n",
    ]
    for i in range(180):
        add(Case("malformed_http", "envoy_400", framing="raw", raw=codec[i % len(codec)]))

    for i in range(150):
        full = dumps(valid_chat(rnd, i))
        h = tier_headers(rnd)
        if i % 3 == 0:
            # The declared length ends the JSON: a valid request, then junk.
            junk, expect = rnd.choice([(b"GARBAGE\r\n\r\n", "lying_short_ok_then_400"),
                                       (b"xyz", "lying_short_ok_then_partial")])
            cut = len(full)
        else:
            cut = rnd.randint(1, len(full) - 1)
            junk, expect = full[cut:] + rnd.choice([b"", b"\r\n\r\n"]), "lying_short_400_then_any"
        add(Case("lying_content_length", expect, body=full[:cut] + junk, lie=-len(junk), headers=h))
    for i in range(150):
        full = dumps(valid_chat(rnd, i))
        add(Case("lying_content_length", "lying_long", body=full, lie=rnd.choice([1, 10, 1000, 1 << 20]),
                 headers=tier_headers(rnd), pause_s=0.3))

    # HTTP/2 (curl, prior knowledge): a mix of the above.
    for i in range(600):
        k = i % 10
        h = tier_headers(rnd)
        if k < 4:
            c = Case("http2", "ok", body=dumps(valid_chat(rnd, i)), headers=h)
        elif k < 7:
            full = dumps(valid_chat(rnd, i))
            c = Case("http2", "plugin_400", body=full[:rnd.randint(1, len(full) - 1)], headers=h)
        elif k == 7:
            c = Case("http2", "passthrough", body=gzip.compress(dumps(valid_chat(rnd, i))),
                     headers=h + [(b"content-encoding", b"gzip")])
        elif k == 8:
            c = Case("http2", "passthrough", method=b"GET", path=b"/v1/models", headers=h)
        else:
            c = Case("http2", "ok", path=COMPLETIONS, body=dumps(valid_completion(rnd, i)), headers=h)
        c.h2 = True
        add(c)
    # Over HTTP/2 the connection buffer limit alone does not bound a stream
    # (Envoy 1.40 buffered, parsed and routed 8 MiB bodies); the buffer
    # filter in envoy.yaml (max_request_bytes 4 MiB) refuses them with 413
    # before the plugin sees them. Much larger bodies may instead see the
    # stream reset.
    for i in range(10):
        size = LIMIT + rnd.choice([1000, 1 << 20, LIMIT])
        add(Case("http2", "envoy_413_or_reset", body=b'{"prompt":"' + b"z" * size + b'"}',
                 path=COMPLETIONS, headers=tier_headers(rnd), h2=True))

    rnd.shuffle(cases)
    return cases


# -------------------------------------------------------------- HTTP/1 client

class Hang(Exception):
    pass


@dataclass
class Resp:
    status: int
    headers: dict
    body: bytes


def parse_one(buf: bytes):
    """(Resp, bytes consumed) for the first complete response in buf, else None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    pos = end + 4
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = []
        while True:
            le = buf.find(b"\r\n", pos)
            if le < 0:
                return None
            size = int(buf[pos:le].split(b";")[0], 16)
            if size == 0:
                te = buf.find(b"\r\n\r\n", le)
                if te < 0 and buf[le:le + 4] != b"\r\n\r\n":
                    return None
                return Resp(status, headers, b"".join(body)), (te if te >= 0 else le) + 4
            if len(buf) < le + 2 + size + 2:
                return None
            body.append(buf[le + 2:le + 2 + size])
            pos = le + 2 + size + 2
    n = int(headers.get("content-length", "0"))
    if len(buf) < pos + n:
        return None
    return Resp(status, headers, buf[pos:pos + n]), pos + n


class Conn:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
        self.sock.setblocking(False)
        self.buf = b""
        self.eof = False
        self.reset = False
        self.unsent = 0
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)

    def close(self):
        self.sel.close()
        self.sock.close()

    def _pump(self, out: bytes, deadline: float, want_response: bool = True):
        """Send `out` while reading; return the first complete response, or
        None at EOF/reset. Raises Hang at the deadline."""
        view, sent = memoryview(out), 0
        while True:
            if want_response:
                got = parse_one(self.buf)
                if got is not None:
                    # Possibly before the whole request was sent (413, 400):
                    # then the connection cannot carry another request.
                    r, n = got
                    self.buf = self.buf[n:]
                    self.unsent = len(out) - sent
                    return r
            if self.eof or self.reset:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise Hang()
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if sent < len(out) else 0)
            self.sel.modify(self.sock, events)
            for _, ev in self.sel.select(min(left, 1.0)):
                if ev & selectors.EVENT_READ:
                    try:
                        data = self.sock.recv(1 << 20)
                    except BlockingIOError:
                        data = None
                    except OSError:
                        self.reset = True
                        data = None
                    if data == b"":
                        self.eof = True
                    elif data:
                        self.buf += data
                if ev & selectors.EVENT_WRITE and sent < len(out):
                    try:
                        sent += self.sock.send(view[sent:sent + (1 << 20)])
                    except BlockingIOError:
                        pass
                    except OSError:
                        sent = len(out)  # peer gone; keep reading what it said
            if not want_response and sent >= len(out):
                return None

    def exchange(self, out: bytes, timeout: float = HANG_S):
        return self._pump(out, time.monotonic() + timeout)

    def quiet_for(self, seconds: float) -> bool:
        """True when nothing arrives and the connection stays open for `seconds`."""
        self.sel.modify(self.sock, selectors.EVENT_READ)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in self.sel.select(max(end - time.monotonic(), 0)):
                return False
        return True

    def half_close_and_wait(self, timeout: float = HANG_S):
        """Shut down writing, then collect everything until Envoy closes.
        Returns the responses; raises Hang if it never closes."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        out = []
        while True:
            r = self._pump(b"", deadline)
            if r is None:
                return out
            out.append(r)


# ------------------------------------------------------------- expectations

def is_openai_error(r: Resp, status: int) -> bool:
    if r.status != status or not r.headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        err = json.loads(r.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(err.get("message")) and "x-engine-replica" not in r.headers


def engine_answered(r: Resp) -> bool:
    return "x-echo-x-llm-cluster" in r.headers


# A request the router did not read says only where it went and why
# (`region=<r>; reason=<why>`); a routed one adds every cost term.
UNREAD_ROUTE = re.compile(r"^region=([a-z0-9_]+); reason=([a-z-]+)$")


def routed_by_cost(route: str) -> bool:
    return "reason=" in route and not UNREAD_ROUTE.match(route)


def check_ok(c: Case, r: Resp) -> str | None:
    if r.status != 200 or not engine_answered(r):
        return f"expected 200 from an engine, got {r.status} {r.body[:200]!r}"
    if not routed_by_cost(r.headers.get("x-llm-route", "")):
        return f"not routed by cost: {r.headers.get('x-llm-route')}"
    return None


def check_routed(c: Case, r: Resp) -> str | None:
    """Valid for the router, routed by cost; the engine's answer is its own."""
    route = r.headers.get("x-llm-route", "")
    if not engine_answered(r) or not routed_by_cost(route):
        return f"expected a routed request answered by an engine, got {r.status} {route!r}"
    return None


def check_plugin_400(c: Case, r: Resp) -> str | None:
    if not is_openai_error(r, 400):
        return f"expected the plugin's 400, got {r.status} {r.body[:200]!r}"
    err = json.loads(r.body)["error"]
    if err.get("type") != "invalid_request_error" or err.get("code") != "invalid_request":
        return f"wrong error: {err}"
    if c.param and err.get("param") != c.param:
        return f"param {err.get('param')!r}, expected {c.param!r}: {err['message']}"
    return None


def check_passthrough(c: Case, r: Resp) -> str | None:
    """Not read by the router: sent, untouched, to the routable region the
    unread rule chose (every region is healthy here), and answered there."""
    m = UNREAD_ROUTE.match(r.headers.get("x-llm-route", ""))
    if not m or m.group(2) not in ("rtt", "load", "spread", "pin"):
        return f"decision {r.headers.get('x-llm-route')!r}"
    # The engine names itself on its 200s (its error answers do not); the
    # cluster header is removed before the upstream, so the echo is "-".
    replica = re.sub(r"-\d+$", "", r.headers.get("x-engine-replica", m.group(1)))
    if not engine_answered(r) or replica != m.group(1) or r.headers.get("x-echo-x-llm-cluster") != "-":
        return f"expected the engine at region_{m.group(1)}, got {r.status} {r.headers}"
    return None


def check_prompt_cap(c: Case, r: Resp) -> str | None:
    if not is_openai_error(r, 413) or json.loads(r.body)["error"].get("code") != "context_length_exceeded":
        return f"expected the guard's 413, got {r.status} {r.body[:200]!r}"
    return None


def check_envoy(status: int):
    def check(c: Case, r: Resp) -> str | None:
        if r.status != status or engine_answered(r) or "x-llm-route" in r.headers:
            return f"expected Envoy's {status}, got {r.status} {r.headers}"
        return None
    return check


def check_not_found(c: Case, r: Resp) -> str | None:
    if not is_openai_error(r, 404) or engine_answered(r) or json.loads(r.body)["error"].get("code") != "not_found":
        return f"expected Envoy's 404, got {r.status} {r.headers} {r.body[:200]!r}"
    return None


def check_forbidden(c: Case, r: Resp) -> str | None:
    if not is_openai_error(r, 403) or json.loads(r.body)["error"].get("code") != "forbidden":
        return f"expected the guard's 403, got {r.status} {r.body[:200]!r}"
    return None


CHECKS = {
    "ok": check_ok,
    "routed": check_routed,
    "plugin_400": check_plugin_400,
    "passthrough": check_passthrough,
    "prompt_cap_413": check_prompt_cap,
    "envoy_413": check_envoy(413),
    # The router may have read the body and chosen a region first (see above).
    "envoy_413_or_reset": lambda c, r: None if r.status == 413 and not engine_answered(r) else f"got {r.status}",
    "envoy_400": check_envoy(400),
    "forbidden_403": check_forbidden,
    "not_found_404": check_not_found,
}


@dataclass
class Outcome:
    category: str
    status: str  # HTTP status, or "closed" / "hang" / "sequence"
    ms: float
    error: str | None = None


def run_h1(c: Case, conn_box: list, port: int) -> Outcome:
    """One case over HTTP/1.1: on the thread's keep-alive connection when the
    framing allows it, else on its own connection."""
    t0 = time.monotonic()
    own = c.framing == "raw" or c.expect.startswith("lying") or c.expect.startswith("envoy")
    conn = Conn(port) if own else conn_box[0]
    try:
        if c.expect == "lying_long":
            conn._pump(wire(c), time.monotonic() + HANG_S, want_response=False)
            quiet = conn.quiet_for(c.pause_s)
            after = conn.half_close_and_wait()
            ms = (time.monotonic() - t0) * 1000
            if not quiet:
                return Outcome(c.category, "answered-early", ms, "Envoy answered before the declared body arrived")
            st = "closed" if not after else "+".join(str(r.status) for r in after)
            return Outcome(c.category, st, ms, None if not after else f"unexpected answers {[r.status for r in after]}")
        if c.expect.startswith("lying_short"):
            first = conn.exchange(wire(c))
            rest = conn.half_close_and_wait()
            ms = (time.monotonic() - t0) * 1000
            seq = [r.status for r in ([first] if first else []) + rest]
            st = "+".join(map(str, seq)) + "+closed"
            if first is None:
                return Outcome(c.category, st, ms, "no answer to the declared body")
            if c.expect in ("lying_short_ok_then_400", "lying_short_ok_then_partial"):
                err = check_ok(c, first)
                # The excess is the next request: Envoy refuses it (400), or
                # closes first when it sees the client's FIN before parsing it.
                if not err and c.expect == "lying_short_ok_then_400" and [r.status for r in rest] not in ([400], []):
                    err = f"excess bytes answered: {seq}"
                if not err and c.expect == "lying_short_ok_then_partial" and rest:
                    err = f"partial request answered: {seq}"
            else:
                err = check_plugin_400(c, first) or (None if all(r.status == 400 for r in rest)
                                                     else f"excess answered: {seq}")
            return Outcome(c.category, st, ms, err)
        data = c.raw if c.framing == "raw" else wire(c)
        r = conn.exchange(data)
        ms = (time.monotonic() - t0) * 1000
        if r is None and not own and conn.buf == b"":
            # The keep-alive connection was closed by Envoy after the last
            # answer (connection: close): one retry on a new connection.
            conn_box[0].close()
            conn = conn_box[0] = Conn(port)
            r = conn.exchange(data)
            ms = (time.monotonic() - t0) * 1000
        if r is None:
            return Outcome(c.category, "closed", ms, "closed without an answer")
        err = CHECKS[c.expect](c, r)
        if not own and (r.headers.get("connection", "").lower() == "close" or conn.eof or conn.reset
                        or conn.unsent):
            conn_box[0].close()
            conn_box[0] = Conn(port)
        return Outcome(c.category, str(r.status), ms, err)
    except Hang:
        if not own:
            conn_box[0].close()
            conn_box[0] = Conn(port)
        return Outcome(c.category, "hang", (time.monotonic() - t0) * 1000, "no answer within 10 s")
    finally:
        if own:
            conn.close()


# -------------------------------------------------------------- HTTP/2 (curl)

def run_h2(cases: list[Case], port: int, run_dir, tag: str) -> list[Outcome]:
    """All cases in one curl process, multiplexed over HTTP/2 prior knowledge."""
    d = run_dir / f"h2-{tag}"
    d.mkdir()
    lines = []
    names = ["x-echo-x-llm-cluster", "x-llm-route", "content-type", "x-engine-replica"]
    fmt = "%{urlnum} %{http_code} %{time_total}" + "".join(f" [%header{{{n}}}]" for n in names) + "\\n"
    for i, c in enumerate(cases):
        (d / f"{i}.body").write_bytes(c.body)
        # One host name per transfer, so that curl never reuses a connection:
        # curl 7.88.1 fails every reused prior-knowledge HTTP/2 connection
        # ("Error in the HTTP2 framing layer", curl/curl#10634).
        lines.append(f'url = "http://h{tag}-{i}.hostile:{port}{c.path.decode()}"')
        lines.append(f'resolve = "h{tag}-{i}.hostile:{port}:127.0.0.1"')
        lines.append("http2-prior-knowledge")
        lines.append(f'request = "{c.method.decode()}"')
        if c.body:
            lines.append(f'data-binary = "@{d / f"{i}.body"}"')
        for k, v in c.headers:
            lines.append(f'header = "{k.decode()}: {v.decode()}"')
        lines.append(f'output = "{d / f"{i}.out"}"')
        lines.append(f'write-out = "{fmt}"')
        lines.append("max-time = 10")
        lines.append("next")
    (d / "curl.cfg").write_text("\n".join(lines[:-1]) + "\n")
    t0 = time.monotonic()
    p = subprocess.run(["curl", "-s", "-Z", "--parallel-max", "32", "-K", str(d / "curl.cfg")],
                       capture_output=True, text=True, timeout=120)
    wall = (time.monotonic() - t0) * 1000
    out = []
    seen = set()
    for line in p.stdout.splitlines():
        num, code, secs, rest = line.split(" ", 3)
        i = int(num)
        seen.add(i)
        c = cases[i]
        values = rest[1:-1].split("] [")
        body = (d / f"{i}.out").read_bytes() if (d / f"{i}.out").exists() else b""
        headers = {n: v for n, v in zip(names, values) if v}
        ms = float(secs) * 1000
        # Envoy answers 413 and resets the stream while curl is still sending
        # the body: curl may report the reset instead of the 413.
        if code == "000" and c.expect == "envoy_413_or_reset" and float(secs) < HANG_S - 0.1:
            out.append(Outcome(c.category, "reset", ms))
            continue
        if code == "000":
            out.append(Outcome(c.category, "hang" if float(secs) >= 9.9 else "closed", ms, f"curl: no answer ({secs} s)"))
            continue
        r = Resp(int(code), headers, body)
        out.append(Outcome(c.category, code, ms, CHECKS[c.expect](c, r)))
    for i, c in enumerate(cases):
        if i not in seen:
            out.append(Outcome(c.category, "closed", wall, "curl reported nothing"))
    return out


# ------------------------------------------------------------------- stats

def wasm_stats(envoy) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/stats?filter=^wasm\\.", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            k, _, v = line.partition(": ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def test_hostile_requests(fleet_factory, run_dir):
    # Fast engines (the point is Envoy and the plugin, not prefill), and the
    # ladder held at level 2 so that the guard parses every free-tier body
    # too (and clamps max_tokens) while the router parses every body.
    # Engines with a long context (3 MB of text is about 1.4M of their
    # tokens): the huge valid prompts are here to cross Envoy and the
    # plugin, and the engine answers them. A 32k engine refuses them in its
    # own words (the emulator's tests cover that).
    fast = ["--max-concurrency", "64", "--prefill-ms-per-token", "0.0005", "--decode-ms-per-token", "0.05",
            "--max-model-len", "4000000"]
    # The probe at its shipped period and timeout (1 s): the run saturates
    # both cores with its own 24 threads, and a 300 ms health timeout then
    # measures this machine, not the regions (every region was marked
    # unhealthy for a moment in most runs, and unread requests went by
    # `fallback`, for the module before this change as well).
    fleet = fleet_factory({"probe": {"tick_ms": TICK_MS, "timeout_ms": TICK_MS, "snapshot_max_age_ms": 3000},
                           "ladder": {"forced_level": 2}},
                          engine_extra={n: fast for n in harness.DEMO_REGIONS})
    envoy = fleet.envoy
    deadline = time.time() + 10 + harness.STALL_S
    while envoy.stat("wasmcustom.llm_geo_router.ladder.level") != 2 and time.time() < deadline:
        time.sleep(0.05)
    assert envoy.stat("wasmcustom.llm_geo_router.ladder.level") == 2
    port = fleet.port
    cases = gen_cases()
    h1 = [c for c in cases if not c.h2]
    h2 = [c for c in cases if c.h2]
    wasm_before = wasm_stats(envoy)
    snapshot_before = envoy.stat("wasmcustom.llm_geo_router.probe.snapshot_version")

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    cursor = iter(range(len(h1)))

    def worker():
        box = [Conn(port)]
        mine = []
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                break
            try:
                mine.append(run_h1(h1[i], box, port))
            except Exception as e:  # a client-side failure must show, not vanish
                mine.append(Outcome(h1[i].category, "client-error", 0.0, repr(e)))
                box[0].close()
                box[0] = Conn(port)
        box[0].close()
        with lock:
            outcomes.extend(mine)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    h2_out = []
    h2_threads = [threading.Thread(target=lambda part=part, k=k: h2_out.extend(run_h2(part, port, run_dir, str(k))))
                  for k, part in enumerate([h2[j::2] for j in range(2)])]
    for t in h2_threads:
        t.start()
    for t in threads + h2_threads:
        t.join(timeout=300)
    wall_s = time.monotonic() - t0
    outcomes.extend(h2_out)

    # Summary: category -> status counts and p99 latency.
    by_cat: dict[str, Counter] = defaultdict(Counter)
    lat: dict[str, list] = defaultdict(list)
    errors: dict[str, list] = defaultdict(list)
    for o in outcomes:
        by_cat[o.category][o.status] += 1
        lat[o.category].append(o.ms)
        if o.error:
            errors[o.category].append(f"{o.status}: {o.error}")
    hangs = sum(c["hang"] for c in by_cat.values())
    traps = harness.traps(envoy)
    wasm_after = wasm_stats(envoy)
    stats = envoy.stats()
    plugin_400 = stats.get("wasmcustom.llm_geo_router.router.invalid_request", 0) + stats.get(
        "wasmcustom.llm_geo_router.guard.invalid_request", 0)

    # Still healthy and routing afterwards (the probe has run since).
    harness.wait_ticks(envoy, 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/ready", timeout=5) as r:
        ready = r.status
    after = [harness.chat(port, [{"role": "user", "content": f"after the storm {i}"}], timeout=10) for i in range(20)]
    snapshot_after = envoy.stat("wasmcustom.llm_geo_router.probe.snapshot_version")

    rows = []
    for cat in sorted(by_cat):
        rows.append({"category": cat, "sent": sum(by_cat[cat].values()),
                     "statuses": dict(sorted(by_cat[cat].items())), "p99_ms": round(p99(lat[cat]), 1),
                     "max_ms": round(max(lat[cat]), 1), "unexpected": len(errors.get(cat, []))})
    wasm_delta = {k: wasm_after.get(k, 0) - wasm_before.get(k, 0) for k in sorted(set(wasm_before) | set(wasm_after))}
    summary = {
        "command": ".venv/bin/python -m pytest wasm-tests/test_hostile.py -v -p no:cacheprovider",
        "seed": SEED, "requests": len(outcomes), "http1": len(h1), "http2": len(h2), "threads": THREADS,
        "wall_s": round(wall_s, 1), "traps": len(traps), "hangs": hangs,
        "hang_timeout_s": HANG_S, "wasm_stats_delta": wasm_delta,
        "wasm_stats_after": {k: v for k, v in wasm_after.items() if "vm" in k or "runtime" in k},
        "plugin_invalid_request_counters": plugin_400,
        "ready_after": ready, "after_statuses": Counter(r.status for r in after),
        "snapshot_versions_during_run": snapshot_after - snapshot_before,
        "categories": rows,
        "unexpected_examples": {k: v[:5] for k, v in errors.items()},
    }
    (harness.RUNS / "hostile.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\n{len(outcomes)} requests in {wall_s:.1f} s, {THREADS} HTTP/1.1 threads + 2 curl HTTP/2 processes; "
          f"traps {len(traps)}, hangs {hangs}")
    print(f"{'category':24} {'sent':>6}  {'p99 ms':>8}  statuses")
    for row in rows:
        st = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
        print(f"{row['category']:24} {row['sent']:>6}  {row['p99_ms']:>8.1f}  {st}")
    print("wasm stats delta:", {k: v for k, v in wasm_delta.items() if v})

    assert len(outcomes) == len(cases) >= 10_000
    assert not traps, traps[:5]
    assert hangs == 0, {k: v[:3] for k, v in errors.items()}
    assert not errors, {k: (len(v), v[:5]) for k, v in errors.items()}
    # No VM was lost or reloaded: the same VMs served the whole run.
    for k, v in wasm_delta.items():
        if "vm_reload" in k or k.endswith(".created") or k.endswith("wasm_vm_count") or k.endswith(".active"):
            assert v == 0, (k, v)
    # Every plugin 400 was counted by the filter that sent it.
    expected_400 = sum(1 for c in cases if c.expect == "plugin_400") + sum(
        1 for c in cases if c.expect == "lying_short_400_then_any")
    assert plugin_400 == expected_400, (plugin_400, expected_400)
    assert ready == 200
    assert all(r.status == 200 and r.replica for r in after), [(r.status, r.body[:100]) for r in after]
    assert snapshot_after - snapshot_before >= wall_s / (TICK_MS / 1000) * 0.5, "the probe stalled during the run"
    # No latency bound beyond the hang bound (hangs == 0 above): the p99s are
    # printed, not asserted, since on a busy 2-core machine the largest
    # bodies' p99 ranged 1.8 to 7.6 s between runs of the same module.
