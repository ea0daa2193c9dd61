//! The OpenAI-compatible API over real HTTP on loopback, on the generated test model: every
//! endpoint streamed and not, streaming equals non-streaming, seeds, stops, `n`, tokens.

#[path = "fixtures/api/client.rs"]
mod client;

use client::*;
use mtpx::api::testing::{test_config, TestServer, TEST_MODEL_ID};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use serde_json::{json, Value};

pub const WINDOW: usize = 4096;

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        context_window: Some(WINDOW),
        ..EngineConfig::default()
    }
}

fn server() -> TestServer {
    TestServer::start(&TestModelSpec::default(), engine_cfg(), test_config()).unwrap()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": TEST_MODEL_ID,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about pages."}],
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": ban_specials(),
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Content, finish reason and usage reassembled from a streamed chat.
fn reassemble(events: &[Value]) -> (Vec<String>, Vec<String>, Option<Value>) {
    assert_eq!(
        events.last(),
        Some(&Value::String("[DONE]".into())),
        "ends with [DONE]"
    );
    let mut content = Vec::new();
    let mut finish = Vec::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        assert_eq!(e["object"], "chat.completion.chunk", "{e}");
        if let Some(u) = e.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in e["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if content.len() <= i {
                content.resize(i + 1, String::new());
                finish.resize(i + 1, String::new());
                assert_eq!(
                    c["delta"]["role"], "assistant",
                    "the first chunk carries the role"
                );
            }
            if let Some(t) = c["delta"]["content"].as_str() {
                content[i].push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish[i] = f.to_string();
            }
        }
    }
    (content, finish, usage)
}

#[actix_rt::test]
async fn health_models_openapi_and_metrics_answer() {
    let s = server();
    let health = get(&s.at("/health")).await;
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let models = get(&s.at("/v1/models")).await.json();
    assert_eq!(models["object"], "list");
    let model = &models["data"][0];
    assert_eq!(model["id"], TEST_MODEL_ID);
    assert_eq!(model["context_window"], WINDOW);
    assert_eq!(model["max_model_len"], WINDOW);
    assert_eq!(
        s.engine().info().context_window,
        WINDOW,
        "advertised = enforced"
    );
    let one = get(&s.at(&format!("/v1/models/{TEST_MODEL_ID}"))).await;
    assert_eq!(
        (one.status, one.json()["context_window"].clone()),
        (200, json!(WINDOW))
    );
    let missing = get(&s.at("/v1/models/gpt-4")).await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.error()["code"], "model_not_found");
    let doc = get(&s.at("/openapi.json")).await.json();
    assert!(doc["paths"]["/v1/chat/completions"]["post"].is_object());
    let metrics = get(&s.at("/metrics")).await;
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    for name in [
        "mtpx_kv_pages_total",
        "mtpx_sequences_running",
        "mtpx_prefix_cache_hit_ratio",
        "mtpx_sessions",
        "mtpx_time_to_first_token_seconds_count",
        "mtpx_http_responses_total{status=\"200\"}",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics");
    }
    let unknown = get(&s.at("/v2/nothing")).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.error()["code"], "not_found");
    // A known path with another method: 405 naming what it takes, not a 404.
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("POST", "/v1/models/x", "GET, HEAD"),
        ("PATCH", "/v1/responses/resp_1", "GET, DELETE, HEAD"),
        ("DELETE", "/health", "GET, HEAD"),
    ] {
        let m = awc::http::Method::from_bytes(method.as_bytes()).unwrap();
        let reply = send(client().request(m, s.at(path)), None).await;
        assert_eq!(reply.status, 405, "{method} {path}: {}", reply.text());
        assert_eq!(
            reply.error()["code"],
            "method_not_allowed",
            "{method} {path}"
        );
        assert_eq!(
            reply.header("allow").as_deref(),
            Some(allow),
            "{method} {path}"
        );
    }
    // HEAD wherever GET: Ollama's CLI and Go client probe `HEAD /` before every command.
    for path in ["/v1/health", "/models"] {
        assert_eq!(
            get(&s.at(path)).await.status,
            200,
            "llama.cpp's alias {path}"
        );
    }
    for path in ["/health", "/", "/api/tags", "/api/version", "/v1/models"] {
        let head = send(client().head(s.at(path)), None).await;
        assert_eq!(head.status, 200, "HEAD {path}");
        assert_eq!(head.text(), "", "HEAD {path} sends no body");
    }
    let preflight = send(
        client().request(awc::http::Method::OPTIONS, s.at("/v1/completions")),
        None,
    )
    .await;
    assert_eq!(preflight.status, 204);
    // CORS: a page served from this machine may call the API by default, any other may not.
    for (origin, allowed) in [
        ("http://localhost:5173", true),
        ("http://127.0.0.1:3000", true),
        ("https://example.com", false),
    ] {
        let preflight = send(
            client()
                .request(awc::http::Method::OPTIONS, s.at("/v1/chat/completions"))
                .insert_header(("Origin", origin))
                .insert_header(("Access-Control-Request-Method", "POST")),
            None,
        )
        .await;
        assert_eq!(preflight.status, 204, "{origin}");
        let echoed = preflight.header("access-control-allow-origin");
        assert_eq!(echoed.as_deref(), allowed.then_some(origin), "{origin}");
        let models = send(
            client()
                .get(s.at("/v1/models"))
                .insert_header(("Origin", origin)),
            None,
        )
        .await;
        assert_eq!(models.status, 200);
        let echoed = models.header("access-control-allow-origin");
        assert_eq!(echoed.as_deref(), allowed.then_some(origin), "{origin}");
    }
    // The WebSocket route, asked without an upgrade, answers in JSON like every other route.
    let plain = get(&s.at("/v1/responses")).await;
    assert_eq!(plain.status, 400);
    assert!(plain.error()["message"]
        .as_str()
        .unwrap()
        .contains("WebSocket"));
    s.stop().await;
}

#[actix_rt::test]
async fn chat_streaming_equals_non_streaming_with_usage_and_timings() {
    let s = server();
    let plain = post(&s.at("/v1/chat/completions"), &chat(json!({}))).await;
    // llama.cpp's server answers without the `/v1` too; so does mtpx, the same reply.
    let bare = post(&s.at("/chat/completions"), &chat(json!({})))
        .await
        .json();
    assert_eq!(
        bare["choices"][0]["message"],
        plain.json()["choices"][0]["message"]
    );
    assert_eq!(plain.status, 200, "{}", plain.text());
    let body = plain.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], TEST_MODEL_ID);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let usage = &body["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 12
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(body["timings"]["predicted_n"], 12);
    assert!(body["timings"]["prompt_ms"].is_number());

    let streamed = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(streamed.status, 200);
    assert!(streamed
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let (content, finish, usage) = reassemble(&streamed.events());
    assert_eq!(content[0], choice["message"]["content"].as_str().unwrap());
    assert_eq!(finish, vec!["length".to_string()]);
    let usage = usage.expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(usage["prompt_tokens"], body["usage"]["prompt_tokens"]);
    s.stop().await;
}

#[actix_rt::test]
async fn seeds_reproduce_and_n_gives_several_choices() {
    let s = server();
    let req = chat(json!({"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 16}));
    let a = post(&s.at("/v1/chat/completions"), &req).await.json();
    let b = post(&s.at("/v1/chat/completions"), &req).await.json();
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a).len(), 2);
    assert_eq!(texts(&a), texts(&b), "same seed, same choices");
    assert_eq!(
        a["usage"]["completion_tokens"], 32,
        "usage sums the choices"
    );
    assert_eq!(a["choices"][1]["index"], 1);
    // `top_k: -1` is vLLM's "off", the same as 0 (and the default).
    let mut off = req.clone();
    off["top_k"] = json!(-1);
    let off = post(&s.at("/v1/chat/completions"), &off).await.json();
    assert_eq!(texts(&off), texts(&a), "{off}");
    // Streamed with the same seed: the same texts, per choice index.
    let mut streamed_req = req.clone();
    streamed_req["stream"] = json!(true);
    let streamed = post(&s.at("/v1/chat/completions"), &streamed_req).await;
    let (content, finish, _) = reassemble(&streamed.events());
    assert_eq!(content, texts(&a));
    assert_eq!(finish.len(), 2);
    s.stop().await;
}

#[actix_rt::test]
async fn stop_sequences_cut_the_reply() {
    let s = server();
    let free = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"max_tokens": 40})),
    )
    .await
    .json();
    let text = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.chars().count() > 6, "{text:?}");
    let stop: String = text.chars().skip(3).take(2).collect();
    let cut = text.find(&stop).unwrap();
    for stream in [false, true] {
        let req =
            chat(json!({"max_tokens": 40, "stop": [stop.clone(), "\u{1}never"], "stream": stream}));
        let reply = post(&s.at("/v1/chat/completions"), &req).await;
        let (content, finish) = if stream {
            let (c, f, _) = reassemble(&reply.events());
            (c[0].clone(), f[0].clone())
        } else {
            let v = reply.json();
            let c = &v["choices"][0];
            (
                c["message"]["content"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!(content, text[..cut], "stream={stream}");
        assert_eq!(finish, "stop");
    }
    let single = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"max_tokens": 40, "stop": stop})),
    )
    .await
    .json();
    assert_eq!(single["choices"][0]["message"]["content"], text[..cut]);
    s.stop().await;
}

/// A batch of prompts (vLLM and OpenAI take them; lm-eval sends them): choice `i·n + j` is the
/// `j`-th choice of prompt `i` as that prompt alone gives it, echoed with its own prompt;
/// usage counts each prompt once.
#[actix_rt::test]
async fn a_batch_of_prompts_answers_each_as_alone() {
    let s = server();
    let url = s.at("/v1/completions");
    let prompts = ["function update(v) {", "let total = "];
    let base = json!({"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2, "echo": true,
                      "logit_bias": ban_specials()});
    let texts = |r: &Value| -> Vec<String> {
        r["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect()
    };
    let (mut alone, mut prompt_tokens) = (Vec::new(), 0);
    for p in prompts {
        let mut body = base.clone();
        body["prompt"] = json!(p);
        let r = post(&url, &body).await.json();
        prompt_tokens += r["usage"]["prompt_tokens"].as_u64().unwrap();
        alone.extend(texts(&r));
    }
    assert!(alone[0].starts_with(prompts[0]) && alone[2].starts_with(prompts[1]));
    let mut batch = base.clone();
    batch["prompt"] = json!(prompts);
    let r = post(&url, &batch).await.json();
    assert_eq!(texts(&r), alone, "{r}");
    assert_eq!(r["choices"][3]["index"], 3);
    assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(r["usage"]["completion_tokens"], 4 * 6);
    // Streamed: the same texts, per choice index.
    batch["stream"] = json!(true);
    let mut streamed = vec![String::new(); 4];
    for e in post(&url, &batch).await.events() {
        for c in e["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(c["text"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(streamed, alone);
    // Lists of token ids: the same replies.
    let mut ids = Vec::new();
    for p in prompts {
        let t = post(&s.at("/tokenize"), &json!({"prompt": p})).await.json();
        ids.push(t["tokens"].clone());
    }
    let mut by_ids = base.clone();
    by_ids["prompt"] = json!(ids);
    assert_eq!(texts(&post(&url, &by_ids).await.json()), alone);
    let mut empty = base.clone();
    empty["prompt"] = json!([]);
    let reply = post(&url, &empty).await;
    assert_eq!(
        (reply.status, reply.error()["param"].clone()),
        (400, json!("prompt"))
    );
    s.stop().await;
}

#[actix_rt::test]
async fn text_completions_take_strings_and_token_ids() {
    let s = server();
    let url = s.at("/v1/completions");
    let base = json!({"prompt": "function update(v) {", "max_tokens": 10, "temperature": 0, "logit_bias": ban_specials()});
    let plain = post(&url, &base).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    let body = plain.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let text = body["choices"][0]["text"].as_str().unwrap().to_string();
    let mut streamed = base.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = post(&url, &streamed).await.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let joined: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["text"].as_str())
        .collect();
    assert_eq!(joined, text);
    assert!(events.iter().any(|e| e["usage"]["completion_tokens"] == 10));
    // The same prompt as token ids gives the same text.
    let ids = post(
        &s.at("/tokenize"),
        &json!({"prompt": "function update(v) {"}),
    )
    .await
    .json()["tokens"]
        .clone();
    let mut by_ids = base.clone();
    by_ids["prompt"] = ids;
    by_ids["logprobs"] = json!(2);
    let out = post(&url, &by_ids).await.json();
    assert_eq!(out["choices"][0]["text"], text);
    let lp = &out["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    // Streamed, the chunks' logprobs join up to the same lists.
    let mut by_ids_streamed = by_ids.clone();
    by_ids_streamed["stream"] = json!(true);
    let events = post(&url, &by_ids_streamed).await.events();
    let mut joined = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
        "text_offset": []});
    for e in events.iter().filter_map(|e| e["choices"].get(0)) {
        let Some(chunk) = e["logprobs"].as_object() else {
            continue;
        };
        for (field, values) in chunk {
            let all = joined[field.as_str()].as_array_mut().unwrap();
            all.extend(values.as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(
        &joined, lp,
        "streamed logprobs differ from the non-streamed ones"
    );
    // `echo`: the prompt comes first, its tokens scored too (the first one's logprob null).
    let mut echoed = by_ids.clone();
    echoed["echo"] = json!(true);
    let out = post(&url, &echoed).await.json();
    let echoed_text = out["choices"][0]["text"].as_str().unwrap();
    assert_eq!(echoed_text, format!("function update(v) {{{text}"));
    let elp = &out["choices"][0]["logprobs"];
    let num_prompt = by_ids["prompt"].as_array().unwrap().len();
    let tokens = elp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), num_prompt + 10);
    assert!(elp["token_logprobs"][0].is_null());
    assert_eq!(tokens[num_prompt..], lp["tokens"].as_array().unwrap()[..]);
    assert_eq!(
        elp["token_logprobs"].as_array().unwrap()[num_prompt..],
        lp["token_logprobs"].as_array().unwrap()[..]
    );
    let offset = elp["text_offset"][num_prompt].as_u64().unwrap() as usize;
    assert_eq!(offset, "function update(v) {".len());
    let mut echoed_streamed = echoed.clone();
    echoed_streamed["stream"] = json!(true);
    let events = post(&url, &echoed_streamed).await.events();
    let mut joined = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
        "text_offset": []});
    for chunk in events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["logprobs"].as_object())
    {
        for (field, values) in chunk {
            let all = joined[field.as_str()].as_array_mut().unwrap();
            all.extend(values.as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(
        &joined, elp,
        "streamed echo differs from the non-streamed one"
    );
    // `max_tokens: 0` with `echo`: the prompt alone, scored as above.
    let mut prompt_only = echoed.clone();
    prompt_only["max_tokens"] = json!(0);
    let out = post(&url, &prompt_only).await.json();
    let choice = &out["choices"][0];
    assert_eq!(choice["text"], "function update(v) {", "{out}");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(out["usage"]["completion_tokens"], 0);
    for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        let all = elp[field].as_array().unwrap();
        assert_eq!(
            choice["logprobs"][field].as_array().unwrap()[..],
            all[..num_prompt],
            "{field}"
        );
    }
    prompt_only["stream"] = json!(true);
    let reply = post(&url, &prompt_only).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "max_tokens");
    let mut bad = base.clone();
    bad["max_tokens"] = json!(0);
    let reply = post(&url, &bad).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    let mut bad = base.clone();
    bad["suffix"] = json!("}");
    let reply = post(&url, &bad).await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.error()["param"], "suffix");
    s.stop().await;
}

#[actix_rt::test]
async fn tokenize_detokenize_and_count_agree_with_completions() {
    let s = server();
    let t = post(&s.at("/tokenize"), &json!({"prompt": "hello world"}))
        .await
        .json();
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], WINDOW);
    let d = post(&s.at("/detokenize"), &json!({"tokens": t["tokens"]}))
        .await
        .json();
    assert_eq!(d["prompt"], "hello world");
    let bad = post(&s.at("/detokenize"), &json!({"tokens": [99999]})).await;
    assert_eq!(
        (bad.status, bad.error()["param"].clone()),
        (400, json!("tokens"))
    );
    let req = chat(json!({}));
    let count = post(&s.at("/v1/chat/completions/count"), &req).await.json();
    let done = post(&s.at("/v1/chat/completions"), &req).await.json();
    assert_eq!(count["prompt_tokens"], done["usage"]["prompt_tokens"]);
    assert_eq!(count["context_window"], WINDOW);
    let by_messages = post(&s.at("/tokenize"), &json!({"messages": req["messages"]}))
        .await
        .json();
    assert_eq!(by_messages["count"], count["prompt_tokens"]);
    // A tool call whose arguments are JSON text counts as a completion renders it (parsed), not
    // as a quoted string.
    let tools = json!([{"type": "function", "function": {"name": "read",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]);
    let messages = json!([{"role": "user", "content": "Read a.txt"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "read", "arguments": "{\"path\": \"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]);
    let body = json!({"messages": messages, "tools": tools});
    let counted = post(&s.at("/v1/chat/completions/count"), &body)
        .await
        .json();
    let tokenized = post(&s.at("/tokenize"), &body).await.json();
    assert_eq!(tokenized["count"], counted["prompt_tokens"], "{tokenized}");
    s.stop().await;
}

#[actix_rt::test]
async fn logprobs_and_chat_logit_bias_reach_the_sampler() {
    let s = server();
    let r = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 4})),
    )
    .await
    .json();
    let content = r["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 4);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert!(content[0]["logprob"].as_f64().unwrap() <= 0.0);
    // `bytes` are each token's raw bytes (this model's tokens split characters): together they
    // spell the reply, where each token's text alone may be U+FFFD.
    let r = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"logprobs": true, "max_tokens": 12, "logit_bias": ban_specials()})),
    )
    .await
    .json();
    let bytes = logprob_bytes(&r["choices"][0]);
    let reply = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        String::from_utf8_lossy(&bytes).starts_with(reply.trim_end_matches('\u{FFFD}')),
        "{bytes:?} vs {reply:?}"
    );
    // Legacy logprobs: `text_offset` in characters, never decreasing, each token's text found
    // at its offset; alternatives most likely first; the first prompt token has none (null).
    let text = "café 🦀 naïve";
    let r = post(
        &s.at("/v1/completions"),
        &json!({"prompt": text, "echo": true, "logprobs": 3, "max_tokens": 1}),
    )
    .await
    .json();
    let lp = &r["choices"][0]["logprobs"];
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    let chars: Vec<char> = r["choices"][0]["text"].as_str().unwrap().chars().collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for (token, &at) in lp["tokens"].as_array().unwrap().iter().zip(&offsets) {
        let token = token.as_str().unwrap();
        if !token.contains('\u{FFFD}') {
            let here: String = chars[at..].iter().collect();
            assert!(here.starts_with(token), "{token:?} at {at}: {here:?}");
        }
    }
    assert!(lp["top_logprobs"][0].is_null(), "{lp}");
    let scores: Vec<f64> = lp["top_logprobs"][1]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    // A strong bias forces a token: every generated token is it.
    let id = post(&s.at("/tokenize"), &json!({"prompt": "map"}))
        .await
        .json()["tokens"][0]
        .clone();
    let piece = post(&s.at("/detokenize"), &json!({"tokens": [id]}))
        .await
        .json()["prompt"]
        .clone();
    let mut bias = ban_specials();
    bias[id.to_string()] = json!(100);
    let forced = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"logit_bias": bias, "max_tokens": 3, "temperature": 1.0})),
    )
    .await
    .json();
    assert_eq!(
        forced["choices"][0]["message"]["content"],
        piece.as_str().unwrap().repeat(3)
    );
    s.stop().await;
}

#[actix_rt::test]
async fn tool_definitions_calls_and_results_round_trip() {
    let s = server();
    let tools = json!([{"type": "function", "function": {"name": "read", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    let messages = json!([
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "read", "arguments": "{\"path\": \"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"}
    ]);
    for choice in [
        json!("auto"),
        json!("none"),
        json!("required"),
        json!({"type": "function", "function": {"name": "read"}}),
    ] {
        for stream in [false, true] {
            let req = chat(
                json!({"messages": messages, "tools": tools, "tool_choice": choice, "stream": stream, "parallel_tool_calls": true}),
            );
            let reply = post(&s.at("/v1/chat/completions"), &req).await;
            assert_eq!(reply.status, 200, "{choice} {}", reply.text());
        }
    }
    // Force the model to write `<tool_call>` over and over: a malformed block is plain content,
    // never an error, and the tags show in content only because the block never parsed.
    let open_id = post(&s.at("/tokenize"), &json!({"prompt": "<tool_call>"}))
        .await
        .json()["tokens"][0]
        .clone();
    let mut bias = ban_specials();
    bias[open_id.to_string()] = json!(100);
    let req =
        chat(json!({"messages": messages, "tools": tools, "logit_bias": bias, "max_tokens": 3}));
    let out = post(&s.at("/v1/chat/completions"), &req).await.json();
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["message"]["content"]
        .as_str()
        .unwrap()
        .starts_with("<tool_call>"));
    assert!(choice["message"].get("tool_calls").is_none());
    // `tool_choice: "none"`: the tools stay in the prompt (the same prompt as "auto", so a
    // session's cached prefix holds), and the tag is banned: even pushed to it, no call.
    let count = |choice: &str| {
        let body = json!({"messages": messages, "tools": tools, "tool_choice": choice});
        let url = s.at("/v1/chat/completions/count");
        async move { post(&url, &body).await.json()["prompt_tokens"].clone() }
    };
    assert_eq!(count("none").await, count("auto").await);
    let mut none = req.clone();
    none["tool_choice"] = json!("none");
    let out = post(&s.at("/v1/chat/completions"), &none).await.json();
    let content = out["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.contains("<tool_call>"), "{out}");
    s.stop().await;
}
