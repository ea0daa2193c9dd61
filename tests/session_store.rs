//! The session store (`--session-dir`): sessions and Responses chains resume after `kill -9`
//! from their pages on disk, with exactly the logits they had; torn, corrupt and foreign files
//! are skipped and the turn recomputes; another API key cannot resume a session; ids cannot
//! name paths; the disk budget evicts the oldest. Real `mtpx serve` processes on loopback over
//! the project's test model, real files.

mod common;

use common::{drain, greedy_with_logprobs, token_ids};
use mtpx::config::KvMemory;
use mtpx::engine::{Engine, EngineConfig};
use mtpx::kv::KvDtype;
use mtpx::model::test_model::{write_test_model, TestModelSpec};
use mtpx::model::ModelBundle;
use mtpx::session::store::StoreConfig;
use mtpx::session::SessionKey;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn store_config(dir: &Path, budget_bytes: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        budget_bytes,
        response_ttl: Duration::from_secs(3600),
    }
}

#[actix_rt::test]
async fn restored_pages_give_exactly_the_logits_of_the_pages_before_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_test_model(&dir.path().join("m"), &TestModelSpec::default()).unwrap();
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8] {
        let sessions = dir.path().join(format!("sessions-{dtype:?}"));
        let cfg = || EngineConfig {
            kv_dtype: dtype,
            kv_memory: KvMemory::Bytes(64 << 20),
            session_store: Some(store_config(&sessions, 1 << 30)),
            ..EngineConfig::default()
        };
        let key = SessionKey {
            scope: "default".into(),
            session_id: "agent".into(),
        };
        let turn = |tokens: Vec<u32>| {
            let mut req = greedy_with_logprobs(tokens, 12);
            req.session = Some(key.clone());
            req
        };
        let before = Engine::start(ModelBundle::load(&model).unwrap(), cfg()).unwrap();
        let prompt1 = token_ids(1, 700);
        let first = drain(before.submit(turn(prompt1.clone())).await.unwrap()).await;
        before.persist_sessions().await;
        let mut prompt2 = prompt1.clone();
        prompt2.extend(&first.token_ids);
        prompt2.extend(token_ids(2, 40));

        // A second engine on the same directory: what a restarted server is.
        let after = Engine::start(ModelBundle::load(&model).unwrap(), cfg()).unwrap();
        let resumed = drain(after.submit(turn(prompt2.clone())).await.unwrap()).await;
        let unbroken = drain(before.submit(turn(prompt2.clone())).await.unwrap()).await;
        assert_eq!(
            resumed.cached_tokens, unbroken.cached_tokens,
            "{dtype:?}: the restored session reuses what the live one does"
        );
        assert!(resumed.cached_tokens >= prompt1.len(), "{dtype:?}");
        assert_eq!(resumed.token_ids, unbroken.token_ids, "{dtype:?}");
        assert_eq!(
            resumed.logprobs, unbroken.logprobs,
            "{dtype:?}: restored K/V gives exactly the live K/V's logits"
        );
        let restores = after
            .session_store()
            .unwrap()
            .metrics
            .restores
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(restores, 1, "{dtype:?}");
    }
}

#[actix_rt::test]
async fn a_session_expired_from_memory_resumes_from_disk_and_leaks_no_page() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_test_model(&dir.path().join("m"), &TestModelSpec::default()).unwrap();
    let cfg = EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        session_store: Some(store_config(&dir.path().join("sessions"), 1 << 30)),
        ..EngineConfig::default()
    };
    let engine = Engine::start(ModelBundle::load(&model).unwrap(), cfg).unwrap();
    let turn = |tokens: Vec<u32>| {
        let mut req = greedy_with_logprobs(tokens, 8);
        req.session = Some(SessionKey {
            scope: "default".into(),
            session_id: "evicted".into(),
        });
        req
    };
    let prompt1 = token_ids(3, 500);
    let first = drain(engine.submit(turn(prompt1.clone())).await.unwrap()).await;
    engine.persist_sessions().await;
    // What the TTL, the LRU and pool pressure do: the session leaves memory, pages and all.
    engine.clear_caches().await;
    assert_eq!(engine.pool_stats().await.num_used, 0);
    let mut prompt2 = prompt1.clone();
    prompt2.extend(&first.token_ids);
    prompt2.extend(token_ids(4, 20));
    let second = drain(engine.submit(turn(prompt2)).await.unwrap()).await;
    assert!(second.error.is_none(), "{:?}", second.error);
    assert!(
        second.cached_tokens >= prompt1.len(),
        "resumed from disk: {} cached",
        second.cached_tokens
    );
    engine.clear_caches().await;
    assert_eq!(
        engine.pool_stats().await.num_used,
        0,
        "restored pages go back"
    );
}

/// An `mtpx serve` process; killed with SIGKILL when dropped.
struct Server {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Server {
    fn start(model: &Path, log: PathBuf, args: &[&str], envs: &[(&str, &str)]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mtpx"))
            .args(["serve", "--model"])
            .arg(model)
            .args(["--port", &port.to_string(), "--kv-memory", "64MiB"])
            .args(args)
            .env_remove("MTPX_API_KEY")
            .envs(envs.iter().copied())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    async fn ready(self) -> Self {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let up = awc::Client::default()
                .get(format!("{}/health", self.url))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if up {
                return self;
            }
            assert!(Instant::now() < deadline, "not ready: {}", self.log_text());
            actix_rt::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
        let mut req = awc::Client::builder()
            .timeout(Duration::from_secs(120))
            .finish()
            .post(format!("{}{path}", self.url));
        for (k, v) in headers {
            req = req.insert_header((*k, *v));
        }
        let mut resp = req.send_json(&body).await.unwrap();
        let status = resp.status().as_u16();
        let body: Value = resp.json().limit(64 << 20).await.unwrap();
        (status, body)
    }

    /// A greedy chat turn in session `id` (with `key` as API key when given).
    async fn chat(&self, id: &str, key: Option<&str>, messages: &[Value]) -> Value {
        let bearer = key.map(|k| format!("Bearer {k}"));
        let mut headers = vec![("x-session-id", id)];
        if let Some(b) = &bearer {
            headers.push(("authorization", b.as_str()));
        }
        let (status, body) = self
            .post(
                "/v1/chat/completions",
                &headers,
                json!({"model": "test-model", "messages": messages, "max_tokens": 16,
                       "temperature": 0, "logit_bias": banned_specials()}),
            )
            .await;
        assert_eq!(status, 200, "{body}\n{}", self.log_text());
        body
    }

    async fn metric(&self, name: &str) -> f64 {
        let mut resp = awc::Client::default()
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap();
        let text = String::from_utf8(resp.body().limit(1 << 22).await.unwrap().to_vec()).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    }

    /// Waits until the store has written `n` files (a finished turn's write is in the
    /// background: a kill before it loses that turn, not the file before it).
    async fn await_writes(&self, n: f64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.metric("mtpx_session_store_writes_total").await < n {
            assert!(Instant::now() < deadline, "the store wrote nothing");
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The random test model may end a reply anywhere: its special tokens (the vocabulary's last
/// nine) are banned so replies run to `max_tokens`.
fn banned_specials() -> Value {
    (503..512)
        .map(|id| (id.to_string(), json!(-100)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn reply_of(body: &Value) -> Value {
    json!({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
}

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn long_text(seed: u64, words: usize) -> String {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    const WORDS: [&str; 12] = [
        "session", "page", "token", "agent", "write", "read", "file", "turn", "disk", "cache",
        "model", "reply",
    ];
    (0..words)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

struct Fixture {
    dir: tempfile::TempDir,
    model: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let model = write_test_model(&dir.path().join("m"), &TestModelSpec::default()).unwrap();
        Fixture { dir, model }
    }
    fn sessions(&self) -> PathBuf {
        self.dir.path().join("sessions")
    }
    async fn serve(&self, name: &str, extra: &[&str]) -> Server {
        self.serve_with_env(name, extra, &[]).await
    }
    async fn serve_with_env(&self, name: &str, extra: &[&str], envs: &[(&str, &str)]) -> Server {
        let sessions = self.sessions();
        let mut args = vec!["--session-dir", sessions.to_str().unwrap()];
        args.extend(extra);
        let log = self.dir.path().join(format!("{name}.log"));
        Server::start(&self.model, log, &args, envs).ready().await
    }
    fn session_files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for sub in std::fs::read_dir(self.sessions()).unwrap().flatten() {
            if let Ok(entries) = std::fs::read_dir(sub.path()) {
                files.extend(
                    entries
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.extension().is_some_and(|x| x == "kv")),
                );
            }
        }
        files.sort();
        files
    }
}

#[actix_rt::test]
async fn a_chat_session_and_a_responses_chain_resume_after_kill_9() {
    let fx = Fixture::new();
    let reference = fx.serve("reference", &["--no-session-store"]).await;
    let conversation = [user(&long_text(1, 300))];
    let server = fx.serve("first", &[]).await;
    let first = server.chat("agent-1", None, &conversation).await;
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let (status, resp1) = server
        .post(
            "/v1/responses",
            &[],
            json!({"model": "test-model", "input": long_text(2, 300), "max_output_tokens": 8,
                   "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{resp1}");
    server.await_writes(3.0).await; // the session, the response, the chain's session
    server.kill();

    let server = fx.serve("second", &[]).await;
    let turn2 = [conversation[0].clone(), reply_of(&first), user("and then?")];
    let resumed = server.chat("agent-1", None, &turn2).await;
    assert!(
        cached(&resumed) >= first_prompt,
        "the restarted server reused {} of the {first_prompt} tokens it had: {resumed}",
        cached(&resumed)
    );
    // The same turn on a server that never stored anything, its first turn computed the same.
    let ref_first = reference.chat("agent-1", None, &conversation).await;
    assert_eq!(ref_first["choices"], first["choices"]);
    let unbroken = reference.chat("agent-1", None, &turn2).await;
    assert_eq!(
        resumed["choices"], unbroken["choices"],
        "greedy output as without the restart"
    );

    let (status, resp2) = server
        .post(
            "/v1/responses",
            &[],
            json!({"model": "test-model", "previous_response_id": resp1["id"],
                   "input": "go on", "max_output_tokens": 8, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "the chain resolves after the restart: {resp2}");
    let chain_cached = resp2["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let resp1_input = resp1["usage"]["input_tokens"].as_u64().unwrap();
    assert!(chain_cached >= resp1_input, "{resp2}");
    assert_eq!(
        server.metric("mtpx_session_store_restores_total").await,
        2.0
    );
}

#[actix_rt::test]
async fn torn_corrupt_and_foreign_files_are_skipped_and_the_turn_recomputes() {
    let fx = Fixture::new();
    let conversation = [user(&long_text(3, 400))];
    let server = fx.serve("write", &[]).await;
    let first = server.chat("s", None, &conversation).await;
    server.await_writes(1.0).await;
    server.kill();
    let [file] = fx.session_files().try_into().unwrap();
    let good = std::fs::read(&file).unwrap();
    let turn2 = [conversation[0].clone(), reply_of(&first), user("next")];

    let mut flipped = good.clone();
    let at = good.len() - 1000; // inside the last page block
    flipped[at] ^= 1;
    let truncated = good[..good.len() - 7].to_vec();
    let mut foreign = good.clone();
    // Another model's file under this session's name (the header's model hash differs).
    let hash_at = foreign
        .windows(15)
        .position(|w| w == b"\"model_sha256\":")
        .unwrap()
        + 17;
    foreign[hash_at] = if foreign[hash_at] == b'0' { b'1' } else { b'0' };
    let header_end = 8 + 4 + u32::from_le_bytes(good[8..12].try_into().unwrap()) as usize;
    let crc = crc32fast::hash(&foreign[..header_end]);
    foreign[header_end..header_end + 4].copy_from_slice(&crc.to_le_bytes());

    for (name, bytes, counter) in [
        ("flipped", flipped, "mtpx_session_store_torn_files_total"),
        (
            "truncated",
            truncated,
            "mtpx_session_store_torn_files_total",
        ),
        ("foreign", foreign, "mtpx_session_store_foreign_files_total"),
    ] {
        std::fs::write(&file, &bytes).unwrap();
        let server = fx.serve(name, &[]).await;
        let body = server.chat("s", None, &turn2).await;
        assert_eq!(cached(&body), 0, "{name}: nothing restored from a bad file");
        assert_eq!(server.metric(counter).await, 1.0, "{name}");
        assert_eq!(
            server.metric("mtpx_session_store_restores_total").await,
            0.0
        );
        assert!(server.log_text().contains("session file"), "{name}: warned");
        server.kill();
    }
    std::fs::write(&file, &good).unwrap();
    let server = fx.serve("good", &[]).await;
    let body = server.chat("s", None, &turn2).await;
    assert!(cached(&body) > 0, "the intact file restores: {body}");
}

#[actix_rt::test]
async fn another_key_cannot_resume_a_session_and_ids_cannot_name_paths() {
    let fx = Fixture::new();
    let conversation = [user(&long_text(4, 300))];
    let server = fx.serve("keys", &["--api-key", "key-a,key-b"]).await;
    let hostile = ["../../escape", "/tmp/abs", "a/../../b", "..", "..\\..\\win"];
    let first = server.chat("shared", Some("key-a"), &conversation).await;
    for id in hostile {
        server.chat(id, Some("key-a"), &conversation).await;
    }
    server.await_writes(1.0 + hostile.len() as f64).await;
    server.kill();
    let outside: Vec<_> = std::fs::read_dir(fx.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "m" && n != "sessions" && !n.ends_with(".log"))
        .collect();
    assert!(outside.is_empty(), "files outside the store: {outside:?}");
    assert_eq!(fx.session_files().len(), 1 + hostile.len());

    let server = fx.serve("keys-again", &["--api-key", "key-a,key-b"]).await;
    let turn2 = [conversation[0].clone(), reply_of(&first), user("more")];
    let other = server.chat("shared", Some("key-b"), &turn2).await;
    assert_eq!(cached(&other), 0, "key-b does not resume key-a's session");
    let own = server.chat("shared", Some("key-a"), &turn2).await;
    assert!(cached(&own) > 0, "key-a does: {own}");
}

#[actix_rt::test]
async fn past_the_disk_budget_the_oldest_sessions_are_evicted_without_an_error() {
    let fx = Fixture::new();
    let first_turn = |i: u64| [user(&long_text(10 + i, 300))];
    // Room for two and a half sessions of the size these turns leave.
    let probe = fx.serve("probe", &[]).await;
    probe.chat("probe", None, &first_turn(99)).await;
    probe.await_writes(1.0).await;
    probe.kill();
    let [file] = fx.session_files().try_into().unwrap();
    let budget = std::fs::metadata(&file).unwrap().len() * 5 / 2;
    std::fs::remove_file(file).unwrap();
    let server = fx
        .serve("budget", &["--session-disk", &budget.to_string()])
        .await;
    let mut firsts = Vec::new();
    for i in 0..6 {
        firsts.push(server.chat(&format!("s{i}"), None, &first_turn(i)).await);
        server.await_writes(i as f64 + 1.0).await;
    }
    let bytes = server.metric("mtpx_session_store_bytes").await;
    assert!(bytes <= budget as f64, "{bytes} bytes on disk");
    let evicted = server
        .metric("mtpx_session_store_evicted_files_total")
        .await;
    let kept = fx.session_files().len();
    assert!(
        evicted >= 1.0 && kept >= 1,
        "evicted {evicted}, kept {kept}"
    );
    assert_eq!(evicted as usize + kept, 6);
    server.kill();
    // After a restart the newest sessions resume and the evicted, oldest ones recompute,
    // without an error either way.
    let server = fx
        .serve("budget-again", &["--session-disk", &budget.to_string()])
        .await;
    // (Newest first: the recomputed sessions' new files evict the oldest in turn.)
    for i in (0..6u64).rev() {
        let mut turn = first_turn(i).to_vec();
        turn.push(reply_of(&firsts[i as usize]));
        turn.push(user("again"));
        let body = server.chat(&format!("s{i}"), None, &turn).await;
        // (A few tokens of the chat template's opening come from the prefix cache anyway.)
        let resumed = cached(&body) > 100;
        assert_eq!(resumed, i as usize >= 6 - kept, "s{i}: {body}");
    }
}

#[actix_rt::test]
async fn kill_9_at_random_instants_never_loads_a_torn_file() {
    let fx = Fixture::new();
    let reference = fx.serve("reference", &["--no-session-store"]).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let conversations: Vec<Vec<Value>> = (0..3)
        .map(|i| vec![user(&long_text(20 + i, 250))])
        .collect();
    for round in 0..6 {
        let server = fx.serve(&format!("round{round}"), &[]).await;
        // Each session's next turn: whatever survived the last kill, the reply is the one a
        // server that never stored anything gives.
        for (i, conv) in conversations.iter().enumerate() {
            let id = format!("agent-{i}");
            let mut turn = conv.clone();
            turn.push(user(&format!("round {round}")));
            let got = server.chat(&id, None, &turn).await;
            let want = reference.chat(&format!("{id}-r{round}"), None, &turn).await;
            assert_eq!(got["choices"], want["choices"], "round {round}, {id}");
        }
        // Then turns in flight while the process is killed at a random instant.
        let url = server.url.clone();
        let pending: Vec<_> = conversations
            .iter()
            .enumerate()
            .map(|(i, conv)| {
                let mut turn = conv.clone();
                turn.push(user(&long_text(100 + round, 200)));
                let url = url.clone();
                actix_rt::spawn(async move {
                    let _ = awc::Client::default()
                        .post(format!("{url}/v1/chat/completions"))
                        .insert_header(("x-session-id", format!("agent-{i}")))
                        .send_json(&json!({"model": "test-model", "messages": turn,
                                           "max_tokens": 8, "temperature": 0}))
                        .await;
                })
            })
            .collect();
        let delay = rng.random_range(0..40);
        actix_rt::time::sleep(Duration::from_millis(delay)).await;
        server.kill();
        for p in pending {
            let _ = p.await;
        }
    }
}

#[actix_rt::test]
async fn sigterm_mid_turn_drains_the_turn_to_disk_and_health_reports_it() {
    let fx = Fixture::new();
    // A slow disk: the turn's write is still queued when the HTTP server has stopped.
    let slow_disk = [("MTPX_TEST_STORE_DELAY_MS", "1500")];
    let server = fx.serve_with_env("drain", &[], &slow_disk).await;
    let mut resp = awc::Client::default()
        .get(format!("{}/get_load", server.url))
        .send()
        .await
        .unwrap();
    let load: Value = resp.json().await.unwrap();
    assert_eq!(load, json!({"load": 0}));
    let conversation = [user(&long_text(30, 300))];
    // A streamed turn, stopped with SIGTERM as soon as its first token arrives.
    let mut stream = awc::Client::default()
        .post(format!("{}/v1/chat/completions", server.url))
        .insert_header(("x-session-id", "drained"))
        .send_json(
            &json!({"model": "test-model", "messages": conversation, "max_tokens": 400,
                           "temperature": 0, "stream": true, "logit_bias": banned_specials()}),
        )
        .await
        .unwrap();
    let first = futures::StreamExt::next(&mut stream)
        .await
        .unwrap()
        .unwrap();
    assert!(!first.is_empty());
    let pid = server.child.id() as i32;
    // SAFETY: signalling a child process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let mut body = first.to_vec();
    while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
        body.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("\"finish_reason\":\"length\""),
        "the turn ran to its end: {text}"
    );
    let mut server = server;
    let status = server.child.wait().unwrap();
    assert!(
        status.success(),
        "a graceful stop exits 0: {}",
        server.log_text()
    );
    let reply: String = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.strip_prefix("data: ")?).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();

    let server = fx.serve("after-drain", &[]).await;
    let turn2 = [
        conversation[0].clone(),
        json!({"role": "assistant", "content": reply}),
        user("next"),
    ];
    let body = server.chat("drained", None, &turn2).await;
    let first_prompt = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(&body) > first_prompt / 2,
        "the drained turn was written before the exit: {body}"
    );
}

impl Server {
    async fn writes(&self) -> f64 {
        self.metric("mtpx_session_store_writes_total").await
    }

    /// A greedy Responses turn continuing `prev` (when given); its input is `long_text` of
    /// `turn`.
    async fn respond(&self, prev: &Option<Value>, turn: u64) -> Option<Value> {
        let mut body = json!({"model": "test-model", "input": long_text(10 + turn, 60),
                              "max_output_tokens": 8, "temperature": 0,
                              "logit_bias": banned_specials()});
        if let Some(prev) = prev {
            body["previous_response_id"] = prev["id"].clone();
        }
        let (status, resp) = self.post("/v1/responses", &[], body).await;
        assert_eq!(status, 200, "turn {turn}: {resp}");
        Some(resp)
    }
}

/// The text a Responses turn wrote.
fn output_text(resp: &Value) -> String {
    resp["output"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|item| item["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["text"].as_str().map(str::to_owned))
        .collect()
}

/// Replicas sharing one session directory behind a router whose stickiness failed: turns of
/// a Responses chain and of a chat session land on another replica each time. Every turn
/// resolves (a stored response is on disk before its client sees it end, even when the next
/// turn is sent at once), gives the output of one server that saw the whole conversation, and
/// resumes another replica's pages once they are written.
#[actix_rt::test]
async fn replicas_sharing_the_directory_continue_each_others_chains_and_sessions() {
    let fx = Fixture::new();
    let reference = fx.serve("reference", &["--no-session-store"]).await;
    // A slow disk: pages reach it 100 ms after their turn ends.
    let slow = [("MTPX_TEST_STORE_DELAY_MS", "100")];
    let [a, b, c] = [
        fx.serve_with_env("a", &[], &slow).await,
        fx.serve_with_env("b", &[], &slow).await,
        fx.serve_with_env("c", &[], &slow).await,
    ];
    let mut unbroken = None;
    let mut expected = Vec::new();
    for turn in 0..4 {
        unbroken = reference.respond(&unbroken, turn).await;
        expected.push(output_text(unbroken.as_ref().unwrap()));
    }
    // Turn 1 is sent to b the moment a answered turn 0.
    let (a0, b0) = (a.writes().await, b.writes().await);
    let t0 = a.respond(&None, 0).await;
    let t1 = b.respond(&t0, 1).await;
    // Turn 2 goes to c once a's and b's pages are written (two writes each: the stored
    // response and the conversation's pages).
    a.await_writes(a0 + 2.0).await;
    b.await_writes(b0 + 2.0).await;
    let t2 = c.respond(&t1, 2).await;
    let t2_body = t2.as_ref().unwrap();
    let t2_cached = t2_body["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        t2_cached > 0,
        "c resumed the pages a and b wrote: {t2_body}"
    );
    // Turn 3 back on a, whose memory holds turn 0 only.
    let t3 = a.respond(&t2, 3).await;
    let got: Vec<String> = [t0, t1, t2, t3].iter().flatten().map(output_text).collect();
    assert_eq!(
        got, expected,
        "each turn as on one server that saw them all"
    );

    // A chat session: turn 0 on a, turn 1 on b (from a's file), turn 2 on a again, whose
    // memory holds turn 0 only.
    let mut conversation = vec![user(&long_text(20, 200))];
    for (turn, server) in [&a, &b, &a].into_iter().enumerate() {
        let before = server.writes().await;
        let got = server.chat("shared-agent", None, &conversation).await;
        let unbroken = reference.chat("shared-agent", None, &conversation).await;
        assert_eq!(got["choices"], unbroken["choices"], "chat turn {turn}");
        if turn == 1 {
            assert!(cached(&got) > 0, "b resumed a's pages: {got}");
        }
        server.await_writes(before + 1.0).await;
        conversation.push(reply_of(&got));
        conversation.push(user(&long_text(30 + turn as u64, 40)));
    }
}
