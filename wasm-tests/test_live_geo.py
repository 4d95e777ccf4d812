"""The several-vantage live benchmark's WAN (wasm-tests/bench_live_geo.py):
its generated Envoy config loads in real Envoy, a (vantage, region) listener
makes the region's emulator delay the answer by that vantage's round trip
(the listener sets x-client-region, overwriting what the client sent), and a
hop listener delays every request by its fixed round trip (fault filter)."""

import bench_live_geo as blg
import harness

FLEET = {"client_regions": ["far", "near"],
         "regions": [{"name": "r1", "rtt_ms": {"far": 150, "near": 0}, "max_concurrency": 2,
                      "prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0, "cache_tokens": 1000}]}


def ttfb(port: int, headers: dict | None = None) -> float:
    r = harness.request(port, "GET", "/health", headers=headers)
    assert r.status == 200, (r.status, r.body)
    return r.ttfb_ms


def test_wan_envoy_delays_by_vantage(run_dir):
    geo = blg.Geo(FLEET, intra_region_ms=1.0)
    engines = blg.start_region_engines(run_dir, geo, 1.0)
    wan = None
    try:
        # The hop's upstream is the emulator itself, reached without the
        # header: its own delay is 0, so all the delay is the fault filter's.
        hops = [{"router": "g", "client": "far", "delay_ms": 120.0, "port": engines["r1"].port}]
        wan, lanes, hop_ports = blg.start_wan(run_dir, engines, geo.clients, hops)
        # Twice: the first request also opens the upstream connection (the
        # bounds leave room for it); every one is checked.
        for i in range(2):
            far = ttfb(lanes["far", "r1"])
            # A client that claims to be near does not get near's delay
            # through far's listener, and the other way round.
            far_spoofed = ttfb(lanes["far", "r1"], {"x-client-region": "near"})
            near = ttfb(lanes["near", "r1"], {"x-client-region": "far"})
            hop = ttfb(hop_ports["g", "far"])
            assert 145 <= far < 1000, (i, far)
            assert 145 <= far_spoofed < 1000, (i, far_spoofed)
            assert near < 100, (i, near)
            assert 115 <= hop < 1000, (i, hop)
        assert engines["r1"].stats()["requests"]["/health"] == 8
    finally:
        if wan is not None:
            wan.stop()
        for e in engines.values():
            e.kill()
