"""The seed report's scenario with a real agent: Pi (tests/agents' pinned release) through
several write rounds, each handing it a 3K-token source file to save with its `write` tool,
until the session is past 16K tokens; one `pi -p` per round, continuing the session
(`--continue`), so every round resends the whole conversation as Pi does.

    mtpx serve --model qwen2.5-coder-1.5b --port 8080 --seed 0 --temperature 0 > serve.log &
    python3 benches/pi_long_session.py http://127.0.0.1:8080 serve.log [--past 16384]

Per round: the files the model saved and how much of each is the original; from the server's
`request finished` lines, each request's prompt tokens, cached tokens, time to first token
(prompt_ms) and decode time; and the round's wall time. Exits non-zero on a server error or an
error event from Pi.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "agents"))
from server_log import finished_requests  # noqa: E402

PI = ROOT / "tests" / "agents" / "node_modules" / ".bin" / "pi"
# Real source files of about 3K tokens each (9-11 KB).
FILES = ["tests/python/test_openai.py", "tests/reference/forward.py",
         "tests/python/test_responses.py", "src/spec/seq.rs", "src/engine/stream.rs"]
FENCE = {".py": "python", ".rs": "rust"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("log", type=Path)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--past", type=int, default=16384)
    p.add_argument("--dir", type=Path, default=Path("/tmp/mtpx-pi-long"))
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    work, home = a.dir / "work", a.dir / "home"
    (home / ".pi" / "agent").mkdir(parents=True)
    work.mkdir()
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"mtpx": {
        "baseUrl": f"{a.url}/v1", "api": "openai-completions", "apiKey": "unused",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": a.model, "contextWindow": 32768, "maxTokens": 6144}],
    }}}))
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin:/usr/local/bin", "PI_OFFLINE": "1", "NO_COLOR": "1"}
    failed = False
    deepest = 0
    for n, rel in enumerate(FILES):
        source = (ROOT / rel).read_text()
        name = Path(rel).name
        ask = (f"Save the following file as {name} with the write tool, exactly as given, "
               f"then reply with one short sentence.\n\n```{FENCE[Path(rel).suffix]}\n{source}```")
        start = a.log.stat().st_size
        t0 = time.monotonic()
        cmd = [str(PI), "--provider", "mtpx", "--model", a.model, "--mode", "json"]
        cmd += (["--continue"] if n else []) + ["-p", ask]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=3600)
        wall = time.monotonic() - t0
        events = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
        errors = [e["message"].get("errorMessage") for e in events if e.get("type") == "message_end"
                  and (e.get("message") or {}).get("errorMessage")]
        written = work / name
        same = 0.0
        if written.exists():
            got, want = written.read_text().splitlines(), source.splitlines()
            same = sum(g == w for g, w in zip(got, want)) / max(1, len(want))
        rows = finished_requests(a.log, start)
        deepest = max([deepest] + [r["prompt_tokens"] for r in rows])
        print(json.dumps({"round": n + 1, "file": name, "file_chars": len(source),
                          "exit": proc.returncode, "wall_s": round(wall, 1), "errors": errors,
                          "written": written.exists(), "lines_identical": round(same, 3),
                          "requests": rows}))
        sys.stdout.flush()
        if proc.returncode != 0 or errors:
            failed = True
            print(proc.stdout[-2000:] + proc.stderr[-2000:])
            break
        if deepest > a.past:
            break
    print(f"deepest prompt: {deepest} tokens")
    sys.exit(1 if failed or deepest <= a.past else 0)


if __name__ == "__main__":
    main()
