"""Real coding agents, unmodified, against `mtpx serve` on a real model.

Each agent's pinned npm release (package.json here) runs headless on a small task in a fresh
folder, configured the way its documentation says to point it at a local OpenAI- or
Anthropic-compatible server. Asserted for each:

- it exits 0 and reports no API error;
- it executed at least one tool call, so the call's arguments parsed: the file the task asks
  for exists (Claude Code: its transcript holds the `tool_use` and its `tool_result`);
- after the tool result, the continuation was answered (a later request finished);
- that continuation's prompt reused at least 90% of the previous turn's (`cached_tokens` in
  the server's per-request log line).

The tasks name the tool to call: the test is of the server under a real agent loop, not of a
small model's judgement. Claude Code runs with `--bare --tools Read,Write` (its documented
minimal mode): its full prompt is ~20K tokens, several minutes of prefill per run on two cores.
The server runs with `--temperature 0 --seed 0`: the agents' requests that give neither are
decoded greedily (seeded where they do give a temperature), and each agent works in the same
folder every run, so its prompts, and the replies, repeat from run to run. `MTPX_AGENT_MODEL` picks the model (default: qwen2.5-coder-1.5b; the 0.5B does not
follow Codex's 8.6K-token instructions to a tool call).
"""

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from conftest import free_port, stop_server, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MTPX_BIN = os.environ.get("MTPX_BIN", str(ROOT / "target" / "release" / "mtpx"))
BIN = Path(__file__).resolve().parent / "node_modules" / ".bin"
MODEL = os.environ.get("MTPX_AGENT_MODEL", "qwen2.5-coder-1.5b")
# Claude Code asks for its own model names (the main one and a small one for side tasks).
CLAUDE_MODELS = ["claude-sonnet-4-5", "claude-haiku-4-5", "claude-3-5-haiku-20241022"]
AGENT_TIMEOUT = float(os.environ.get("MTPX_AGENT_TIMEOUT", "900"))
TASK = (
    "Create a file named hello.py that prints 'hello from mtpx'. "
    "Write it with your file-writing tool, then reply with one short sentence."
)
# Everything an agent would reach beyond loopback is off (there is no network here anyway).
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "PI_OFFLINE": "1",
    "NO_COLOR": "1",
    "CI": "1",
}

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FINISHED = re.compile(r"request finished.*")
FIELD = re.compile(r"(\w+)=(\S+)")


def finished_requests(log: Path, start: int) -> list[dict]:
    """The server's `request finished` lines written after byte `start` of its log."""
    text = ANSI.sub("", log.read_bytes()[start:].decode(errors="replace"))
    out = []
    for line in text.splitlines():
        m = FINISHED.search(line)
        if not m:
            continue
        fields = dict(FIELD.findall(line))
        out.append({k: int(fields[k]) for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}
                   | {"finish": fields.get("finish", "")})
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-logs") / "serve.log"
    port = free_port()
    args = [MTPX_BIN, "serve", "--model", MODEL, "--port", str(port), "--seed", "0",
            "--temperature", "0"]
    for name in CLAUDE_MODELS:
        args += ["--alias", name]
    env = {k: v for k, v in os.environ.items() if k != "MTPX_API_KEY"} | {"NO_COLOR": "1"}
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout=600)
    except Exception:
        proc.kill()
        raise
    yield url, log
    stop_server(proc, log)


class Run:
    def __init__(self, server, workdir: Path):
        self.url, self.log = server
        self.workdir = workdir
        self.start = self.log.stat().st_size
        self.home = workdir.parent / "home"
        self.home.mkdir(exist_ok=True)
        self.output = ""

    def env(self, **extra) -> dict:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
        return keep | QUIET_ENV | {"HOME": str(self.home)} | extra

    def run(self, cmd: list[str], env: dict, user: str | None = None) -> None:
        if user is not None:
            # `runuser` keeps the environment given with `env`.
            cmd = ["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in env.items()], *cmd]
            env = None
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.workdir, env=env, capture_output=True, text=True,
                              timeout=AGENT_TIMEOUT, stdin=subprocess.DEVNULL)
        self.output = proc.stdout + proc.stderr
        took = time.monotonic() - started
        print(f"{Path(cmd[-len(cmd)]).name} exited {proc.returncode} after {took:.0f} s")
        print(self.output[-4000:])
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{self.output[-4000:]}"

    def check(self, file: str | None = "hello.py") -> list[dict]:
        requests = finished_requests(self.log, self.start)
        print("requests:", json.dumps(requests))
        assert not re.search(r"\b(api error|APIError|stream error|error: 4\d\d|error: 5\d\d)\b",
                             self.output, re.I), self.output[-4000:]
        if file is not None:
            written = self.workdir / file
            files = sorted(p.name for p in self.workdir.iterdir())
            assert written.exists() and written.read_text().strip(), (
                f"the agent did not write {file}: files {files}"
            )
        assert len(requests) >= 2, f"no continuation after the tool call: {requests}"
        # The continuation: the largest prompt; the turn it continues: the largest before it.
        last = max(range(len(requests)), key=lambda i: (requests[i]["prompt_tokens"], i))
        earlier = [r for r in requests[:last] if r["prompt_tokens"] < requests[last]["prompt_tokens"]]
        assert earlier, f"no turn before the continuation: {requests}"
        previous = max(earlier, key=lambda r: r["prompt_tokens"])
        cont = requests[last]
        assert cont["cached_tokens"] >= 0.9 * previous["prompt_tokens"], (
            f"the continuation reused {cont['cached_tokens']} of the previous "
            f"{previous['prompt_tokens']} prompt tokens: {requests}"
        )
        return requests


@pytest.fixture()
def agent_run(server, request):
    # The same folder every run: agents put their working directory in the prompt.
    base = Path(tempfile.gettempdir()) / "mtpx-agents" / request.node.name
    shutil.rmtree(base, ignore_errors=True)
    work = base / "work"
    work.mkdir(parents=True)
    return Run(server, work)


def test_codex_cli_over_the_responses_api(agent_run):
    r = agent_run
    codex_home = r.home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "mtpx"\n'
        "[model_providers.mtpx]\n"
        f'name = "mtpx"\nbase_url = "{r.url}/v1"\nwire_api = "responses"\n'
    )
    subprocess.run(["git", "init", "-q"], cwd=r.workdir, check=True)
    task = ('Call the exec_command tool with cmd "echo hello from mtpx > hello.txt", '
            "then reply with one short sentence.")
    r.run([str(BIN / "codex"), "exec", "--skip-git-repo-check",
           "--dangerously-bypass-approvals-and-sandbox", task],
          r.env(CODEX_HOME=str(codex_home), OPENAI_API_KEY="unused"))
    r.check("hello.txt")


def test_pi_over_chat_completions(agent_run):
    r = agent_run
    agent_dir = r.home / ".pi" / "agent"
    agent_dir.mkdir(parents=True)
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"mtpx": {
        "baseUrl": f"{r.url}/v1", "api": "openai-completions", "apiKey": "unused",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": MODEL, "contextWindow": 32768, "maxTokens": 4096}],
    }}}))
    r.run([str(BIN / "pi"), "--provider", "mtpx", "--model", MODEL, "--no-session", "-p", TASK],
          r.env())
    r.check()


def test_opencode_over_chat_completions(agent_run):
    r = agent_run
    (r.workdir / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mtpx": {
            "npm": "@ai-sdk/openai-compatible", "name": "mtpx",
            "options": {"baseURL": f"{r.url}/v1"},
            "models": {MODEL: {"name": MODEL}},
        }},
        "model": f"mtpx/{MODEL}",
        "share": "disabled",
        "autoupdate": False,
    }))
    r.run([str(BIN / "opencode"), "run", "--model", f"mtpx/{MODEL}", TASK], r.env())
    r.check()


def agent_user() -> str:
    """An unprivileged user to run Claude Code as (it refuses to skip permissions as root)."""
    name = "mtpx-agent"
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True)
    return name


def test_claude_code_over_the_messages_api(agent_run):
    r = agent_run
    user = None
    if os.geteuid() == 0:
        user = agent_user()
        for p in (r.workdir.parent, r.workdir, r.home):
            shutil.chown(p, user)
    task = ("The file hello.py does not exist yet. Call the Write tool to create hello.py with "
            "the content print('hello from mtpx'), then reply with one short sentence.")
    r.run([str(BIN / "claude"), "-p", task, "--model", CLAUDE_MODELS[0], "--bare",
           "--tools", "Read,Write", "--dangerously-skip-permissions",
           "--output-format", "stream-json", "--verbose"],
          r.env(ANTHROPIC_BASE_URL=r.url, ANTHROPIC_API_KEY="unused",
                ANTHROPIC_SMALL_FAST_MODEL=CLAUDE_MODELS[1], API_TIMEOUT_MS="3600000"),
          user=user)
    events = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    blocks = [(e["type"], b) for e in events if e.get("type") in ("assistant", "user")
              for b in e["message"]["content"] if isinstance(b, dict)]
    uses = [b for kind, b in blocks if b.get("type") == "tool_use"]
    results = [b for kind, b in blocks if b.get("type") == "tool_result"]
    assert uses and isinstance(uses[0]["input"], dict), f"no tool call: {blocks}"
    assert any(res["tool_use_id"] == uses[0]["id"] for res in results), f"not executed: {blocks}"
    after = blocks[[b for _, b in blocks].index(results[0]) + 1:]
    assert any(kind == "assistant" for kind, _ in after), f"no continuation: {blocks}"
    final = events[-1]
    assert final.get("type") == "result" and not final.get("is_error"), final
    r.check(file=None)
