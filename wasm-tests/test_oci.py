"""The OCI image (oci/Dockerfile), built and pulled for real: Debian's
buildah builds it from the built module without a Docker daemon, pushes it
to Debian's docker-registry (the CNCF distribution registry) on a loopback
port, and the image is read back over the registry API with the Accept
header an OCI client such as istio-agent sends. test_istio.py checks the
Dockerfile's text; this checks what a registry serves from it.

buildah and docker-registry are installed by scripts/setup; without them
the test fails, as the Prometheus tests do without Prometheus.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request

import pytest
import yaml

import harness

NAME = "llm-geo-router"
TAG = "test"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# What go-containerregistry (istio-agent's puller) accepts: given all four,
# a registry holding an index would serve the index.
ACCEPT = ", ".join([OCI_MANIFEST, "application/vnd.oci.image.index.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json",
                    "application/vnd.docker.distribution.manifest.list.v2+json"])
TIMEOUT = 120


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"missing {name}: run scripts/setup (it installs buildah and docker-registry)", pytrace=False)
    return path


@pytest.fixture
def registry(run_dir):
    """docker-registry on a free loopback port, plain HTTP, no auth, its
    storage and log in run_dir; its port."""
    binary = tool("docker-registry")
    port = harness.free_port()
    config = {"version": 0.1, "log": {"level": "info"},
              "storage": {"filesystem": {"rootdirectory": str(run_dir / "registry")}},
              "http": {"addr": f"127.0.0.1:{port}"}}
    config_path = run_dir / "registry.yml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = run_dir / "registry.log"
    proc = subprocess.Popen([binary, "serve", str(config_path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), cwd=run_dir)
    try:
        harness.wait_http_ok("docker-registry", proc, f"http://127.0.0.1:{port}/v2/", log_path, time.time() + 30)
        yield port
    finally:
        harness.terminate(proc)


@pytest.fixture
def buildah(run_dir):
    """Runs buildah with its own storage in run_dir, removed at teardown.
    vfs and chroot isolation: no overlay mounts and no OCI runtime, which
    containers (such as this project's machines) may not allow."""
    binary = tool("buildah")
    storage = run_dir / "buildah"
    tmp = storage / "tmp"
    tmp.mkdir(parents=True)
    flags = ["--root", str(storage / "root"), "--runroot", str(storage / "runroot"), "--storage-driver", "vfs"]
    # containers/image stages blobs in TMPDIR (/var/tmp by default).
    env = {**os.environ, "TMPDIR": str(tmp)}

    def run(*args: str) -> str:
        r = subprocess.run([binary, *flags, *args], cwd=harness.ROOT, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, f"buildah {' '.join(args)}: {r.stderr[-2000:]}"
        return r.stdout

    yield run
    shutil.rmtree(storage, ignore_errors=True)


def get(port: int, path: str, accept: str | None = None) -> tuple[bytes, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/{NAME}/{path}",
                                 headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read(), r.headers


def blob(port: int, descriptor: dict) -> bytes:
    data, _ = get(port, f"blobs/{descriptor['digest']}")
    assert "sha256:" + hashlib.sha256(data).hexdigest() == descriptor["digest"]
    assert len(data) == descriptor["size"]
    return data


def test_the_image_a_registry_serves_holds_plugin_wasm_alone(buildah, registry, run_dir):
    local = f"localhost/{NAME}:{TAG}"
    buildah("bud", "--isolation", "chroot", "--format", "oci", "-f", "oci/Dockerfile", "-t", local, ".")
    digestfile = run_dir / "pushed.digest"
    buildah("push", "--tls-verify=false", "--digestfile", str(digestfile), local,
            f"docker://127.0.0.1:{registry}/{NAME}:{TAG}")

    body, headers = get(registry, f"manifests/{TAG}", ACCEPT)
    # One image manifest, not an index: istio-agent compares the digest of
    # the image manifest it resolves with the EnvoyFilters' sha256.
    assert headers["Content-Type"] == OCI_MANIFEST
    manifest = json.loads(body)
    assert manifest["mediaType"] == OCI_MANIFEST
    # The digest operators pin (docs/INSTALL.md, "Publish the module") is the
    # one the registry serves, and buildah's --digestfile names the same.
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    assert headers["Docker-Content-Digest"] == digest
    assert digestfile.read_text().strip() == digest

    (layer,) = manifest["layers"]
    data = blob(registry, layer)
    media = layer["mediaType"]
    assert media in ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip"), media
    tar_bytes = gzip.decompress(data) if media.endswith("+gzip") else data
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
        members = tar.getmembers()
        assert [(m.name, m.isfile()) for m in members] == [("plugin.wasm", True)]
        assert tar.extractfile(members[0]).read() == harness.WASM.read_bytes()

    config = json.loads(blob(registry, manifest["config"]))
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    # A puller checks the uncompressed layer against the config's diff_ids.
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
