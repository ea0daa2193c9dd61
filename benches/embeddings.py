"""Embedding throughput of mtpx against a peer serving the same GGUF file (BENCHMARKS.md).

Usage: `mtpx serve -m qwen2.5-coder-0.5b` and a peer with OpenAI's `/v1/embeddings`, e.g.
`llama-server -m ~/.cache/mtpx/models/qwen2.5-coder-0.5b.gguf --embeddings --pooling mean
-t 2 --port 8081 -np 8 -c 16384 -ub 2048 -b 2048`, then

    python3 benches/embeddings.py mtpx=http://127.0.0.1:8080 llama.cpp=http://127.0.0.1:8081

Texts: 128 pieces of mtpx's own source (Rust, 40 lines each, ~300-600 tokens; `TEXTS=N` for
fewer). Each round (`ROUNDS`, default 3), for each server in turn: the texts in requests of 32
inputs, then the first 16 (`SINGLE=N`) one request at a time. Reports medians of texts/s and
prompt tokens/s, each server's ratio to the first, and the cosine similarity of the servers'
batched vectors for the same texts (both mean-pooled and normalised; one text at a time
mtpx and llama.cpp agree to 0.9997 or better, so a lower figure means a server's batched
vectors are not its single ones).
"""
import glob, json, math, os, statistics, sys, time, urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ROUNDS = int(os.environ.get("ROUNDS", 3))
TEXTS = int(os.environ.get("TEXTS", 128))
SINGLE = int(os.environ.get("SINGLE", 16))


def texts():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "src", "**", "*.rs"), recursive=True)):
        lines = open(path, encoding="utf-8").read().splitlines()
        for i in range(0, len(lines) - 40, 40):
            out.append("\n".join(lines[i:i + 40]))
    return out[:TEXTS]


def embed(url, inputs):
    body = {"input": inputs, "encoding_format": "float"}
    req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.load(r)
    vectors = [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]
    return vectors, out.get("usage", {}).get("prompt_tokens", 0)


def run(url, inputs, per_request):
    start = time.perf_counter()
    vectors, tokens = [], 0
    for i in range(0, len(inputs), per_request):
        v, t = embed(url, inputs[i:i + per_request])
        vectors += v
        tokens += t
    wall = time.perf_counter() - start
    return len(inputs) / wall, tokens / wall, vectors


def main():
    servers = [a.split("=", 1) for a in sys.argv[1:]]
    corpus = texts()
    batched = {name: [] for name, _ in servers}
    single = {name: [] for name, _ in servers}
    vectors = {}
    for r in range(ROUNDS):
        for name, url in servers:
            tps, toks, v = run(url, corpus, 32)
            batched[name].append((tps, toks))
            vectors[name] = v
            single[name].append(run(url, corpus[:SINGLE], 1)[:2])
            print(f"round {r + 1} {name}: {tps:.2f} texts/s ({toks:.0f} tok/s) in 32s, "
                  f"{single[name][-1][0]:.2f} texts/s ({single[name][-1][1]:.0f} tok/s) one at "
                  "a time", flush=True)
    first = servers[0][0]
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    for name, _ in servers:
        print(f"{name}: batched {med(batched[name], 0):.2f} texts/s, {med(batched[name], 1):.0f} "
              f"tok/s ({med(batched[name], 1) / med(batched[first], 1):.2f}x {first}); one at a "
              f"time {med(single[name], 0):.2f} texts/s, {med(single[name], 1):.0f} tok/s "
              f"({med(single[name], 1) / med(single[first], 1):.2f}x)")
    for name, _ in servers[1:]:
        cos = [sum(a * b for a, b in zip(x, y)) / math.sqrt(sum(a * a for a in x) * sum(b * b for b in y))
               for x, y in zip(vectors[first], vectors[name])]
        print(f"cosine {first} vs {name}: min {min(cos):.5f}, median {statistics.median(cos):.5f}")


if __name__ == "__main__":
    main()
