"""Time a plain completion against an echo+logprobs one of the same ~900-token prompt (BENCHMARKS.md)."""
import json, time, urllib.request, statistics, sys
url = sys.argv[1]
import pathlib
text = (pathlib.Path(__file__).resolve().parents[1] / "src/api/generate.rs").read_text()[:4000]
def post(body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t, out
plain, scored = [], []
for i in range(4):
    # a different first character each round, so the prefix cache cannot serve the plain run
    prompt = f"{i}" + text
    t, o = post({"prompt": prompt, "max_tokens": 1, "temperature": 0, "speculative": False})
    plain.append(t); n = o["usage"]["prompt_tokens"]; cached = o["usage"]["prompt_tokens_details"]["cached_tokens"]
    t, o2 = post({"prompt": "x" + prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "speculative": False})
    scored.append(t)
    print(f"round {i}: {n} prompt tokens (cached {cached}): plain {plain[-1]*1e3:.0f} ms, scored {t*1e3:.0f} ms")
print(f"median plain {statistics.median(plain)*1e3:.0f} ms, scored {statistics.median(scored)*1e3:.0f} ms, ratio {statistics.median(scored)/statistics.median(plain):.2f}x")
