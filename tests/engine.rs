//! The actor runtime end to end on the generated test model: batching equals sequential
//! execution, pages never leak through cancellations and disconnects, pool exhaustion queues or
//! preempts without changing outputs, and the prefix cache skips shared prefills.

mod common;

use common::*;
use mtpx::config::KvMemory;
use mtpx::engine::{EngineConfig, GenerateRequest, Prompt};
use mtpx::error::EngineError;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use mtpx::scheduler::{FinishReason, MaxTokensCut};
use mtpx::session::SessionKey;

fn cfg() -> EngineConfig {
    EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        ..EngineConfig::default()
    }
}

#[actix_rt::test]
async fn sixteen_concurrent_greedy_requests_equal_each_alone() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| token_ids(i, 20 + 13 * i as usize))
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(run(&t.engine, greedy_tokens(p.clone(), 24)).await.token_ids);
    }
    let streams: Vec<_> = futures::future::join_all(
        prompts
            .iter()
            .map(|p| t.engine.submit(greedy_tokens(p.clone(), 24))),
    )
    .await;
    let together = futures::future::join_all(streams.into_iter().map(|s| drain(s.unwrap()))).await;
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.len(), 24);
        assert_eq!(*a, b.token_ids, "request {i} differs when batched");
    }
    assert!(t.engine.scheduler_stats().await.num_steps > 0);
}

#[actix_rt::test]
async fn sixty_four_sessions_with_cancellations_and_disconnects_leak_no_pages() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    let mut handles = Vec::new();
    for i in 0..64u64 {
        let mut req = greedy_tokens(
            token_ids(100 + i, 10 + (i as usize * 37) % 300),
            8 + (i as usize % 40),
        );
        if i % 3 == 0 {
            req.session = Some(SessionKey {
                scope: String::new(),
                session_id: format!("s{i}"),
            });
        }
        let stream = t.engine.submit(req).await.unwrap();
        handles.push((i, stream));
    }
    let mut finished = 0;
    let mut cancelled = 0;
    for (i, mut stream) in handles {
        match i % 4 {
            // Disconnect at once, or after the first event.
            0 => drop(stream),
            1 => {
                let _ = stream.recv().await;
                drop(stream);
                cancelled += 1;
            }
            _ => {
                let out = drain(stream).await;
                assert!(out.error.is_none(), "{:?}", out.error);
                assert!(matches!(
                    out.finish,
                    Some(FinishReason::Length | FinishReason::Stop)
                ));
                finished += 1;
            }
        }
    }
    assert!(finished >= 32 && cancelled >= 16);
    // Every request ends; then with caches cleared nothing may remain allocated.
    wait_until_idle(&t.engine).await;
    t.engine.clear_caches().await;
    let stats = t.engine.pool_stats().await;
    assert_eq!(stats.num_used, 0, "{stats:?}");
    assert!(t.engine.sessions().await.is_empty());
}

#[actix_rt::test]
async fn dropping_a_stream_during_its_prefill_cancels_it_within_a_step() {
    // 4,096 prompt tokens: eight prefill chunks of 512, each its own step.
    let t = start_engine(&TestModelSpec::default(), cfg());
    let stream = t
        .engine
        .submit(greedy_tokens(token_ids(7, 4096), 64))
        .await
        .unwrap();
    drop(stream);
    wait_until_idle(&t.engine).await;
    let stats = t.engine.scheduler_stats().await;
    assert!(
        stats.prompt_tokens_computed <= 2 * 512 && stats.tokens_generated == 0,
        "the prefill went on for nobody: {stats:?}"
    );
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn a_huge_prompt_being_encoded_holds_up_no_other_request() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    // ~4 MB of text: encoding it takes far longer than a short request takes end to end.
    let mut huge = greedy_tokens(Vec::new(), 8);
    huge.prompt = Prompt::Text("lorem ipsum dolor sit amet, ".repeat(150_000));
    let mut big = Box::pin(t.engine.submit(huge));
    assert!(futures::poll!(&mut big).is_pending(), "encoding has begun");
    // A short text prompt (encoded too) runs to its end, its text detokenised, meanwhile.
    let mut short = greedy_tokens(Vec::new(), 8);
    short.prompt = Prompt::Text("hello there".into());
    let out = drain(t.engine.submit(short).await.unwrap()).await;
    assert!(out.error.is_none(), "{:?}", out.error);
    assert_eq!(out.token_ids.len(), 8);
    assert!(!out.text.is_empty());
    assert!(
        futures::poll!(&mut big).is_pending(),
        "the short request waited for the huge prompt's encoding"
    );
    // The huge prompt is then refused for its length.
    let refused = big.await;
    assert!(
        matches!(refused, Err(EngineError::ContextLengthExceeded { .. })),
        "{:?}",
        refused.err()
    );
}

async fn wait_until_idle(engine: &mtpx::engine::Engine) {
    for _ in 0..2000 {
        let s = engine.scheduler_stats().await;
        if s.num_running == 0 && s.num_waiting == 0 {
            return;
        }
        tokio::task::yield_now().await;
        actix_rt::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    panic!("the scheduler never became idle");
}

#[actix_rt::test]
async fn pool_exhaustion_queues_or_preempts_and_outputs_stay_correct() {
    // 24 pages of 16 tokens: room for ~384 tokens; eight requests want ~1,300 in all.
    let spec = TestModelSpec::default();
    let small = EngineConfig {
        kv_memory: KvMemory::Bytes(24 * 2 * 2 * 2 * 16 * 16 * 4),
        ..cfg()
    };
    let t = start_engine(&spec, small);
    assert_eq!(t.engine.info().num_pages, 24);
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| token_ids(500 + i, 60 + 10 * i as usize))
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        let out = run(&t.engine, greedy_tokens(p.clone(), 80)).await;
        assert!(out.error.is_none(), "{:?}", out.error);
        alone.push(out.token_ids);
    }
    let streams = futures::future::join_all(
        prompts
            .iter()
            .map(|p| t.engine.submit(greedy_tokens(p.clone(), 80))),
    )
    .await;
    let together = futures::future::join_all(streams.into_iter().map(|s| drain(s.unwrap()))).await;
    for (i, out) in together.iter().enumerate() {
        assert!(out.error.is_none(), "request {i}: {:?}", out.error);
        assert_eq!(
            out.token_ids, alone[i],
            "request {i} changed under memory pressure"
        );
    }
    let stats = t.engine.scheduler_stats().await;
    println!("preemptions under pressure: {}", stats.num_preemptions);
    assert!(
        stats.num_preemptions > 0,
        "the budget was meant to force preemption"
    );
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn prompts_that_fill_the_pool_between_them_mid_prefill_all_finish() {
    // 40 pages of 16 tokens; two 400-token prompts prefilled 64 tokens a step each take 20
    // pages apiece before either is through, and then each waits for pages the other holds.
    let spec = TestModelSpec::default();
    let small = EngineConfig {
        kv_memory: KvMemory::Bytes(40 * 2 * 2 * 2 * 16 * 16 * 4),
        prefill_chunk: 64,
        ..cfg()
    };
    let t = start_engine(&spec, small);
    assert_eq!(t.engine.info().num_pages, 40);
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| token_ids(900 + i, 400)).collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(run(&t.engine, greedy_tokens(p.clone(), 8)).await.token_ids);
    }
    t.engine.clear_caches().await;
    let streams = futures::future::join_all(
        prompts
            .iter()
            .map(|p| t.engine.submit(greedy_tokens(p.clone(), 8))),
    )
    .await;
    let both = futures::future::join_all(streams.into_iter().map(|s| drain(s.unwrap())));
    let together = actix_rt::time::timeout(std::time::Duration::from_secs(120), both)
        .await
        .expect("the two prompts stalled, each waiting for the other's pages");
    for (i, out) in together.iter().enumerate() {
        assert!(out.error.is_none(), "request {i}: {:?}", out.error);
        assert_eq!(
            out.token_ids, alone[i],
            "request {i} changed by the preemption"
        );
    }
    assert!(t.engine.scheduler_stats().await.num_preemptions > 0);
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn a_shared_2000_token_prefix_is_prefilled_once() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    // 2,008 = 125 full pages and 8 positions of the next: those are copied (copy-on-write).
    let prefix = token_ids(7, 2008);
    let mut a = prefix.clone();
    a.extend(token_ids(8, 50));
    let mut b = prefix.clone();
    b.extend(token_ids(9, 70));
    let first = run(&t.engine, greedy_tokens(a, 4)).await;
    assert_eq!(first.cached_tokens, 0);
    let second = run(&t.engine, greedy_with_logprobs(b.clone(), 4)).await;
    assert_eq!(second.cached_tokens, 2008, "only the suffix is prefilled");
    assert_eq!(second.usage.cached_tokens, second.cached_tokens);
    // The reused K/V is right: same tokens as a cold run.
    t.engine.clear_caches().await;
    let cold = run(&t.engine, greedy_with_logprobs(b, 4)).await;
    assert_eq!(cold.cached_tokens, 0);
    assert_same_generation(&cold, &second, 1e-4);
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0, "no page leaks");
}

#[actix_rt::test]
async fn a_scored_prompt_gives_each_token_the_logprob_decoding_gave_it() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    // The reference: tokens decoded one row at a time, with their log-probabilities (no bias:
    // scores are of the model's own distribution).
    let prompt = token_ids(41, 508);
    let mut req = greedy_with_logprobs(prompt.clone(), 12);
    req.sampling.logit_bias.clear();
    let decoded = run(&t.engine, req).await;
    let n = decoded.token_ids.len();
    assert!(n >= 6, "too few tokens to compare: {:?}", decoded.token_ids);
    // The same tokens as one prompt, scored: prefilled in chunks of 512 rows (the decoded part
    // straddles the boundary), although the prefix cache holds the first 508 tokens.
    let mut whole = prompt.clone();
    whole.extend(&decoded.token_ids);
    let mut req = greedy_tokens(whole.clone(), 1);
    req.prompt_logprobs = Some(3);
    let scored = run(&t.engine, req).await;
    assert!(scored.error.is_none(), "{:?}", scored.error);
    assert_eq!(
        scored.cached_tokens, 0,
        "a scored prompt is computed in full"
    );
    let (ids, logprobs, top) = scored.prompt_logprobs.expect("the prompt was scored");
    assert_eq!(ids, whole);
    assert_eq!((logprobs.len(), top.len()), (whole.len(), whole.len()));
    assert!(logprobs[0].is_none() && top[0].is_empty());
    for (pos, (lp, alts)) in logprobs.iter().zip(&top).enumerate().skip(1) {
        let lp = lp.unwrap_or_else(|| panic!("position {pos} unscored"));
        assert!(lp <= 0.0 && lp.is_finite(), "position {pos}: {lp}");
        assert_eq!(alts.len(), 3);
        assert!(alts.windows(2).all(|w| w[0].1 >= w[1].1), "{alts:?}");
        assert!(
            alts[0].1 >= lp - 1e-6,
            "the best alternative is at least as likely"
        );
    }
    for i in 0..n {
        let pos = prompt.len() + i;
        let (got, want) = (logprobs[pos].unwrap(), decoded.logprobs[i].unwrap());
        assert!(
            (got - want).abs() < 1e-3,
            "token {i} at {pos}: {got} vs {want} decoding"
        );
        assert_eq!(
            top[pos][0].0, whole[pos],
            "greedy chose the most likely token"
        );
    }
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0, "no page leaks");
}

#[actix_rt::test]
async fn requests_that_cannot_fit_are_refused_before_inference() {
    let capped = EngineConfig {
        context_window: Some(1000),
        strict_max_tokens: true,
        ..cfg()
    };
    let t = start_engine(&TestModelSpec::default(), capped);
    assert_eq!(t.engine.info().context_window, 1000);
    let out = run(&t.engine, greedy_tokens(token_ids(1, 900), 101)).await;
    assert_eq!(
        out.error,
        Some(EngineError::ContextLengthExceeded {
            prompt_tokens: 900,
            max_tokens: 101,
            context_window: 1000
        })
    );
    // Without max_tokens the request may use the rest of the window.
    let mut req = greedy_tokens(token_ids(1, 990), 1);
    req.max_tokens = None;
    let out = run(&t.engine, req).await;
    assert_eq!(out.finish, Some(FinishReason::Length));
    assert!(out.token_ids.len() <= 10);
    let out = run(&t.engine, greedy_tokens(Vec::new(), 4)).await;
    assert!(matches!(out.error, Some(EngineError::InvalidRequest(_))));
    drop(t);

    // By default `max_tokens` is a ceiling: the same request runs to the window, the cut in
    // its usage; a prompt that fills the window is still refused.
    let t = start_engine(
        &TestModelSpec::default(),
        EngineConfig {
            context_window: Some(1000),
            ..cfg()
        },
    );
    let mut req = greedy_tokens(token_ids(1, 900), 101);
    req.ignore_eos = true;
    let out = run(&t.engine, req).await;
    assert!(out.error.is_none(), "{:?}", out.error);
    assert_eq!(out.finish, Some(FinishReason::Length));
    assert_eq!(out.token_ids.len(), 100);
    assert_eq!(
        out.usage.max_tokens_cut,
        Some(MaxTokensCut {
            requested: 101,
            served: 100
        })
    );
    let out = run(&t.engine, greedy_tokens(token_ids(1, 1000), 1)).await;
    assert!(
        matches!(out.error, Some(EngineError::ContextLengthExceeded { .. })),
        "{:?}",
        out.error
    );
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn a_full_queue_answers_overloaded() {
    let tiny_queue = EngineConfig {
        max_queue: 2,
        ..cfg()
    };
    let t = start_engine(&TestModelSpec::default(), tiny_queue);
    let mut streams = Vec::new();
    let mut overloaded = 0;
    for i in 0..12 {
        match t.engine.submit(greedy_tokens(token_ids(i, 400), 4)).await {
            Ok(s) => streams.push(s),
            Err(EngineError::Overloaded { retry_after_s }) => {
                assert!(retry_after_s >= 1);
                overloaded += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(overloaded > 0);
    for s in streams {
        assert!(drain(s).await.error.is_none());
    }
}

#[actix_rt::test]
async fn stop_strings_end_the_request_and_neither_they_nor_their_tokens_are_sent() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    let free = run(&t.engine, greedy_tokens(token_ids(3, 30), 40)).await;
    assert!(free.text.len() > 4, "{:?}", free.text);
    // Stop at a piece of what the model says anyway.
    let stop: String = free.text.chars().skip(2).take(2).collect();
    let mut req = greedy_with_logprobs(token_ids(3, 30), 40);
    req.stop = vec![stop.clone()];
    let out = run(&t.engine, req).await;
    assert_eq!(out.finish, Some(FinishReason::Stop));
    let cut = free.text.find(&stop).unwrap();
    assert_eq!(out.text, free.text[..cut]);
    // A stop string made of whole tokens (the 5th and 6th): they are generated and counted,
    // but neither they nor their log-probabilities are sent — what is sent describes the text.
    let before = run(&t.engine, greedy_tokens(token_ids(3, 30), 4))
        .await
        .text;
    let through = run(&t.engine, greedy_tokens(token_ids(3, 30), 6))
        .await
        .text;
    let stop = through[before.len()..].to_string();
    assert_eq!(
        free.text.find(&stop),
        Some(before.len()),
        "{stop:?} occurs earlier"
    );
    let mut req = greedy_with_logprobs(token_ids(3, 30), 40);
    req.stop = vec![stop];
    let out = run(&t.engine, req).await;
    assert_eq!(out.text, before);
    assert_eq!(out.token_ids, free.token_ids[..4]);
    assert_eq!(out.logprobs.len(), 4);
    assert_eq!(out.usage.completion_tokens, 6);
    wait_until_idle(&t.engine).await;
    t.engine.clear_caches().await;
    assert_eq!(t.engine.pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn a_turn_ended_by_a_stop_string_leaves_its_session_free_for_the_next_turn() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    let free = run(&t.engine, greedy_tokens(token_ids(3, 30), 40)).await;
    let stop: String = free.text.chars().skip(2).take(2).collect();
    let session = SessionKey {
        scope: String::new(),
        session_id: "stopped".into(),
    };
    // Each next turn starts the moment the reply has ended, as an agent's does.
    for turn in 0..5 {
        let mut req = greedy_tokens(token_ids(3, 30), 40);
        req.stop = vec![stop.clone()];
        req.session = Some(session.clone());
        let out = run(&t.engine, req).await;
        assert!(out.error.is_none(), "turn {turn}: {:?}", out.error);
        assert_eq!(out.finish, Some(FinishReason::Stop));
        let stats = t.engine.scheduler_stats().await;
        assert_eq!(
            stats.num_running, 0,
            "turn {turn}'s sequence outlived its reply"
        );
    }
}

#[actix_rt::test]
async fn a_chat_prompt_uses_the_models_template() {
    let t = start_engine(&TestModelSpec::default(), cfg());
    let messages = serde_json::json!([{"role": "user", "content": "hello"}]);
    let mut req = GenerateRequest::new(Prompt::Chat {
        messages,
        tools: None,
    });
    req.max_tokens = Some(5);
    let out = run(&t.engine, req).await;
    assert!(out.error.is_none(), "{:?}", out.error);
    let expected = t
        .engine
        .tokenize(&Prompt::Text(
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n".into(),
        ))
        .await
        .unwrap();
    assert_eq!(out.prompt_tokens, expected.len());
}

#[actix_rt::test]
async fn every_sampled_reply_under_a_schema_is_a_complete_valid_document() {
    // The random model writes noise; only the grammar can make it valid JSON. Its stop tokens
    // are banned, so each reply ends only because the grammar ends it once the document is
    // complete. Sampled at temperature 1.5; half the requests with speculative drafts.
    let spec_cfg = EngineConfig {
        speculative: mtpx::spec::SpecConfig {
            mode: mtpx::spec::SpecMode::Ngram,
            depth: Some(4),
            ..Default::default()
        },
        ..cfg()
    };
    let t = start_engine(&TestModelSpec::default(), spec_cfg);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "size": {"enum": ["small", "large"]},
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["ok", "size", "tags", "count"],
        "additionalProperties": false
    });
    let mut drafted = 0;
    for seed in 0..8u64 {
        let mut req = greedy_tokens(token_ids(seed, 30), 300);
        req.sampling.temperature = 1.5;
        req.sampling.seed = Some(seed);
        req.format = Some(mtpx::sampling::OutputFormat::JsonSchema(schema.clone()));
        if seed % 2 == 0 {
            req.speculative = Some(mtpx::spec::SpecChoice::Off);
        } else {
            // Drafts from a prediction of random tokens, which the grammar mostly forbids, and
            // no seed: verified by rejection sampling.
            req.prediction = Some(token_ids(seed + 100, 24));
            req.sampling.seed = None;
        }
        let out = run(&t.engine, req).await;
        assert!(out.error.is_none(), "{:?}", out.error);
        assert_eq!(
            out.finish,
            Some(FinishReason::Stop),
            "seed {seed}: {:?}",
            out.text
        );
        let v: serde_json::Value = serde_json::from_str(&out.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", out.text));
        assert!(v["ok"].is_boolean(), "{v}");
        assert!(
            ["small", "large"].contains(&v["size"].as_str().unwrap()),
            "{v}"
        );
        assert!(v["count"].as_u64().unwrap() <= 99, "{v}");
        let tags = v["tags"].as_array().unwrap();
        assert!(tags.len() <= 3, "{v}");
        assert!(tags.iter().all(|t| t == "a" || t == "bb"), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 4, "{v}");
        drafted += out.usage.draft_tokens;
    }
    assert!(drafted > 0, "no request drafted");
}
