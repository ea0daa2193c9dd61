"""What the lazy tool grammar costs per token: the same requests against a server with it and
one started with `--no-tool-grammar`, alternating, on the same model (BENCHMARKS.md).

    mtpx serve --port 8080 & mtpx serve --port 8081 --no-tool-grammar &
    python3 benches/tool_grammar_cost.py http://127.0.0.1:8080 http://127.0.0.1:8081 [--rounds 5]

Two requests, greedy, speculation off, tools declared (`tool_choice: "auto"`): one the model
answers in prose (the grammar only watches: nothing is masked) and one it answers with a `write`
call carrying a file (from the `{"name":` of the call on, every token is masked by the
grammar). Reports the median decode rate (`timings.predicted_per_second`) of each on each
server, their ratio, and the time the grammar adds per token.
"""

import json
import statistics
import sys
import urllib.request

TOOLS = [{"type": "function", "function": {"name": "write", "description": "Write a file",
          "parameters": {"type": "object", "properties": {
              "path": {"type": "string"}, "content": {"type": "string"}},
              "required": ["path", "content"]}}}]
ASKS = {
    "prose": "Explain in a paragraph what a hash map is. Do not use any tool.",
    "call": "Use the write tool to save notes.md containing a numbered list of ten tips for "
            "writing clear Python, one sentence each.",
}


def run(url: str, question: str) -> tuple[float, int, bool]:
    body = {"messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 400, "speculative": False}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    t = reply["timings"]
    called = bool(reply["choices"][0]["message"].get("tool_calls"))
    return t["predicted_per_second"], t["predicted_n"], called


def main():
    on, off = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    for kind, question in ASKS.items():
        rates = {"grammar": [], "none": []}
        for _ in range(rounds):
            for name, url in (("grammar", on), ("none", off)):
                rate, n, called = run(url, question)
                rates[name].append(rate)
        g, f = statistics.median(rates["grammar"]), statistics.median(rates["none"])
        print(f"{kind}: {n} tokens, call={called}; with the grammar {g:.1f} tok/s, without "
              f"{f:.1f} tok/s: {g / f:.3f}x, {1000 / g - 1000 / f:+.2f} ms a token")


if __name__ == "__main__":
    main()
