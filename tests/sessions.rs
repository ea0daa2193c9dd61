//! Persistent sessions: reuse up to the first differing token, listing, TTL expiry.

mod common;

use common::*;
use mtpx::config::KvMemory;
use mtpx::engine::{Engine, EngineConfig, Prompt};
use mtpx::kv::KvDtype;
use mtpx::model::test_model::write_test_model;
use mtpx::model::test_model::TestModelSpec;
use mtpx::model::ModelBundle;
use mtpx::session::SessionKey;
use mtpx::tokenizer::{is_byte_level, token_bytes};
use serde_json::json;
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

/// A client sends its session key with a side request too (opencode's title request): the
/// session then holds that request's short conversation, and the next turn of the real one,
/// computed meanwhile without the session, is found in the prefix cache rather than computed
/// again, and gives the same output as a cold run.
#[actix_rt::test]
async fn a_turn_takes_the_prefix_cache_when_it_holds_more_than_the_session() {
    let t = start_engine(&TestModelSpec::default(), cfg(Duration::from_secs(3600)));
    let system = token_ids(1, 40);
    let mut turn = system.clone();
    turn.extend(token_ids(2, 500));
    // The turn itself, computed without the session (it was busy with the side request).
    assert!(run(&t.engine, greedy_tokens(turn.clone(), 4))
        .await
        .error
        .is_none());
    // The side request shares only the system prompt; the session now holds it.
    let mut side = system.clone();
    side.extend(token_ids(3, 30));
    let mut req = greedy_tokens(side, 4);
    req.session = Some(key("ses"));
    assert!(run(&t.engine, req).await.error.is_none());
    // The next turn, in the session: the cache has all 540 prompt tokens of the turn.
    let mut next = turn.clone();
    next.extend(token_ids(4, 20));
    let mut req = greedy_with_logprobs(next.clone(), 8);
    req.session = Some(key("ses"));
    let out = run(&t.engine, req).await;
    assert!(
        out.cached_tokens >= 528,
        "found {} cached tokens of the turn's 540",
        out.cached_tokens
    );
    t.engine.clear_caches().await;
    let cold = run(&t.engine, greedy_with_logprobs(next, 8)).await;
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

/// A sampled reply may split its text into tokens the tokenizer would not choose. The next turn,
/// sent as text, still reuses the whole reply's K/V: the session's own tokens stand in for the
/// fresh ones where they spell the same text.
#[actix_rt::test]
async fn a_sampled_reply_is_reused_whole_by_the_next_turn_sent_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_test_model(dir.path(), &TestModelSpec::default()).unwrap();
    let bundle = ModelBundle::load(&path).unwrap();
    // The reply is sampled from printable ASCII tokens: a lone byte of a character would come
    // back as U+FFFD, which is not what the model said.
    let tok = bundle.tokenizer.clone();
    let byte_level = is_byte_level(&tok);
    let not_ascii: std::collections::BTreeMap<u32, f32> = (0..tok.get_vocab_size(true) as u32)
        .filter(|&id| {
            let b = token_bytes(&tok, byte_level, id);
            b.is_empty() || b.iter().any(|c| !(0x20..0x7f).contains(c))
        })
        .map(|id| (id, -100.0))
        .collect();
    let engine = Engine::start(bundle, cfg(Duration::from_secs(3600))).unwrap();
    let chat = |messages: serde_json::Value, max_tokens: usize| {
        let mut req = greedy_tokens(Vec::new(), max_tokens);
        req.prompt = Prompt::Chat {
            messages,
            tools: None,
        };
        req.session = Some(key("sampled"));
        req
    };
    let user = |text: &str| json!({"role": "user", "content": text});
    let mut first = chat(json!([user("hello there")]), 40);
    first.sampling.temperature = 1.0;
    first.sampling.seed = Some(7);
    first.sampling.logit_bias.extend(not_ascii);
    let reply = run(&engine, first).await;
    assert!(reply.error.is_none(), "{:?}", reply.error);
    assert_eq!(reply.token_ids.len(), 40);
    // The premise: the tokenizer spells the reply with other tokens.
    let fresh = engine
        .tokenize(&Prompt::Text(reply.text.clone()))
        .await
        .unwrap();
    assert_ne!(
        fresh, reply.token_ids,
        "this seed's reply is the tokenizer's own split"
    );

    let messages =
        json!([user("hello there"), {"role": "assistant", "content": reply.text}, user("more")]);
    let next = run(&engine, chat(messages.clone(), 8)).await;
    assert!(next.error.is_none(), "{:?}", next.error);
    // Everything the session computed: the first prompt and the reply but its last token.
    assert_eq!(next.cached_tokens, reply.prompt_tokens + 39);
    engine.clear_caches().await;
    assert_eq!(engine.pool_stats().await.num_used, 0, "no page leaks");
}
