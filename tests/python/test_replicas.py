"""mtpx replicas behind real routers, on loopback: vllm-router (from PyPI) and nginx (apt) with
the repository's own deploy/nginx/mtpx.conf.

Every replica serves the generated test model and shares one session directory, as
docs/deploy.md describes. The tests check what a team's agents see through the router: a
session's turns stick to one replica and reuse its K/V, streams arrive as they are generated,
Responses chains continue on any replica, the Responses WebSocket and Anthropic's route pass
through nginx, and a replica killed under load costs its sessions at most one failed request
before they continue on the survivors from the shared directory.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import pytest
from openai import OpenAI

from conftest import BAN_SPECIALS, MODEL, ROOT, free_port, start_server, stop_server

ROUTER_BIN = str(Path(sys.executable).parent / "vllm-router")
NGINX_CONF = ROOT / "deploy" / "nginx" / "mtpx.conf"
KEY = "replica-key"


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def metric(url: str, name: str) -> float:
    for line in get(f"{url}/metrics").decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in {url}/metrics")


def prompt_counts(urls) -> list:
    return [metric(u, "mtpx_prompt_tokens_total") for u in urls]


def served_by(urls, before) -> int:
    """The one replica whose prompt-token counter moved since `before` (requests sent one at a
    time)."""
    moved = [i for i, (a, b) in enumerate(zip(prompt_counts(urls), before)) if a > b]
    assert len(moved) == 1, f"expected one replica to serve the request, got {moved}"
    return moved[0]


def wait_until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Replicas:
    """N `mtpx serve` processes on one shared session directory."""

    def __init__(self, model: Path, logs: Path, n: int, *extra: str):
        self.model, self.logs, self.extra = model, logs, extra
        self.sessions = tempfile.mkdtemp(prefix="mtpx-shared-sessions-")
        self.procs, self.urls = [], []
        for i in range(n):
            proc, url = self._start(i)
            self.procs.append(proc)
            self.urls.append(url)

    def _start(self, i: int, port: int | None = None):
        return start_server(self.model, self.log(i), "--session-dir", self.sessions, *self.extra, port=port)

    def log(self, i: int) -> Path:
        return self.logs / f"replica-{i}.log"

    def kill(self, i: int):
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def restart(self, i: int):
        port = int(self.urls[i].rsplit(":", 1)[1])
        self.procs[i], url = self._start(i, port)
        assert url == self.urls[i]

    def stop(self):
        """SIGTERM to each (each must exit 0), every one stopped even when one fails."""
        failed = []
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    stop_server(proc, self.log(i))
                except AssertionError as e:
                    failed.append(e)
        shutil.rmtree(self.sessions, ignore_errors=True)
        assert not failed, failed


@pytest.fixture(scope="module")
def replicas(test_model, tmp_path_factory):
    r = Replicas(test_model, tmp_path_factory.mktemp("replicas"), 3)
    yield r
    r.stop()


class Router:
    def __init__(self, worker_urls, log: Path, policy: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [
                ROUTER_BIN, "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *worker_urls, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                # A dead replica is noticed within a second.
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--log-level", "warning",
                # A restarted replica gets traffic again within a second.
                "--cb-timeout-duration-secs", "1",
            ],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        wait_until("vllm-router to list every worker healthy", lambda: self.healthy() == set(worker_urls))

    def healthy(self) -> set:
        if self.proc.poll() is not None:
            raise AssertionError(f"vllm-router exited:\n{self.log.read_text()}")
        try:
            workers = json.loads(get(f"{self.url}/workers"))["workers"]
        except (urllib.error.URLError, ConnectionError, OSError, KeyError, ValueError):
            return set()
        return {w["url"] for w in workers if w["is_healthy"]}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = Router(replicas.urls, tmp_path_factory.mktemp("router") / "router.log", "consistent_hash")
    yield r
    r.stop()


class Nginx:
    """nginx running deploy/nginx/mtpx.conf, its ports pointed at `worker_urls`."""

    def __init__(self, worker_urls, prefix: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = NGINX_CONF.read_text()
        servers = re.findall(r"server 127\.0\.0\.1:(\d+)", conf)
        assert len(servers) == len(worker_urls), "deploy/nginx/mtpx.conf names three replicas"
        for port, url in zip(servers, worker_urls):
            conf = conf.replace(f"127.0.0.1:{port} ", f"{url.removeprefix('http://')} ", 1)
        conf = conf.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{self.port};")
        (prefix / "tmp").mkdir(parents=True, exist_ok=True)
        (prefix / "mtpx.conf").write_text(conf)
        self.log = prefix / "nginx.log"
        self.proc = subprocess.Popen(
            ["nginx", "-p", f"{prefix}/", "-c", str(prefix / "mtpx.conf"), "-g", "daemon off;"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited:\n{self.log.read_text()}")
            try:
                get(f"{self.url}/health")
                return True
            except (urllib.error.URLError, ConnectionError, OSError):
                return False

        wait_until("nginx to answer", up)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def chat_turns(client: OpenAI, urls, session: str, turns: int, words: int = 60):
    """A session of `turns` greedy chat turns sent one at a time; for each turn the replica
    that served it and its usage."""
    messages = [{"role": "user", "content": f"{session} " + "agent reads a file " * words}]
    out = []
    for turn in range(turns):
        before = prompt_counts(urls)
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0,
            logit_bias=BAN_SPECIALS, extra_headers={"X-Session-Id": session},
        )
        out.append((served_by(urls, before), r.usage))
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"turn {turn}: now the next file " * 5},
        ]
    return out


def assert_sticky_and_cached(sessions: dict, n_replicas: int):
    used = set()
    for session, turns in sessions.items():
        where = {replica for replica, _ in turns}
        assert len(where) == 1, f"{session} moved between replicas: {turns}"
        used |= where
        for (_, prev), (_, usage) in zip(turns, turns[1:]):
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= 0.9 * prev.prompt_tokens, (
                f"{session}: {cached} of the previous prompt's {prev.prompt_tokens} tokens reused"
            )
    assert used == set(range(n_replicas)), f"sessions landed on replicas {used} only"


def test_vllm_router_sticks_agent_sessions_and_streams_through(replicas, router):
    client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    sessions = {f"agent-{i}": chat_turns(client, replicas.urls, f"agent-{i}", 4) for i in range(12)}
    assert_sticky_and_cached(sessions, len(replicas.urls))

    assert_streams_as_generated(client, replicas.urls)


def assert_streams_as_generated(client: OpenAI, urls):
    """A stream arrives while it is being generated: after its first token the replica is
    still running it (a proxy that buffered would deliver it only at the end)."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "write at length"}], max_tokens=3000,
        temperature=0, logit_bias=BAN_SPECIALS, stream=True,
        extra_headers={"X-Session-Id": "streamer"},
    )
    chunks = iter(stream)
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    running = sum(metric(u, "mtpx_sequences_running") for u in urls)
    rest = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert first and running == 1, "the first token came through before the reply was done"
    assert rest > 100


def test_responses_chains_continue_through_vllm_router(replicas, router):
    client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    # With a key the router hashes (`user`), a chain sticks to one replica and reuses its K/V.
    prev, where = None, set()
    for turn in range(4):
        before = prompt_counts(replicas.urls)
        r = client.responses.create(
            model=MODEL, input=f"turn {turn}: " + "read the file " * 30, max_output_tokens=8,
            user="chain-owner", previous_response_id=prev,
        )
        where.add(served_by(replicas.urls, before))
        if prev:
            assert r.usage.input_tokens_details.cached_tokens >= 0.9 * last.usage.input_tokens
        prev, last = r.id, r
    assert len(where) == 1
    # Without one the router spreads a chain's turns (it hashes the body): every turn still
    # resolves its previous response, from the shared directory.
    prev, where = None, set()
    for turn in range(6):
        before = prompt_counts(replicas.urls)
        r = client.responses.create(
            model=MODEL, input=f"keyless turn {turn}", max_output_tokens=4, previous_response_id=prev
        )
        assert r.status in ("completed", "incomplete")  # (the length limit)
        where.add(served_by(replicas.urls, before))
        prev = r.id
    assert len(where) > 1, "the keyless chain happened to stay on one replica"


def test_cache_aware_routing_reuses_prefixes_without_any_key(replicas, tmp_path):
    router = Router(replicas.urls, tmp_path / "router.log", "cache_aware")
    try:
        client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for c in range(3):
            messages = [{"role": "user", "content": f"keyless conversation {c} " + "lorem ipsum " * 80}]
            prev = None
            for turn in range(3):
                r = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=6, temperature=0, logit_bias=BAN_SPECIALS
                )
                if prev:
                    assert r.usage.prompt_tokens_details.cached_tokens >= 0.8 * prev.prompt_tokens
                prev = r.usage
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "and more"},
                ]
    finally:
        router.stop()


@pytest.fixture(scope="module")
def keyed_replicas(test_model, tmp_path_factory):
    r = Replicas(test_model, tmp_path_factory.mktemp("keyed-replicas"), 3, "--api-key", KEY)
    yield r
    r.stop()


def test_nginx_config_sticks_sessions_and_passes_websockets_and_messages(keyed_replicas, tmp_path):
    import asyncio

    import websockets

    nginx = Nginx(keyed_replicas.urls, tmp_path / "nginx")
    try:
        client = OpenAI(base_url=f"{nginx.url}/v1", api_key=KEY, max_retries=0)
        sessions = {f"n-{i}": chat_turns(client, keyed_replicas.urls, f"n-{i}", 3) for i in range(9)}
        assert_sticky_and_cached(sessions, len(keyed_replicas.urls))
        assert_streams_as_generated(client, keyed_replicas.urls)
        # The key is checked by the replica: nginx passes Authorization through.
        bad = OpenAI(base_url=f"{nginx.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(Exception) as refused:
            bad.models.list()
        assert getattr(refused.value, "status_code", None) == 401

        # Anthropic's route, two turns of one session.
        claude = anthropic.Anthropic(base_url=nginx.url, api_key=KEY, max_retries=0)
        messages = [{"role": "user", "content": "hello over nginx " * 30}]
        first = claude.messages.create(
            model=MODEL, max_tokens=6, messages=messages, extra_headers={"X-Session-Id": "claude-1"}
        )
        messages += [
            {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": "again"},
        ]
        second = claude.messages.create(
            model=MODEL, max_tokens=6, messages=messages, extra_headers={"X-Session-Id": "claude-1"}
        )
        assert second.usage.cache_read_input_tokens >= 0.9 * first.usage.input_tokens

        # The Responses WebSocket: two turns on one connection, the second continuing the first.
        async def socket_turns():
            ws_url = nginx.url.replace("http://", "ws://") + "/v1/responses"
            headers = {"Authorization": f"Bearer {KEY}"}
            async with websockets.connect(ws_url, additional_headers=headers) as ws:
                done = []
                for turn in range(2):
                    create = {"type": "response.create", "model": MODEL,
                              "input": f"socket turn {turn} " * 20, "max_output_tokens": 6}
                    if done:
                        create["previous_response_id"] = done[-1]["id"]
                    await ws.send(json.dumps(create))
                    while True:
                        event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                        assert event["type"] != "error", event
                        if event["type"] in ("response.completed", "response.incomplete"):
                            done.append(event["response"])
                            break
                return done

        done = asyncio.run(socket_turns())
        assert done[1]["usage"]["input_tokens_details"]["cached_tokens"] >= done[0]["usage"]["input_tokens"]
    finally:
        nginx.stop()


LOAD_SECONDS = float(os.environ.get("MTPX_ROUTER_LOAD_SECONDS", "20"))


def test_a_replica_killed_under_load_costs_its_sessions_one_request_each(test_model, tmp_path):
    """8 clients, 2 sessions each, for LOAD_SECONDS through vllm-router; one replica is killed
    with SIGKILL a third of the way in and restarted at two thirds."""
    reps = Replicas(test_model, tmp_path, 3)
    router = Router(reps.urls, tmp_path / "router.log", "consistent_hash")
    try:
        client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        sessions = [f"load-{i}" for i in range(16)]
        owner = {}
        conversations = {}
        for s in sessions:
            messages = [{"role": "user", "content": f"{s} " + "the agent's first read " * 40}]
            before = prompt_counts(reps.urls)
            r = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0,
                logit_bias=BAN_SPECIALS, extra_headers={"X-Session-Id": s},
            )
            owner[s] = served_by(reps.urls, before)
            conversations[s] = messages + [{"role": "assistant", "content": r.choices[0].message.content}]
        victim = owner[sessions[0]]
        victim_url = reps.urls[victim]
        results = []  # (session, ok, time, cached tokens or error)
        lock = threading.Lock()
        killed = threading.Event()
        stop = threading.Event()

        errors = []

        def client_loop(mine):
            try:
                run_client(mine)
            except BaseException as e:
                errors.append(e)
                raise

        def run_client(mine):
            turn = 0
            while not stop.is_set():
                s = mine[turn % len(mine)]
                turn += 1
                messages = conversations[s] + [{"role": "user", "content": f"turn {turn} reads more"}]
                if len(messages) > 40:  # keep the prompt within the test model's window
                    messages = messages[:1] + messages[-20:]
                try:
                    r = client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=6, temperature=0,
                        logit_bias=BAN_SPECIALS, extra_headers={"X-Session-Id": s},
                    )
                    conversations[s] = messages + [
                        {"role": "assistant", "content": r.choices[0].message.content}
                    ]
                    with lock:
                        results.append((s, True, time.monotonic(), r.usage.prompt_tokens_details.cached_tokens))
                except Exception as e:  # a failed request is what this test counts
                    with lock:
                        results.append((s, False, time.monotonic(), repr(e)))
                    # As a client whose request failed: wait for the router to notice.
                    wait_until("the router to drop the dead replica",
                               lambda: killed.is_set() and victim_url not in router.healthy())

        threads = [threading.Thread(target=client_loop, args=(sessions[2 * i:2 * i + 2],)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(LOAD_SECONDS / 3)  # load runs; then the replica dies
        reps.kill(victim)
        killed.set()
        t_kill = time.monotonic()
        wait_until("the router to drop the dead replica", lambda: victim_url not in router.healthy())
        time.sleep(LOAD_SECONDS / 3)
        reps.restart(victim)
        wait_until("the restarted replica to rejoin", lambda: victim_url in router.healthy())
        rejoined_prompts = metric(victim_url, "mtpx_prompt_tokens_total")
        time.sleep(LOAD_SECONDS / 3)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors

        failures = [(s, t, e) for s, ok, t, e in results if not ok]
        victims = [s for s in sessions if owner[s] == victim]
        print(f"{len(results)} requests, {len(failures)} failed, {len(victims)} sessions on the killed replica")
        for s, t, e in failures:
            assert owner[s] == victim, f"{s} on a surviving replica failed: {e}"
            assert t >= t_kill - 1.0, f"{s} failed before the kill: {e}"
        for s in victims:
            assert sum(1 for f in failures if f[0] == s) <= 1, f"{s}: {failures}"
            after = [r for r in results if r[0] == s and r[1] and r[2] > t_kill]
            assert after, f"{s} never continued after the kill"
            assert after[0][3] > 0, f"{s} continued on a survivor without its pages: {after[0]}"
        assert len(results) > 16 * 3, f"only {len(results)} requests in {LOAD_SECONDS} s"
        # The restarted replica took its sessions back.
        assert metric(victim_url, "mtpx_prompt_tokens_total") > rejoined_prompts
    finally:
        router.stop()
        reps.stop()


SOAK_SECONDS = float(os.environ.get("MTPX_SOAK_SECONDS", "60"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_soak_through_the_router(test_model, tmp_path):
    """Mixed traffic through vllm-router for SOAK_SECONDS (60 in CI; BENCHMARKS.md records a
    20-minute run): chat sessions, Responses chains, tool rounds, and streams the client drops
    part way. No request that fits fails; once idle and past the session TTL every replica
    holds no page; each replica's RSS ends within 10% of what it was after warm-up."""
    import random

    # A pool small enough that warm-up touches all of it: RSS then measures what else grows.
    reps = Replicas(test_model, tmp_path, 3, "--session-ttl", "3", "--kv-memory", "12MiB")
    router = Router(reps.urls, tmp_path / "router.log", "consistent_hash")
    tools = [{"type": "function", "function": {
        "name": "read", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"enum": ["main.rs", "lib.rs"]}},
                       "required": ["path"], "additionalProperties": False},
    }}]
    counts = {"chat": 0, "responses": 0, "tool": 0, "dropped": 0}
    failures, errors = [], []
    lock = threading.Lock()
    deadline = time.monotonic() + SOAK_SECONDS

    def one_client(seed: int):
        rng = random.Random(seed)
        client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            session = f"soak-{seed}-{n // 6}"  # a new session every six turns
            kind = rng.choice(["chat", "responses", "tool", "dropped"])
            try:
                if kind == "chat":
                    messages = [{"role": "user", "content": f"{session} " + "read " * rng.randint(10, 200)}]
                    for _ in range(rng.randint(1, 3)):
                        r = client.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=rng.randint(1, 24),
                            extra_headers={"X-Session-Id": session},
                        )
                        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                                     {"role": "user", "content": "more"}]
                elif kind == "responses":
                    prev = None
                    for turn in range(rng.randint(1, 3)):
                        prev = client.responses.create(
                            model=MODEL, input=f"{session} turn {turn}", max_output_tokens=rng.randint(1, 16),
                            previous_response_id=prev, user=session,
                        ).id
                elif kind == "tool":
                    messages = [{"role": "user", "content": "read main.rs"}]
                    r = client.chat.completions.create(
                        model=MODEL, messages=messages, tools=tools, tool_choice="required",
                        max_tokens=64, extra_headers={"X-Session-Id": session},
                    )
                    call = r.choices[0].message.tool_calls[0]
                    json.loads(call.function.arguments)
                    messages += [r.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id, "content": "fn main() {}"}]
                    client.chat.completions.create(
                        model=MODEL, messages=messages, tools=tools, max_tokens=8,
                        extra_headers={"X-Session-Id": session},
                    )
                else:  # a client that hangs up part way through a stream
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "stream then drop"}],
                        max_tokens=400, stream=True, extra_headers={"X-Session-Id": session},
                    )
                    for i, _ in enumerate(stream):
                        if i >= rng.randint(1, 20):
                            break
                    stream.close()
                with lock:
                    counts[kind] += 1
            except Exception as e:
                with lock:
                    failures.append((kind, repr(e)))

    def guarded(seed):
        try:
            one_client(seed)
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(6)]
        for t in threads:
            t.start()
        samples = []  # (seconds, RSS MiB of each replica), twelve over the run
        started = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(min(SOAK_SECONDS / 12, max(0.0, deadline - time.monotonic())))
            samples.append((round(time.monotonic() - started), [rss_bytes(p.pid) >> 20 for p in reps.procs]))
        print("RSS MiB over time:", samples)
        # Warm-up: the first third of the run (every path has run, the pool is all touched).
        warm = [mib << 20 for mib in samples[len(samples) // 3][1]]
        for t in threads:
            t.join(timeout=SOAK_SECONDS + 120)
        end = [rss_bytes(p.pid) for p in reps.procs]
        assert not errors, errors
        assert not failures, failures[:5]
        assert all(counts.values()), counts
        for i, url in enumerate(reps.urls):
            wait_until(f"replica {i} to hold no page once idle",
                       lambda: metric(url, "mtpx_kv_pages_held") == 0 and metric(url, "mtpx_sessions") == 0)
        growth = [e / w for e, w in zip(end, warm)]
        print(f"soak {SOAK_SECONDS:.0f} s: {counts}; RSS MiB warm {[w >> 20 for w in warm]} "
              f"end {[e >> 20 for e in end]}")
        assert max(growth) <= 1.10, f"RSS grew {growth} after warm-up"
    finally:
        router.stop()
        reps.stop()


def test_the_kubernetes_example_validates_and_routes_to_every_replica():
    """deploy/kubernetes/mtpx.yaml against the Kubernetes schemas (offline, strict: unknown
    fields fail), and its router lists exactly the StatefulSet's replicas."""
    import yaml

    path = ROOT / "deploy" / "kubernetes" / "mtpx.yaml"
    validate = Path(sys.executable).parent / "kubernetes-validate"
    checked = subprocess.run([str(validate), "--strict", "--quiet", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0 and "ERROR" not in checked.stdout + checked.stderr, checked
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text())}
    replicas = docs[("StatefulSet", "mtpx")]["spec"]["replicas"]
    args = docs[("Deployment", "mtpx-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    workers = [a for a in args if a.startswith("http://")]
    assert workers == [f"http://mtpx-{i}.mtpx:8000" for i in range(replicas)]
    # The replicas share the sessions volume, read-write-many.
    claim = docs[("PersistentVolumeClaim", "mtpx-sessions")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_rolling_restart_behind_nginx_loses_no_request(test_model, tmp_path):
    """Clients keep sending turns through nginx while each replica in turn gets SIGTERM
    (drains: running turns finish, sessions are written), exits 0 and starts again: not one
    request fails, and every session goes on with its K/V (from memory or the shared
    directory)."""
    reps = Replicas(test_model, tmp_path, 3)
    nginx = Nginx(reps.urls, tmp_path / "nginx")
    results, errors = [], []
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop(session):
        try:
            client = OpenAI(base_url=f"{nginx.url}/v1", api_key="unused", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": f"{session} " + "reads a file " * 40}]
            while not stop.is_set():
                try:
                    r = client.chat.completions.create(
                        model=MODEL, messages=messages[:1] + messages[-16:], max_tokens=6,
                        temperature=0, logit_bias=BAN_SPECIALS, extra_headers={"X-Session-Id": session},
                    )
                    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                                 {"role": "user", "content": "next"}]
                    with lock:
                        results.append((session, None, r.usage.prompt_tokens_details.cached_tokens))
                except Exception as e:  # what this test counts
                    with lock:
                        results.append((session, repr(e), 0))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(f"rolling-{i}",)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        for i in range(len(reps.urls)):
            wait_until("traffic", lambda: len(results) > 30 * (i + 1))
            stop_server(reps.procs[i], reps.log(i))  # SIGTERM; asserts exit status 0
            reps.restart(i)
        wait_until("traffic after the last restart", lambda: len(results) > 30 * (len(reps.urls) + 1))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        nginx.stop()
        reps.stop()
    assert not errors, errors
    failed = [r for r in results if r[1]]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    # Every turn after a session's first reused K/V (each session's first request is the only
    # one with nothing to reuse).
    first_seen = set()
    for session, _, cached in results:
        if session in first_seen:
            assert cached > 0, f"{session} recomputed its prompt"
        first_seen.add(session)
