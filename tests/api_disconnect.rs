//! A client that hangs up cancels its request over real HTTP, even when nothing is being written
//! to it: a non-streaming request (chat, completions, responses) while it generates, and a
//! streamed one while it waits in the queue. actix-web alone would notice only at the next
//! write, so these requests would run to their end for nobody (and keep their session busy).

#[path = "fixtures/api/client.rs"]
mod client;

use client::*;
use futures::StreamExt;
use mtpx::api::testing::{test_config, TestServer, TEST_MODEL_ID};
use mtpx::config::KvMemory;
use mtpx::engine::{Engine, EngineConfig};
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use mtpx::scheduler::SchedulerStats;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Tokens a request asks for: the test model decodes thousands a second, so these take seconds,
/// far longer than noticing a hang-up (a socket looked at every 50 ms) takes.
const LONG: usize = 30_000;

fn server(max_seqs: usize) -> TestServer {
    let cfg = EngineConfig {
        max_seqs,
        context_window: Some(32_768),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F32,
        ..EngineConfig::default()
    };
    TestServer::start(&TestModelSpec::default(), cfg, test_config()).unwrap()
}

/// Polls the scheduler until `done` holds (at most ~20 s), returning the last stats.
async fn wait_for(engine: &Engine, done: impl Fn(&SchedulerStats) -> bool) -> SchedulerStats {
    for _ in 0..2000 {
        let stats = engine.scheduler_stats().await;
        if done(&stats) {
            return stats;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    engine.scheduler_stats().await
}

/// Sends `body` to `path` as a raw HTTP/1.1 request and returns the open connection, unread.
async fn send_raw(s: &TestServer, path: &str, body: &Value) -> tokio::net::TcpStream {
    let base = s.at("");
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    conn
}

#[actix_rt::test]
async fn hanging_up_on_a_non_streaming_request_cancels_it() {
    let s = server(16);
    let user = json!([{"role": "user", "content": "Write a very long story."}]);
    let requests = [
        (
            "/v1/chat/completions",
            json!({"model": TEST_MODEL_ID, "messages": user, "max_tokens": LONG,
                "logit_bias": ban_specials()}),
        ),
        (
            "/v1/completions",
            json!({"model": TEST_MODEL_ID, "prompt": "Once upon a time", "max_tokens": LONG,
                "logit_bias": ban_specials()}),
        ),
        (
            "/v1/responses",
            json!({"model": TEST_MODEL_ID, "input": "Write a very long story.",
                "max_output_tokens": LONG, "store": false, "logit_bias": ban_specials()}),
        ),
    ];
    let mut generated_before = 0;
    for (path, body) in requests {
        let conn = send_raw(&s, path, &body).await;
        // Generating: a sequence runs and has produced tokens.
        let running = wait_for(s.engine(), |st| {
            st.num_running == 1 && st.tokens_generated > generated_before
        })
        .await;
        if running.num_running != 1 {
            let mut conn = conn;
            let mut reply = vec![0u8; 4096];
            let n = tokio::io::AsyncReadExt::read(&mut conn, &mut reply)
                .await
                .unwrap();
            panic!(
                "{path}: never started: {running:?}: {}",
                String::from_utf8_lossy(&reply[..n])
            );
        }
        drop(conn);
        let after = wait_for(s.engine(), |st| st.num_running == 0 && st.num_waiting == 0).await;
        assert_eq!(after.num_running, 0, "{path}: still running: {after:?}");
        let generated = after.tokens_generated - generated_before;
        assert!(
            (generated as usize) < LONG,
            "{path}: ran to the end ({generated} tokens) for a client that left"
        );
        generated_before = after.tokens_generated;
    }
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "no page leaks");
    assert_eq!(
        s.engine().stream_decoders().await,
        0,
        "no decoder left behind by a client that hung up"
    );
    // The server still answers.
    let ok = post(
        &s.at("/v1/chat/completions"),
        &json!({"model": TEST_MODEL_ID, "messages": user, "max_tokens": 4,
            "logit_bias": ban_specials()}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    s.stop().await;
}

#[actix_rt::test]
async fn hanging_up_on_a_queued_stream_cancels_it_before_it_runs() {
    // One sequence at a time: the second request waits behind the first, sending only its role
    // chunk and keep-alive comments.
    let s = server(1);
    let stream = |content: &str, max_tokens: usize| {
        json!({"model": TEST_MODEL_ID, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": true, "logit_bias": ban_specials()})
    };
    let mut first = client()
        .post(s.at("/v1/chat/completions"))
        .send_json(&stream("Write a very long story.", LONG))
        .await
        .unwrap();
    first.next().await.unwrap().unwrap();
    let queued = send_raw(&s, "/v1/chat/completions", &stream("hi", LONG)).await;
    let waiting = wait_for(s.engine(), |st| st.num_waiting == 1).await;
    assert_eq!(waiting.num_waiting, 1, "never queued: {waiting:?}");
    drop(queued);
    let after = wait_for(s.engine(), |st| st.num_waiting == 0).await;
    assert_eq!(after.num_waiting, 0, "still queued: {after:?}");
    assert_eq!(after.num_running, 1, "the first request runs on: {after:?}");
    // The same on llama.cpp's `/completion` with the editor plugins' stops, whose watcher sits
    // between the engine and the reply: it must notice the client leaving while nothing comes.
    let editor = json!({"prompt": "hi", "n_predict": LONG, "n_indent": 4,
                        "t_max_predict_ms": 250, "logit_bias": ban_specials()});
    let queued = send_raw(&s, "/completion", &editor).await;
    let waiting = wait_for(s.engine(), |st| st.num_waiting == 1).await;
    assert_eq!(waiting.num_waiting, 1, "never queued: {waiting:?}");
    drop(queued);
    let after = wait_for(s.engine(), |st| st.num_waiting == 0).await;
    assert_eq!(
        (after.num_waiting, after.num_running),
        (0, 1),
        "left the queue while the first request still runs: {after:?}"
    );
    assert!((after.tokens_generated as usize) < LONG, "{after:?}");
    drop(first);
    let idle = wait_for(s.engine(), |st| st.num_running == 0).await;
    assert_eq!(idle.num_running, 0, "{idle:?}");
    assert!(
        (idle.tokens_generated as usize) < LONG,
        "neither request ran to its end: {idle:?}"
    );
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "no page leaks");
    s.stop().await;
}
