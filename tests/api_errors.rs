//! Every client error over real HTTP is OpenAI-shaped with the right status, and never a 500:
//! malformed JSON, bad fields (named), context_length_exceeded before inference (a prompt that
//! does not fit; with `--strict-max-tokens`, `max_tokens` past the window too, which is
//! otherwise served up to the window), 401, 404, 413, 503 overloaded / loading; a client that
//! disconnects mid-stream frees its pages.

#[path = "fixtures/api/client.rs"]
mod client;

use client::*;
use futures::StreamExt;
use mtpx::api::metrics::sample;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use serde_json::{json, Value};
use std::time::Duration;

const WINDOW: usize = 2048;

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        context_window: Some(WINDOW),
        ..EngineConfig::default()
    }
}

fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

#[actix_rt::test]
async fn bad_requests_are_400s_that_name_the_field() {
    let s = TestServer::start(&TestModelSpec::default(), engine_cfg(), test_config()).unwrap();
    let url = s.at("/v1/chat/completions");
    let malformed = post_raw(
        &url,
        b"{\"messages\": [\n  {\"role\": \"user\",, }]}".to_vec(),
        &[],
    )
    .await;
    assert_eq!(malformed.status, 400);
    let msg = malformed.error()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("line 2 column"), "{msg}");
    let cases: Vec<(Value, &str)> = vec![
        (json!({}), "messages"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": user("x"), "temperature": 5}),
            "temperature",
        ),
        (
            json!({"messages": user("x"), "temperature": "hot"}),
            "temperature",
        ),
        (json!({"messages": user("x"), "top_p": 0}), "top_p"),
        (json!({"messages": user("x"), "n": 9}), "n"),
        (
            json!({"messages": user("x"), "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"messages": user("x"), "max_tokens": -3}),
            "max_tokens",
        ),
        (
            json!({"messages": user("x"), "logit_bias": {"abc": 1}}),
            "logit_bias",
        ),
        (
            json!({"messages": user("x"), "logit_bias": {"1": 1000}}),
            "logit_bias",
        ),
        // Checked by the engine against the model's vocabulary.
        (
            json!({"messages": user("x"), "logit_bias": {"99999999": 1}}),
            "logit_bias",
        ),
        (
            json!({"messages": user("x"), "top_logprobs": 3}),
            "top_logprobs",
        ),
        (json!({"messages": user("x"), "stop": 3}), "stop"),
        (json!({"messages": user("x"), "stream": "yes"}), "stream"),
        (
            json!({"messages": user("x"), "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": user("x"), "response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"messages": user("x"), "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": [1]}}}),
            "response_format.json_schema.schema",
        ),
        // Compiled by the engine: a schema it cannot enforce is refused before inference.
        (
            json!({"messages": user("x"), "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}),
            "response_format",
        ),
        (
            json!({"messages": user("x"), "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
    ];
    for (body, param) in cases {
        let reply = post(&url, &body).await;
        assert_eq!(reply.status, 400, "{body}: {}", reply.text());
        let e = reply.error();
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], param, "{body}: {e}");
        let message = e["message"].as_str().unwrap();
        assert!(!message.starts_with("invalid request"), "{message}");
    }
    let text = post(
        &url,
        &json!({"messages": user("x"), "max_tokens": 1, "response_format": {"type": "text"}}),
    )
    .await;
    assert_eq!(text.status, 200, "{}", text.text());
    // Unknown fields are ignored; a missing model is accepted.
    let ok = post(
        &url,
        &json!({"messages": user("x"), "max_tokens": 2, "frobnicate": true}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let other = post(&url, &json!({"model": "gpt-4o", "messages": user("x")})).await;
    assert_eq!(
        (other.status, other.error()["code"].clone()),
        (404, json!("model_not_found"))
    );
    let not_object = post_raw(&url, b"[1, 2]".to_vec(), &[]).await;
    assert_eq!(not_object.status, 400);
    s.stop().await;
}

#[actix_rt::test]
async fn context_length_exceeded_is_refused_before_inference_with_counts() {
    let strict = EngineConfig {
        strict_max_tokens: true,
        ..engine_cfg()
    };
    let s = TestServer::start(&TestModelSpec::default(), strict, test_config()).unwrap();
    let body = json!({"messages": user("hello"), "max_tokens": WINDOW});
    let steps_before = s.engine().scheduler_stats().await.num_steps;
    for stream in [false, true] {
        let mut b = body.clone();
        b["stream"] = json!(stream);
        let reply = post(&s.at("/v1/chat/completions"), &b).await;
        assert_eq!(reply.status, 400, "{}", reply.text());
        let e = reply.error();
        assert_eq!(e["code"], "context_length_exceeded");
        assert_eq!(e["param"], "messages");
        let prompt_tokens = e["prompt_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 0);
        assert_eq!(e["max_tokens"], WINDOW);
        assert_eq!(e["context_window"], WINDOW);
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains(&prompt_tokens.to_string()) && msg.contains(&WINDOW.to_string()),
            "{msg}"
        );
    }
    assert_eq!(
        s.engine().scheduler_stats().await.num_steps,
        steps_before,
        "no inference ran"
    );
    let long_prompt = "word ".repeat(3000);
    let reply = post(
        &s.at("/v1/completions"),
        &json!({"prompt": long_prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(reply.error()["code"], "context_length_exceeded");
    assert_eq!(
        reply.error()["param"],
        "prompt",
        "the field is named as the endpoint names it"
    );
    let reply = post(
        &s.at("/v1/responses"),
        &json!({"input": long_prompt, "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(reply.error()["code"], "context_length_exceeded");
    assert_eq!(reply.error()["param"], "input");
    s.stop().await;
}

/// Agents send large defaults (opencode `max_tokens: 32000`, Claude Code 32000) whatever the
/// prompt: a prompt that fits is served up to the window, the cut reported in `usage`, on every
/// API; a prompt that leaves no room is still refused before inference.
#[actix_rt::test]
async fn max_tokens_past_the_window_is_served_up_to_the_window() {
    let s = TestServer::start(&TestModelSpec::default(), engine_cfg(), test_config()).unwrap();
    for stream in [false, true] {
        let body = json!({"messages": user("hello"), "max_tokens": 32000, "stream": stream,
            "stream_options": {"include_usage": true}, "ignore_eos": true});
        let reply = post(&s.at("/v1/chat/completions"), &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let usage = if stream {
            let chunks = reply.events();
            let last = chunks
                .iter()
                .rev()
                .find(|c| c.get("usage").is_some_and(|u| !u.is_null()))
                .unwrap()
                .clone();
            let finish = chunks.iter().find_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            });
            assert_eq!(finish.as_deref(), Some("length"));
            last["usage"].clone()
        } else {
            assert_eq!(reply.json()["choices"][0]["finish_reason"], "length");
            reply.json()["usage"].clone()
        };
        let prompt = usage["prompt_tokens"].as_u64().unwrap() as usize;
        let served = WINDOW - prompt;
        assert_eq!(usage["completion_tokens"], served, "ran to the window");
        assert_eq!(
            usage["max_tokens_clamped"],
            json!({"requested": 32000, "served": served})
        );
    }
    // A max_tokens that fits is not reported as cut.
    let fits = post(
        &s.at("/v1/chat/completions"),
        &json!({"messages": user("hello"), "max_tokens": 3}),
    )
    .await
    .json();
    assert!(fits["usage"].get("max_tokens_clamped").is_none(), "{fits}");
    let responses = post(
        &s.at("/v1/responses"),
        &json!({"input": "hello", "max_output_tokens": 32000, "ignore_eos": true}),
    )
    .await;
    assert_eq!(responses.status, 200, "{}", responses.text());
    let usage = &responses.json()["usage"];
    assert_eq!(usage["max_tokens_clamped"]["requested"], 32000);
    assert_eq!(
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap(),
        WINDOW as u64
    );
    let messages = post(
        &s.at("/v1/messages"),
        &json!({"max_tokens": 32000, "messages": user("hello")}),
    )
    .await;
    assert_eq!(messages.status, 200, "{}", messages.text());
    let completion = post(
        &s.at("/completion"),
        &json!({"prompt": "x", "n_predict": 5000}),
    )
    .await;
    assert_eq!(completion.status, 200, "{}", completion.text());
    // A prompt that fills the window leaves no room: refused as before.
    let long_prompt = "word ".repeat(3000);
    let refused = post(
        &s.at("/v1/chat/completions"),
        &json!({"messages": user(&long_prompt), "max_tokens": 10}),
    )
    .await;
    assert_eq!(refused.error()["code"], "context_length_exceeded");
    s.stop().await;
}

#[actix_rt::test]
async fn an_api_key_guards_every_v1_route() {
    let mut config = test_config();
    config.api_keys = vec!["sekret".into()];
    let s = TestServer::start(&TestModelSpec::default(), engine_cfg(), config).unwrap();
    for path in ["/v1/models", "/v1/models/test-model"] {
        let reply = get(&s.at(path)).await;
        assert_eq!(reply.status, 401);
        assert_eq!(reply.error()["code"], "invalid_api_key");
        let wrong = get_with(&s.at(path), &[("authorization", "Bearer nope")]).await;
        assert_eq!(wrong.status, 401);
        assert_eq!(
            get_with(&s.at(path), &[("authorization", "Bearer sekret")])
                .await
                .status,
            200
        );
        assert_eq!(
            get_with(&s.at(path), &[("x-api-key", "sekret")])
                .await
                .status,
            200
        );
    }
    let body = json!({"messages": user("x"), "max_tokens": 2});
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions/count",
        "/tokenize",
        "/detokenize",
    ] {
        assert_eq!(post(&s.at(path), &body).await.status, 401, "{path}");
    }
    let ok = post_with(
        &s.at("/v1/chat/completions"),
        &body,
        &[("authorization", "Bearer sekret"), ("x-session-id", "s1")],
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    for open in ["/health", "/metrics", "/openapi.json"] {
        assert_eq!(get(&s.at(open)).await.status, 200, "{open}");
    }
    s.stop().await;
}

#[actix_rt::test]
async fn bodies_over_the_limit_get_413() {
    let mut config = test_config();
    config.max_body = 4096;
    let s = TestServer::start(&TestModelSpec::default(), engine_cfg(), config).unwrap();
    let big = json!({"messages": user(&"x".repeat(6000))});
    let reply = post(&s.at("/v1/chat/completions"), &big).await;
    assert_eq!(reply.status, 413);
    assert_eq!(reply.error()["code"], "request_too_large");
    assert_eq!(
        post(
            &s.at("/v1/chat/completions"),
            &json!({"messages": user("hi"), "max_tokens": 1})
        )
        .await
        .status,
        200
    );
    s.stop().await;
}

#[actix_rt::test]
async fn a_full_queue_answers_503_overloaded_with_retry_after() {
    let cfg = EngineConfig {
        max_queue: 1,
        max_seqs: 1,
        ..engine_cfg()
    };
    let s = TestServer::start(&TestModelSpec::default(), cfg, test_config()).unwrap();
    let body = json!({"prompt": "energy city map chart ".repeat(60), "max_tokens": 64, "logit_bias": ban_specials()});
    let url = s.at("/v1/completions");
    let replies = futures::future::join_all((0..12).map(|_| post(&url, &body))).await;
    let overloaded: Vec<_> = replies.iter().filter(|r| r.status == 503).collect();
    assert!(
        !overloaded.is_empty(),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for r in &overloaded {
        assert_eq!(r.error()["code"], "overloaded");
        assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    }
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 503));
    s.stop().await;
}

#[actix_rt::test]
async fn health_is_503_while_loading_then_200() {
    let s = TestServer::start_loading(&TestModelSpec::default(), test_config()).unwrap();
    let loading = get(&s.at("/health")).await;
    assert_eq!(
        (loading.status, loading.json()["status"].clone()),
        (503, json!("loading"))
    );
    let models = get(&s.at("/v1/models")).await;
    assert_eq!(models.status, 503);
    assert_eq!(models.error()["code"], "model_loading");
    assert!(models.header("retry-after").is_some());
    s.load(engine_cfg()).unwrap();
    assert_eq!(get(&s.at("/health")).await.status, 200);
    s.stop().await;
}

#[actix_rt::test]
async fn a_client_disconnect_mid_stream_frees_the_requests_pages() {
    let s = TestServer::start(&TestModelSpec::default(), engine_cfg(), test_config()).unwrap();
    let body = json!({"messages": user("Write a very long story."), "max_tokens": 1800,
        "stream": true, "logit_bias": ban_specials()});
    let mut res = client()
        .post(s.at("/v1/chat/completions"))
        .send_json(&body)
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 200);
    let mut received = 0;
    while let Some(chunk) = res.next().await {
        received += chunk.unwrap().len();
        if received > 2000 {
            break;
        }
    }
    let held_while_streaming =
        sample(&get(&s.at("/metrics")).await.text(), "mtpx_kv_pages_held").unwrap();
    assert!(
        held_while_streaming > 0.0,
        "the request holds pages while it runs"
    );
    drop(res);
    let mut freed = false;
    for _ in 0..200 {
        let text = get(&s.at("/metrics")).await.text();
        let running = sample(&text, "mtpx_sequences_running").unwrap();
        let held = sample(&text, "mtpx_kv_pages_held").unwrap();
        if running == 0.0 && held == 0.0 {
            freed = true;
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(freed, "pages still held after the client left");
    let stats = s.engine().scheduler_stats().await;
    assert!(
        stats.tokens_generated < 1800,
        "generation stopped early: {stats:?}"
    );
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "no page leaks");
    s.stop().await;
}

#[actix_rt::test]
async fn a_queued_stream_gets_keep_alive_comments_then_its_reply() {
    // One sequence at a time: the second request waits in the queue behind the first.
    // The first request must outlast the checks below by far on any machine: the test model
    // decodes thousands of tokens a second, so it gets 30,000 tokens (a 32K window) and is
    // cancelled once they are done.
    let cfg = EngineConfig {
        max_seqs: 1,
        context_window: Some(32_768),
        kv_memory: KvMemory::Bytes(256 << 20),
        ..engine_cfg()
    };
    let s = TestServer::start(&TestModelSpec::default(), cfg, test_config()).unwrap();
    let long = json!({"messages": user("Write a very long story."), "max_tokens": 30_000,
        "stream": true, "logit_bias": ban_specials()});
    let mut first = client()
        .post(s.at("/v1/chat/completions"))
        .send_json(&long)
        .await
        .unwrap();
    // The first request is generating once its first chunk is here.
    first.next().await.unwrap().unwrap();
    let short = json!({"messages": user("hi"), "max_tokens": 4, "stream": true,
        "logit_bias": ban_specials()});
    let mut queued = client()
        .post(s.at("/v1/chat/completions"))
        .send_json(&short)
        .await
        .unwrap();
    assert_eq!(queued.status().as_u16(), 200);
    let mut body = String::new();
    // The role chunk goes out at once. Then test_config() sends a keep-alive after 200 ms of
    // silence; the first request runs for seconds, so the next frame must be a keep-alive.
    while body.matches("\n\n").count() < 2 {
        let chunk = queued.next().await.unwrap().unwrap();
        body.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let frames: Vec<&str> = body.split_inclusive("\n\n").collect();
    assert!(frames[0].contains("\"role\":\"assistant\""), "{body:?}");
    assert_eq!(
        frames[1],
        mtpx::api::sse::KEEP_ALIVE,
        "expected a keep-alive comment while queued: {body:?}"
    );
    assert_eq!(
        s.engine().scheduler_stats().await.num_waiting,
        1,
        "still queued"
    );
    // The first client leaves; the queued request runs and streams a normal reply.
    drop(first);
    while let Some(chunk) = queued.next().await {
        body.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let events = mtpx::api::sse::parse_data_lines(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let finish = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|e| {
            e["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        });
    assert_eq!(finish.as_deref(), Some("length"));
    s.stop().await;
}
