"""What `mtpx serve` logs about each finished request (one `request finished` line each, with
`key=value` fields: the agent tests and benches/pi_long_session.py read it)."""

import re
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FINISHED = re.compile(r"request finished")
FIELD = re.compile(r"(\w+)=(\S+)")
COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "prompt_ms", "decode_ms")


def finished_requests(log: Path, start: int) -> list[dict]:
    """The `request finished` lines written after byte `start` of the log: the counts as ints,
    and `finish` (why it ended)."""
    text = ANSI.sub("", log.read_bytes()[start:].decode(errors="replace"))
    out = []
    for line in text.splitlines():
        if FINISHED.search(line):
            fields = dict(FIELD.findall(line))
            out.append({k: int(fields[k]) for k in COUNTS} | {"finish": fields.get("finish", "")})
    return out
