"""Chat templates rendered by `transformers`' own `apply_chat_template`: the reference that
tests/tokenizer.rs compares mtpx's minijinja rendering with, byte for byte.

    .venv/bin/python tests/reference/render_chat.py [--cases FILE] NAME=MODEL.gguf[:TEMPLATE.jinja] ...

For each NAME, the chat template is the GGUF's `tokenizer.chat_template` (or TEMPLATE.jinja
when given) and the special tokens are the GGUF's bos/eos/unk/pad tokens, the ones transformers'
GGUF loader maps from `tokenizer.ggml.{bos,eos,unknown,padding}_token_id`. The tokenizer is a
`PreTrainedTokenizerFast` over a minimal vocabulary (rendering with `tokenize=False` never
encodes), so nothing is downloaded and torch is not needed.

Every case of the cases file (default: tests/fixtures/tokenizer/chat_cases.json, a list of
`{"name", "messages", "tools", "add_generation_prompt"}`) is passed to `apply_chat_template`
exactly as written. Prints one JSON object:

    {"transformers": VERSION, "jinja2": VERSION,
     "results": {NAME: {CASE: {"text": PROMPT} | {"error": "ExceptionType: message"}}}}
"""

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" notice

import jinja2
import transformers
from gguf import GGUFReader
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CASES = REPO / "tests/fixtures/tokenizer/chat_cases.json"
# GGUF key suffix -> the tokenizer attribute transformers' GGUF loader sets from it.
SPECIAL_TOKEN_IDS = {
    "bos_token_id": "bos_token",
    "eos_token_id": "eos_token",
    "unknown_token_id": "unk_token",
    "padding_token_id": "pad_token",
}


def read_gguf(path):
    """(chat template or None, {attribute: token}) from a GGUF file's metadata."""
    reader = GGUFReader(path)

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    tokens = reader.fields["tokenizer.ggml.tokens"]
    special = {}
    for suffix, attribute in SPECIAL_TOKEN_IDS.items():
        token_id = field(f"tokenizer.ggml.{suffix}")
        if token_id is not None:
            special[attribute] = tokens.contents(int(token_id))
    return field("tokenizer.chat_template"), special


def make_tokenizer(template, special):
    vocab = {token: i for i, token in enumerate(dict.fromkeys(special.values()))}
    unk = special.get("unk_token")
    model = WordLevel(vocab=vocab, unk_token=unk) if unk else WordLevel(vocab=vocab)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), chat_template=template, **special)


def render(tokenizer, case):
    try:
        text = tokenizer.apply_chat_template(
            case["messages"],
            tools=case["tools"],
            tokenize=False,
            add_generation_prompt=case["add_generation_prompt"],
        )
    except Exception as e:  # the test compares failures too
        return {"error": f"{type(e).__name__}: {e}"}
    return {"text": text}


def parse_subject(spec):
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"expected NAME=MODEL.gguf[:TEMPLATE.jinja], got {spec!r}")
    gguf_path, sep, jinja_path = rest.rpartition(":")
    if not sep or not jinja_path.endswith(".jinja"):
        return name, rest, None
    return name, gguf_path, jinja_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("subjects", nargs="+", metavar="NAME=MODEL.gguf[:TEMPLATE.jinja]")
    args = parser.parse_args()
    cases = json.loads(args.cases.read_text(encoding="utf-8"))
    subjects = [parse_subject(s) for s in args.subjects]

    # Parsing a GGUF's metadata takes seconds (its whole vocabulary): each file once, in parallel.
    paths = sorted({gguf_path for _, gguf_path, _ in subjects})
    with ProcessPoolExecutor(max_workers=min(len(paths), 4)) as pool:
        metadata = dict(zip(paths, pool.map(read_gguf, paths)))

    results = {}
    for name, gguf_path, jinja_path in subjects:
        template, special = metadata[gguf_path]
        if jinja_path is not None:
            template = Path(jinja_path).read_text(encoding="utf-8")
        if template is None:
            raise SystemExit(f"{gguf_path} has no tokenizer.chat_template")
        tokenizer = make_tokenizer(template, special)
        results[name] = {case["name"]: render(tokenizer, case) for case in cases}

    out = {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "results": results}
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
