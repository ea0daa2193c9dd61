"""Real coding agents, unmodified, against `mtpx serve` on a real model.

Each agent's pinned npm release (package.json here) runs headless on a small task in a fresh
folder, configured the way its documentation says to point it at a local OpenAI- or
Anthropic-compatible server. Asserted for each, from the agent's own JSON event stream and the server's log:

- it exits 0 and reports no error event;
- it executed at least one tool call whose arguments it parsed (whether the call did what the
  task asked, e.g. wrote the file, is printed: that is the model's part, not the server's);
- after the tool result went back, the model answered again (a later model call finished);
- that continuation's prompt reused at least 90% of the previous turn's (`cached_tokens` in
  the server's per-request log line).

The tasks name the tool to call: the test is of the server under a real agent loop, not of a
small model's judgement. Where the model answers in prose instead, a second wording is tried
(see `Run.attempt`). Claude Code runs with `--bare --tools Read,Write` (its documented
minimal mode): its full prompt is ~20K tokens, several minutes of prefill per run on two cores.
The server runs with `--temperature 0 --seed 0`: the agents' requests that give neither are
decoded greedily (seeded where they do give a temperature), and each agent works in the same
folder every run, so its prompts, and the replies, repeat from run to run on one CPU.
`MTPX_AGENT_MODEL` picks the model (default: qwen2.5-coder-1.5b; the 0.5B does not follow
Codex's 8.6K-token instructions to a tool call).
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from conftest import free_port, stop_server, wait_healthy  # noqa: E402
from server_log import finished_requests  # noqa: E402

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
TASK_AGAIN = (
    "Use the write tool to create hello.py containing print('hello from mtpx'). "
    "Do not answer before calling it."
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

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-logs") / "serve.log"
    port = free_port()
    args = [MTPX_BIN, "serve", "--model", MODEL, "--port", str(port), "--seed", "0",
            "--temperature", "0", "--session-dir", str(log.parent / "sessions")]
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


@dataclass
class Transcript:
    """What an agent's own event stream says happened."""

    errors: list[str] = field(default_factory=list)
    # (tool name, arguments as the agent parsed them) for each call the agent executed.
    executed: list[tuple[str, object]] = field(default_factory=list)
    # Whether the model answered again after the first executed call's result went back.
    answered_after_tool: bool = False


class Run:
    def __init__(self, server, workdir: Path):
        self.url, self.log = server
        self.workdir = workdir
        self.home = workdir.parent / "home"
        self.home.mkdir(exist_ok=True)
        self.output = ""

    def env(self, **extra) -> dict:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
        return keep | QUIET_ENV | {"HOME": str(self.home)} | extra

    def fresh_workdir(self, user: str | None = None) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir()
        if user is not None:
            shutil.chown(self.workdir, user)

    def run(self, cmd: list[str], env: dict, user: str | None = None) -> list[dict]:
        """Runs the agent; returns the JSON events it printed, one per line."""
        self.start = self.log.stat().st_size
        if user is not None:
            # `runuser` keeps the environment given with `env`.
            cmd = ["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in env.items()], *cmd]
            env = None
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.workdir, env=env, capture_output=True, text=True,
                              timeout=AGENT_TIMEOUT, stdin=subprocess.DEVNULL)
        self.output = proc.stdout + proc.stderr
        took = time.monotonic() - started
        print(f"{Path(cmd[0]).name} exited {proc.returncode} after {took:.0f} s")
        print(self.output[-4000:])
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{self.output[-4000:]}"
        events = []
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return events

    def attempt(self, tasks: list[str], run_task, user: str | None = None) -> Transcript:
        """Runs `run_task(task)` in a fresh working folder for each wording until the model
        executes a tool call.

        Whether a 1.5B model calls a tool or answers in prose can turn on a near-tie in its
        logits, and those differ in the last bits between CPUs (each kernel path sums in its
        own order): a second wording keeps the test about the server, not about that choice.
        """
        for n, task in enumerate(tasks):
            self.fresh_workdir(user)
            transcript = run_task(task)
            if transcript.executed or transcript.errors:
                return transcript
            print(f"wording {n + 1} of {len(tasks)}: the model answered without calling a tool")
        return transcript

    def check(self, transcript: Transcript, file: str) -> list[dict]:
        requests = finished_requests(self.log, self.start)
        print("requests:", json.dumps(requests))
        print("executed:", json.dumps(transcript.executed)[:2000])
        written = self.workdir / file
        print(f"{file} written: {written.exists()}")
        assert not transcript.errors, transcript.errors
        assert not re.search(r"\b(api error|APIError|stream error|error: 4\d\d|error: 5\d\d)\b",
                             self.output, re.I), self.output[-4000:]
        assert transcript.executed, "no tool call was executed"
        name, args = transcript.executed[0]
        assert isinstance(args, dict) or (isinstance(args, str) and args), (
            f"the call to {name} has no parsed arguments: {args!r}"
        )
        assert transcript.answered_after_tool, "no answer after the tool result"
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


def codex_transcript(events: list[dict]) -> Transcript:
    """`codex exec --json`: thread/turn/item events; a run's fatal errors are top-level
    `error` and `turn.failed` (an `error` item is a warning, e.g. unknown model metadata)."""
    t = Transcript()
    for e in events:
        kind, item = e.get("type"), e.get("item") or {}
        if kind in ("error", "turn.failed"):
            t.errors.append(json.dumps(e))
        elif kind == "item.completed" and item.get("type") in ("command_execution", "file_change",
                                                                "mcp_tool_call"):
            if item.get("status") == "completed":
                t.executed.append((item["type"], item.get("command") or item.get("changes")))
        elif kind == "turn.completed" and t.executed:
            # A turn completes only on a model response that calls no tool (its text, if any,
            # is an `agent_message` item; a 1-token empty answer is one too).
            t.answered_after_tool = True
    return t


def test_codex_cli_over_the_responses_api(agent_run):
    r = agent_run
    codex_home = r.home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "mtpx"\n'
        "[model_providers.mtpx]\n"
        f'name = "mtpx"\nbase_url = "{r.url}/v1"\nwire_api = "responses"\n'
    )

    def run_task(task: str) -> Transcript:
        subprocess.run(["git", "init", "-q"], cwd=r.workdir, check=True)
        return codex_transcript(r.run(
            [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", task],
            r.env(CODEX_HOME=str(codex_home), OPENAI_API_KEY="unused")))

    transcript = r.attempt([
        "Run this shell command with exec_command: echo hello from mtpx > hello.txt",
        "Use exec_command to run `echo hello from mtpx > hello.txt`. Do not answer before running it.",
    ], run_task)
    r.check(transcript, "hello.txt")


def pi_transcript(events: list[dict]) -> Transcript:
    """`pi --mode json`: the agent loop's events; a failed model call ends its turn with an
    `errorMessage` on the assistant message."""
    t = Transcript()
    args = {}
    for e in events:
        kind = e.get("type")
        if kind == "tool_execution_start":
            args[e["toolCallId"]] = e.get("args")
        elif kind == "tool_execution_end":
            t.executed.append((e["toolName"], args.get(e["toolCallId"])))
        elif kind == "message_end" and (e.get("message") or {}).get("role") == "assistant":
            message = e["message"]
            if message.get("errorMessage") or message.get("stopReason") == "error":
                t.errors.append(message.get("errorMessage") or json.dumps(message)[:1000])
            elif t.executed:
                t.answered_after_tool = True
    return t


def test_pi_over_chat_completions(agent_run):
    r = agent_run
    agent_dir = r.home / ".pi" / "agent"
    agent_dir.mkdir(parents=True)
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"mtpx": {
        "baseUrl": f"{r.url}/v1", "api": "openai-completions", "apiKey": "unused",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": MODEL, "contextWindow": 32768, "maxTokens": 4096}],
    }}}))

    def run_task(task: str) -> Transcript:
        return pi_transcript(r.run(
            [str(BIN / "pi"), "--provider", "mtpx", "--model", MODEL, "--no-session",
             "--mode", "json", "-p", task], r.env()))

    r.check(r.attempt([TASK, TASK_AGAIN], run_task), "hello.py")


def opencode_transcript(events: list[dict]) -> Transcript:
    """`opencode run --format json`: steps (one model call each) and their parts."""
    t = Transcript()
    step_after_tool = False
    for e in events:
        kind, part = e.get("type"), e.get("part") or {}
        if kind == "error":
            t.errors.append(json.dumps(e)[:1000])
        elif kind == "tool_use" and (part.get("state") or {}).get("status") == "completed":
            t.executed.append((part.get("tool"), part["state"].get("input")))
        elif kind == "step_start" and t.executed:
            step_after_tool = True
        elif kind == "step_finish" and step_after_tool:
            t.answered_after_tool = True
    return t


def test_opencode_over_chat_completions(agent_run):
    r = agent_run
    config = json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mtpx": {
            "npm": "@ai-sdk/openai-compatible", "name": "mtpx",
            "options": {"baseURL": f"{r.url}/v1"},
            "models": {MODEL: {"name": MODEL}},
        }},
        "model": f"mtpx/{MODEL}",
        "share": "disabled",
        "autoupdate": False,
    })

    def run_task(task: str) -> Transcript:
        (r.workdir / "opencode.json").write_text(config)
        return opencode_transcript(r.run(
            [str(BIN / "opencode"), "run", "--format", "json", "--model", f"mtpx/{MODEL}", task],
            r.env()))

    r.check(r.attempt([TASK, TASK_AGAIN], run_task), "hello.py")


def agent_user() -> str:
    """An unprivileged user to run Claude Code as (it refuses to skip permissions as root)."""
    name = "mtpx-agent"
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True)
    return name


def claude_transcript(events: list[dict]) -> Transcript:
    """`claude -p --output-format stream-json`: the conversation's messages, then a `result`."""
    t = Transcript()
    uses = {}
    for e in events:
        if e.get("type") == "result" and e.get("is_error"):
            t.errors.append(json.dumps(e)[:1000])
        if e.get("type") not in ("assistant", "user"):
            continue
        if e["type"] == "assistant" and t.executed:
            t.answered_after_tool = True
        for block in e["message"]["content"]:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                uses[block["id"]] = (block["name"], block.get("input"))
            elif block.get("type") == "tool_result" and block.get("tool_use_id") in uses:
                t.executed.append(uses[block["tool_use_id"]])
    if not events or events[-1].get("type") != "result":
        t.errors.append("no final result event")
    return t


def test_claude_code_over_the_messages_api(agent_run):
    r = agent_run
    user = None
    if os.geteuid() == 0:
        user = agent_user()
        for p in (r.workdir.parent, r.home):
            shutil.chown(p, user)

    def run_task(task: str) -> Transcript:
        return claude_transcript(r.run(
            [str(BIN / "claude"), "-p", task, "--model", CLAUDE_MODELS[0], "--bare",
             "--tools", "Read,Write", "--dangerously-skip-permissions",
             "--output-format", "stream-json", "--verbose"],
            r.env(ANTHROPIC_BASE_URL=r.url, ANTHROPIC_API_KEY="unused",
                  ANTHROPIC_SMALL_FAST_MODEL=CLAUDE_MODELS[1], API_TIMEOUT_MS="3600000"),
            user=user))

    r.check(r.attempt([
        "The file hello.py does not exist yet. Call the Write tool to create hello.py with "
        "the content print('hello from mtpx'), then reply with one short sentence.",
        TASK_AGAIN.replace("the write tool", "the Write tool"),
    ], run_task, user), "hello.py")
