"""The session store's figures (issue: sessions that survive restarts), against the server's
own cold prefill in the same run:

    python3 benches/session_store.py [--model qwen2.5-coder-0.5b] [--tokens 16000] [--kv-dtype f16]

1. Restart: two sessions start with the same ~N-token prompt (real source files of this
   repository, as an agent reads them). Session A's next turn is timed on the live server;
   then the server is killed with SIGKILL (after its writes are on disk), started again on the
   same `--session-dir`, and session B's identical next turn is timed: it resumes from disk.
   Reported: the cold prefill of the first turn, the live next turn, the restored next turn, and
   the ratios (cold / restored, restored / live).
2. Writer cost: four clients each run turns of 32 generated tokens on their own session for a
   fixed number of rounds, on a server with the store and on one without (`--no-session-store`),
   one after the other in the same run; aggregate decode tok/s of each and their ratio.

Times are the client's time to the first streamed token. Starts its own servers (loopback).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = os.environ.get("MTPX_BIN", str(ROOT / "target" / "release" / "mtpx"))
SOURCES = sorted((ROOT / "src").rglob("*.rs"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, kv_dtype, session_dir, log, store=True):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [BIN, "serve", "--model", model, "--port", str(self.port), "--kv-dtype", kv_dtype,
                "--temperature", "0"]
        args += ["--session-dir", str(session_dir)] if store else ["--no-session-store"]
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                sys.exit(f"the server did not start; see {log}")
            time.sleep(0.2)

    def metric(self, name):
        with urllib.request.urlopen(self.url + "/metrics") as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def turn(self, session, messages, max_tokens):
        """Streams a greedy chat turn; returns (ttft seconds, text, usage, decode seconds)."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=body, headers={
            "content-type": "application/json", "x-session-id": session})
        start = time.perf_counter()
        first = None
        text, usage = "", None
        with urllib.request.urlopen(req, timeout=1800) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    delta = c.get("delta", {}).get("content")
                    if delta:
                        if first is None:
                            first = time.perf_counter()
                        text += delta
        end = time.perf_counter()
        first = first or end
        return first - start, text, usage, end - first

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait()


def source_text(chars):
    out = []
    for path in SOURCES:
        out.append(f"// {path.relative_to(ROOT)}\n{path.read_text()}")
        if sum(map(len, out)) > chars:
            break
    return "".join(out)[:chars]


def restart(args, work):
    sessions = work / f"sessions-{args.kv_dtype}"
    text = source_text(int(args.tokens * 4.2))  # ~4.2 characters a token in this Rust source
    first = [{"role": "user", "content": "Read these files.\n\n" + text}]
    server = Server(args.model, args.kv_dtype, sessions, work / "serve-1.log")
    cold, reply, usage, _ = server.turn("a", first, 8)
    print(f"first turn: {usage['prompt_tokens']} prompt tokens, cold prefill {cold:.2f} s", flush=True)
    for s in ("b", "c"):  # the same first turn, from the prefix cache
        server.turn(s, first, 8)
    nxt = first + [{"role": "assistant", "content": reply},
                   {"role": "user", "content": "Which file defines the page pool?"}]
    live, _, live_usage, _ = server.turn("a", nxt, 8)
    deadline = time.time() + 120
    while server.metric("mtpx_session_store_writes_total") < 4 and time.time() < deadline:
        time.sleep(0.05)
    server.kill()
    # Restarted, warmed by one short unrelated request (a new process's first forward pays for
    # touching the weights), then session B's next turn.
    server = Server(args.model, args.kv_dtype, sessions, work / "serve-2.log")
    server.turn("warm-up", [{"role": "user", "content": "hi"}], 1)
    warm, _, warm_usage, _ = server.turn("b", nxt, 8)
    server.kill()
    # Restarted, and session C's next turn is the new process's first request.
    server = Server(args.model, args.kv_dtype, sessions, work / "serve-3.log")
    first_req, _, first_usage, _ = server.turn("c", nxt, 8)
    restore_s = server.metric("mtpx_session_store_restore_seconds_total")
    restored_bytes = server.metric("mtpx_session_store_restored_bytes_total")
    server.stop()
    n = live_usage["prompt_tokens"]
    print(f"next turn ({n} tokens), time to first token:")
    print(f"  live (no restart):                 {live:.3f} s, cached {live_usage['prompt_tokens_details']['cached_tokens']}")
    print(f"  after kill -9, restart, warm-up:   {warm:.3f} s, cached {warm_usage['prompt_tokens_details']['cached_tokens']}")
    print(f"  after kill -9, first request:      {first_req:.3f} s, cached {first_usage['prompt_tokens_details']['cached_tokens']}"
          f" (reading the file back: {restore_s:.3f} s for {restored_bytes / 2**20:.0f} MiB)")
    print(f"cold / restored = {cold / warm:.1f}x (first request {cold / first_req:.1f}x), "
          f"restored / live = {warm / live:.2f}x (first request {first_req / live:.2f}x)", flush=True)


def writer_cost(args, work):
    results = {}
    for n, store in enumerate((False, True, False, True)):
        server = Server(args.model, args.kv_dtype, work / f"sessions-writer-{n}", work / "serve-w.log", store)
        tokens = [0] * 4
        decode = [0.0] * 4

        def client(i):
            messages = [{"role": "user", "content": source_text(2000 + 500 * i)[-1500:]}]
            for r in range(args.rounds):
                _, text, usage, dt = server.turn(f"w{i}-{store}", messages, 32)
                tokens[i] += usage["completion_tokens"]
                decode[i] += dt
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": f"Go on ({r})."}]

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        wall = time.perf_counter() - start
        server.stop()
        rate = sum(tokens) / wall
        results.setdefault(store, []).append(rate)
        print(f"{'store' if store else 'no store'}: {sum(tokens)} tokens in {wall:.1f} s, {rate:.2f} tok/s", flush=True)
    with_store = sum(results[True]) / 2
    without = sum(results[False]) / 2
    print(f"aggregate tok/s with the store / without = {with_store / without:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=16000)
    p.add_argument("--kv-dtype", default="f16")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--skip-writer", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mtpx-store-bench-") as work:
        work = Path(work)
        restart(args, work)
        if not args.skip_writer:
            writer_cost(args, work)


if __name__ == "__main__":
    main()
