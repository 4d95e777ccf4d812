"""pytest fixtures for the real-Envoy suite. `scripts/test` builds the .wasm
and the emulator before pytest runs; these fixtures start and always stop
the processes a test needs."""

import pytest

import harness


def pytest_sessionstart(session):
    missing = [p for p in (harness.WASM, harness.EMULATOR, harness.ENVOY) if not p.exists()]
    if missing:
        raise pytest.UsageError(f"missing {', '.join(map(str, missing))}: run scripts/test (it builds them)")


@pytest.fixture
def run_dir(request):
    return harness.fresh_run_dir(request.node.name)


@pytest.fixture
def fleet_factory(run_dir):
    """Starts fleets (harness.Fleet.start's arguments, e.g. replicas={"near": 3}
    and prometheus=True) and stops every process of each, its Prometheus
    included, when the test ends, whether it passed or not."""
    started = []

    def make(overrides=None, engine_extra=None, envoys=1, fallback=False, envoy_edit=None, **kwargs):
        f = harness.Fleet(run_dir)
        started.append(f)
        try:
            return f.start(overrides, engine_extra, envoys, fallback, envoy_edit, **kwargs)
        except BaseException:
            f.stop()
            raise

    yield make
    for f in started:
        f.stop()


@pytest.fixture
def fleet(fleet_factory):
    """The demo fleet with a faster probe tick (300 ms) so tests run quickly."""
    return fleet_factory({"probe": {"tick_ms": 300, "timeout_ms": 300, "snapshot_max_age_ms": 3000}})
