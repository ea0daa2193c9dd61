"""What a router adds in front of mtpx replicas: time to first token through vllm-router and
through nginx (deploy/nginx/mtpx.conf) against the same replica directly, median of 50 streamed
requests each, interleaved; and the sticky hit rate of agent sessions through each router.

    .venv/bin/python benches/router.py [--model PATH] [--requests 50] [--sessions 12]

Without --model it serves the generated test model (`mtpx make-test-model`): the forward is
then ~1 ms, so the differences are the routers' own. Needs vllm-router in the venv
(tests/python/requirements.txt) and nginx on PATH (or /usr/sbin).
"""

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
MTPX = os.environ.get("MTPX_BIN", str(ROOT / "target" / "release" / "mtpx"))
MODEL = ""  # the served model's id, from GET /v1/models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"{url} never answered")


def metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(f"{url}/metrics").read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def ttft(client: OpenAI, session: str) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "say something"}], max_tokens=4,
        stream=True, extra_headers={"X-Session-Id": session},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - started
            break
    else:
        elapsed = time.perf_counter() - started
    stream.close()
    return elapsed


def sticky_hit_rate(client: OpenAI, sessions: int, turns: int = 4) -> float:
    """Share of continuation turns that reused >= 90% of the previous prompt."""
    hits = total = 0
    for s in range(sessions):
        messages = [{"role": "user", "content": f"session {s} " + "reads a file " * 60}]
        prev = None
        for turn in range(turns):
            r = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0,
                extra_headers={"X-Session-Id": f"sticky-{id(client)}-{s}"},
            )
            if prev is not None:
                total += 1
                hits += r.usage.prompt_tokens_details.cached_tokens >= 0.9 * prev
            prev = r.usage.prompt_tokens
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"turn {turn} next"}]
    return hits / max(total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=12)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mtpx-router-bench-"))
    procs = []
    try:
        model = args.model
        if not model:
            subprocess.run([MTPX, "make-test-model", "--out", str(work)], check=True, capture_output=True)
            model = str(work / "test-model.gguf")
        urls = []
        for i in range(3):
            port = free_port()
            p = subprocess.Popen(
                [MTPX, "serve", "--model", model, "--port", str(port), "--session-dir", str(work / "sessions")],
                stdout=(work / f"r{i}.log").open("w"), stderr=subprocess.STDOUT,
            )
            procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
            wait_up(f"{urls[-1]}/health", p)
        router_port = free_port()
        router_bin = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        procs.append(subprocess.Popen(
            [router_bin, "--port", str(router_port), "--policy", "consistent_hash",
             "--worker-urls", *urls, "--prometheus-port", str(free_port()), "--log-level", "warning"],
            stdout=(work / "router.log").open("w"), stderr=subprocess.STDOUT,
        ))
        router = f"http://127.0.0.1:{router_port}"
        wait_up(f"{router}/health", procs[-1])
        conf = (ROOT / "deploy" / "nginx" / "mtpx.conf").read_text()
        for old, url in zip(re.findall(r"server (127\.0\.0\.1:\d+) ", conf), urls):
            conf = conf.replace(f"{old} ", f"{url.removeprefix('http://')} ", 1)
        nginx_port = free_port()
        conf = conf.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{nginx_port};")
        (work / "tmp").mkdir()
        (work / "nginx.conf").write_text(conf)
        nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
        procs.append(subprocess.Popen(
            [nginx_bin, "-p", f"{work}/", "-c", str(work / "nginx.conf"), "-g", "daemon off;"],
            stdout=(work / "nginx.log").open("w"), stderr=subprocess.STDOUT,
        ))
        nginx = f"http://127.0.0.1:{nginx_port}"
        wait_up(f"{nginx}/health", procs[-1])

        global MODEL
        MODEL = OpenAI(base_url=f"{urls[0]}/v1", api_key="x").models.list().data[0].id
        clients = {name: OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
                   for name, u in [("router", router), ("nginx", nginx)]}
        # The session key that lands on replica 0 through each router, so that every path
        # ends on the same replica.
        def key_for(name):
            for i in range(1000):
                before = metric(urls[0], "mtpx_prompt_tokens_total")
                ttft(clients[name], f"k{i}")
                if metric(urls[0], "mtpx_prompt_tokens_total") > before:
                    return f"k{i}"
            sys.exit("no key reached replica 0")
        keys = {name: key_for(name) for name in clients}
        clients["direct"] = OpenAI(base_url=f"{urls[0]}/v1", api_key="x", max_retries=0)
        keys["direct"] = keys["router"]
        for name in clients:  # warm-up
            for _ in range(5):
                ttft(clients[name], keys[name])
        times = {name: [] for name in clients}
        for _ in range(args.requests):
            for name in clients:
                times[name].append(ttft(clients[name], keys[name]))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"TTFT median of {args.requests} (ms): " + ", ".join(f"{n} {m:.2f}" for n, m in med.items()))
        for name in ("router", "nginx"):
            print(f"{name} adds {med[name] - med['direct']:.2f} ms per request "
                  f"({med[name] / med['direct']:.2f}x direct)")
        for name in ("router", "nginx"):
            rate = sticky_hit_rate(clients[name], args.sessions)
            print(f"sticky hit rate through {name}: {rate:.0%} of continuation turns reused >= 90% of the prompt")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
