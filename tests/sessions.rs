//! Persistent sessions: reuse up to the first differing token, listing, TTL expiry.

mod common;

use common::*;
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use mtpx::session::SessionKey;
use std::time::{Duration, Instant};

fn key(id: &str) -> SessionKey {
    SessionKey {
        scope: "key-a".into(),
        session_id: id.into(),
    }
}

fn cfg(ttl: Duration) -> EngineConfig {
    EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        session_ttl: ttl,
        ..EngineConfig::default()
    }
}

#[actix_rt::test]
async fn a_rerendered_history_is_reused_up_to_the_divergence() {
    let t = start_engine(&TestModelSpec::default(), cfg(Duration::from_secs(3600)));
    let common_part = token_ids(1, 600);
    let mut first = common_part.clone();
    first.extend(token_ids(2, 300));
    let mut req = greedy_tokens(first, 8);
    req.session = Some(key("s"));
    assert!(run(&t.engine, req).await.error.is_none());

    // The client strips the older turns' tail and sends something else after the common part.
    let mut second = common_part.clone();
    second.extend(token_ids(3, 100));
    let mut req = greedy_with_logprobs(second.clone(), 8);
    req.session = Some(key("s"));
    let out = run(&t.engine, req).await;
    // 600 is inside a page the prefix cache shares: its first 8 positions are copied into a
    // page of the session's own (copy-on-write), so all 600 are reused.
    assert_eq!(out.cached_tokens, 600, "reused up to the divergence");

    // The reused K/V is correct: same output as a cold run of the same prompt.
    t.engine.clear_caches().await;
    let cold = run(&t.engine, greedy_with_logprobs(second, 8)).await;
    assert_eq!(cold.cached_tokens, 0);
    assert_same_generation(&cold, &out, 1e-4);
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0, "no page leaks");
}

#[actix_rt::test]
async fn sessions_are_listed_with_their_tokens_and_pages_and_scoped_by_key() {
    let t = start_engine(&TestModelSpec::default(), cfg(Duration::from_secs(3600)));
    let mut req = greedy_tokens(token_ids(5, 100), 10);
    req.session = Some(key("listed"));
    run(&t.engine, req).await;
    let mut other = greedy_tokens(token_ids(5, 100), 10);
    other.session = Some(SessionKey {
        scope: "key-b".into(),
        session_id: "listed".into(),
    });
    let out = run(&t.engine, other).await;
    assert_eq!(
        out.cached_tokens, 96,
        "another key's session only shares the prefix cache"
    );
    let sessions = t.engine.sessions().await;
    assert_eq!(sessions.len(), 2);
    for s in &sessions {
        assert_eq!(s.session_id, "listed");
        // 100 prompt tokens plus the 9 generated tokens that were fed back.
        assert_eq!(s.num_tokens, 109);
        assert_eq!(s.num_pages, 109usize.div_ceil(16));
        assert!(!s.turn_in_progress);
    }
}

#[actix_rt::test]
async fn idle_sessions_expire_after_their_ttl_and_release_their_pages() {
    let t = start_engine(&TestModelSpec::default(), cfg(Duration::from_millis(300)));
    let mut req = greedy_tokens(token_ids(9, 200), 4);
    req.session = Some(key("short-lived"));
    run(&t.engine, req).await;
    assert_eq!(t.engine.sessions().await.len(), 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.engine.sessions().await.is_empty() {
        assert!(Instant::now() < deadline, "the session never expired");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    // Only the prefix cache may still hold pages, and it holds them alone (evictable).
    let stats = t.engine.pool_stats().await;
    assert_eq!(stats.num_used, stats.num_evictable, "{stats:?}");
}

#[actix_rt::test]
async fn under_memory_pressure_the_least_recently_used_idle_session_gives_way() {
    // 24 pages of 16 tokens (the test model's KV is 2 layers × 2 heads × 16 dims × f32).
    let small = EngineConfig {
        kv_memory: KvMemory::Bytes(24 * 2 * 2 * 2 * 16 * 16 * 4),
        ..cfg(Duration::from_secs(3600))
    };
    let t = start_engine(&TestModelSpec::default(), small);
    for (i, id) in ["older", "newer"].iter().enumerate() {
        let mut req = greedy_tokens(token_ids(20 + i as u64, 150), 4);
        req.session = Some(key(id));
        assert!(run(&t.engine, req).await.error.is_none());
    }
    assert_eq!(t.engine.sessions().await.len(), 2);
    // A request that needs most of the pool: the idle sessions must make room.
    let out = run(&t.engine, greedy_tokens(token_ids(30, 250), 20)).await;
    assert!(out.error.is_none(), "{:?}", out.error);
    assert_eq!(out.token_ids.len(), 20);
    let left: Vec<String> = t
        .engine
        .sessions()
        .await
        .into_iter()
        .map(|s| s.session_id)
        .collect();
    assert!(
        !left.contains(&"older".to_string()),
        "the older session goes first: {left:?}"
    );
}
