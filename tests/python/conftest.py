"""Starts a real `mtpx serve` on the generated test model for the openai-SDK suite.

The binary is $MTPX_BIN (default: target/release/mtpx). Each fixture writes the test model
with `mtpx make-test-model`, starts the server on a free loopback port, waits for
`/health` to answer 200, and at the end sends SIGTERM and checks the exit status is 0
(graceful shutdown).
"""

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
MTPX_BIN = os.environ.get("MTPX_BIN", str(ROOT / "target" / "release" / "mtpx"))
WINDOW = 4096
MODEL = "test-model"
# The test model's last 9 token ids are special (end-of-turn and tags); banning them keeps
# reply lengths exact.
BAN_SPECIALS = {str(i): -100 for i in range(503, 512)}
# The `read` tool's parameters, as both APIs' tool definitions carry them.
READ_PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}},
    "required": ["path"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mtpx serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"mtpx serve was not healthy after {timeout} s:\n{log.read_text()}")


@pytest.fixture(scope="session")
def test_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model")
    subprocess.run([MTPX_BIN, "make-test-model", "--out", str(out)], check=True, capture_output=True)
    return out / "test-model.gguf"


def start_server(model: Path, log: Path, *extra: str, port: int | None = None):
    port = port or free_port()
    args = [
        MTPX_BIN, "serve", "--model", str(model), "--port", str(port),
        "--context-window", str(WINDOW), "--kv-dtype", "f32",
        *([] if "--kv-memory" in extra else ["--kv-memory", "64MiB"]),
        # Each server its own session store: one run's sessions must not resume in the next.
        *([] if "--session-dir" in extra else ["--session-dir", tempfile.mkdtemp(prefix="mtpx-sessions-")]),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "MTPX_API_KEY"}
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
    except Exception:
        proc.kill()
        raise
    return proc, url


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("mtpx serve did not stop within 30 s of SIGTERM")
    assert code == 0, f"mtpx serve exited with {code} after SIGTERM:\n{log.read_text()}"


@pytest.fixture(scope="session")
def server_url(test_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc, url = start_server(test_model, log)
    yield url
    stop_server(proc, log)


@pytest.fixture(scope="session")
def keyed_server_url(test_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve-keyed.log"
    proc, url = start_server(test_model, log, "--api-key", "sekret")
    yield url
    stop_server(proc, log)


@pytest.fixture(scope="session")
def strict_server_url(test_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve-strict.log"
    proc, url = start_server(test_model, log, "--strict-max-tokens")
    yield url
    stop_server(proc, log)


@pytest.fixture()
def client(server_url) -> OpenAI:
    return OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
