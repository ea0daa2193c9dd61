"""Decode speed under an output grammar against none, on one server (BENCHMARKS.md).

Usage: `mtpx serve` then `python3 benches/grammar_cost.py http://127.0.0.1:8080`. Each round
asks the same JSON-writing question five ways, alternating: unconstrained, `guided_json` with an
empty schema (llguidance's own JSON grammar), llama.cpp's `json.gbnf` through `grammar`, the same
with its arrays of objects spelled as a schema, and a long `guided_regex`. Greedy, speculation
off, `ignore_eos` so every run decodes until the grammar ends it or `max_tokens`. Reports the
decode rate (`timings.predicted_per_second`) medians and their ratio to the unconstrained one.
"""
import json, statistics, sys, urllib.request

url = sys.argv[1]
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})
  )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
SCHEMA = {"type": "object", "properties": {"states": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "capital": {"type": "string"},
    "population": {"type": "integer"}}, "required": ["name", "capital", "population"]}}},
    "required": ["states"]}
WAYS = {
    "none": {},
    "guided_json {}": {"guided_json": {}},
    "grammar json.gbnf": {"grammar": JSON_GBNF},
    "guided_json schema": {"guided_json": SCHEMA},
    "guided_regex": {"guided_regex": r'\{"states": \[(\{"name": "[A-Za-z ]{1,20}", "capital": "[A-Za-z ]{1,20}"\}, ){0,40}\]\}'},
}


def run(extra):
    body = {"messages": [{"role": "user", "content": "List all 50 US states with their capitals "
            "and populations as JSON: {\"states\": [{\"name\": ..., \"capital\": ..., \"population\": ...}]}"}],
            "temperature": 0, "max_tokens": 256, "speculative": False, "ignore_eos": True, **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return out["timings"]["predicted_per_second"], out["usage"]["completion_tokens"]


rates = {k: [] for k in WAYS}
for i in range(3):
    for name, extra in WAYS.items():
        rate, n = run(extra)
        rates[name].append(rate)
        print(f"round {i}: {name}: {n} tokens at {rate:.1f} tok/s", flush=True)
base = statistics.median(rates["none"])
for name, r in rates.items():
    print(f"{name}: median {statistics.median(r):.1f} tok/s, {statistics.median(r) / base:.2f}x unconstrained")
