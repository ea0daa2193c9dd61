"""Tool-calling accuracy on BFCL's `simple_python` and `multiple` sets, against any
OpenAI-compatible server (mtpx, llama.cpp's llama-server), with native `tools` at temperature 0.

    python3 benches/bfcl.py --data DIR mtpx=http://127.0.0.1:8080 llama.cpp=http://127.0.0.1:8081
        [--simple 40] [--multiple 30] [--model NAME]

DIR is the `bfcl_eval/data` folder of the `bfcl-eval` wheel from PyPI (unzip it; nothing is
installed): `BFCL_v4_simple_python.json`, `BFCL_v4_multiple.json` and their
`possible_answer/` files. Each item is one user question and its functions; the reply's first
tool call is checked as BFCL's AST checker checks it for these sets: the function's name, no
parameter it does not declare, every required one present, each value among the possible
answers (strings compared lowercased without spaces and punctuation, an int accepted for a
float, lists and dicts element by element; an answer "" means the parameter may be left out).
BFCL's OpenAI handler sends names with `.` as `_` and `dict`/`float`/`tuple` types as
`object`/`number`/`array`; so does this script. A reply whose call text does not parse (the
server left it in the content) counts as unparseable.
"""

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def openai_schema(schema):
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "type" and isinstance(v, str):
                mapped = TYPES.get(v, v)
                if mapped is not None:
                    out[k] = mapped
            else:
                out[k] = openai_schema(v)
        return out
    if isinstance(schema, list):
        return [openai_schema(s) for s in schema]
    return schema


def tools_of(functions):
    return [{"type": "function", "function": {
        "name": f["name"].replace(".", "_"),
        "description": f.get("description", ""),
        "parameters": openai_schema(f["parameters"]),
    }} for f in functions]


def standardize(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def value_ok(value, answers) -> bool:
    for a in answers:
        if isinstance(a, str) and isinstance(value, str):
            if standardize(a) == standardize(value):
                return True
        elif isinstance(a, bool) or isinstance(value, bool):
            if a is value:
                return True
        elif isinstance(a, (int, float)) and isinstance(value, (int, float)):
            if float(a) == float(value):
                return True
        elif isinstance(a, list) and isinstance(value, list):
            if len(a) == len(value) and all(value_ok(v, [x]) for v, x in zip(value, a)):
                return True
        elif isinstance(a, dict) and isinstance(value, dict):
            if set(value) <= set(a) and all(
                value_ok(value[k], a[k]) if k in value else "" in a[k] for k in a
            ):
                return True
    return False


def check(call, functions, truth) -> str:
    """`ok`, or why not."""
    (want_name, want_args), = truth.items()
    if call["name"] != want_name.replace(".", "_"):
        return f"called {call['name']}, expected {want_name}"
    func = next(f for f in functions if f["name"] == want_name)
    declared = func["parameters"].get("properties", {})
    required = func["parameters"].get("required", [])
    args = call["args"]
    for k in args:
        if k not in declared:
            return f"undeclared parameter {k}"
    for k in required:
        if k not in args:
            return f"missing required {k}"
    for k, answers in want_args.items():
        if k not in args:
            if "" not in answers:
                return f"missing {k}"
            continue
        if not value_ok(args[k], answers):
            return f"{k}={args[k]!r} not in {answers}"
    return "ok"


def ask(url: str, model: str, item) -> tuple[dict | None, str, float]:
    body = {"model": model, "messages": item["question"][0], "tools": tools_of(item["function"]),
            "temperature": 0, "max_tokens": 256}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    took = time.monotonic() - started
    msg = reply["choices"][0]["message"]
    calls = msg.get("tool_calls") or []
    if not calls:
        return None, msg.get("content") or "", took
    f = calls[0]["function"]
    try:
        args = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
    except json.JSONDecodeError:
        return {"name": f["name"], "args": None}, f["arguments"], took
    return {"name": f["name"], "args": args}, "", took


def load(data: Path, name: str, n: int):
    items = [json.loads(l) for l in (data / name).read_text().splitlines()][:n]
    truths = {j["id"]: j["ground_truth"][0] for j in
              map(json.loads, (data / "possible_answer" / name).read_text().splitlines())}
    return [(it, truths[it["id"]]) for it in items]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("servers", nargs="+", help="NAME=URL")
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--simple", type=int, default=40)
    p.add_argument("--multiple", type=int, default=30)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    a = p.parse_args()
    items = (load(a.data, "BFCL_v4_simple_python.json", a.simple)
             + load(a.data, "BFCL_v4_multiple.json", a.multiple))
    print(f"{len(items)} items ({a.simple} simple_python, {a.multiple} multiple), model {a.model}")
    for spec in a.servers:
        name, url = spec.split("=", 1)
        correct = unparseable = no_call = 0
        seconds = 0.0
        for item, truth in items:
            call, text, took = ask(url, a.model, item)
            seconds += took
            if call is None:
                no_call += 1
                # A call written as text that the server did not take for one.
                if re.search(r'"name"\s*:', text) or "<tool_call>" in text:
                    unparseable += 1
                verdict = "no call: " + text[:80].replace("\n", " ")
            elif call["args"] is None:
                unparseable += 1
                verdict = "arguments do not parse"
            else:
                verdict = check(call, item["function"], truth)
                correct += verdict == "ok"
            if verdict != "ok":
                print(f"  {name} {item['id']}: {verdict}")
        n = len(items)
        print(f"{name}: {correct}/{n} = {correct / n:.3f} correct, {unparseable} unparseable, "
              f"{no_call} without a call, {seconds:.0f} s")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
