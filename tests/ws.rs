//! The Responses API over HTTP and its WebSocket mode, on the generated test model, with the
//! crate's tokio-tungstenite client: agent sessions whose continuations prefill only their new
//! items, reconnects, cancellation, malformed and oversized frames, concurrency.

#[path = "fixtures/api/client.rs"]
mod client;

use client::{ban_specials, get, get_with, post, post_with, wait_idle};
use mtpx::api::responses::types::{ResponseEvent, ResponseObject};
use mtpx::api::testing::{test_config, TestServer};
use mtpx::api::ApiConfig;
use mtpx::client::ws::{Incoming, ResponsesSocket};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PAGE: usize = 16;

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        context_window: Some(4096),
        page_size: PAGE,
        ..EngineConfig::default()
    }
}

fn server_with(config: ApiConfig) -> TestServer {
    TestServer::start(&TestModelSpec::default(), engine_cfg(), config).unwrap()
}

fn server() -> TestServer {
    server_with(test_config())
}

fn tools() -> Value {
    json!([{"type": "function", "name": "read", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}])
}

fn body(input: Value, previous: Option<&str>, max_output_tokens: usize) -> Value {
    let mut b = json!({
        "input": input,
        "instructions": "You are a coding agent. Use the tools.",
        "tools": tools(),
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
        "logit_bias": ban_specials(),
    });
    if let Some(p) = previous {
        b["previous_response_id"] = json!(p);
    }
    b
}

/// The items of one tool round: the agent's call and its output.
fn tool_round(turn: usize) -> Value {
    let call_id = format!("call_{turn}");
    json!([
        {"type": "function_call", "call_id": call_id, "name": "read",
         "arguments": json!({"path": format!("src/file_{turn}.rs")}).to_string()},
        {"type": "function_call_output", "call_id": call_id,
         "output": format!("fn f{turn}() -> u32 {{ {turn} }}")},
    ])
}

fn seq_numbers_are_consecutive(events: &[ResponseEvent]) {
    let seq: Vec<u64> = events.iter().filter_map(|e| e.sequence_number()).collect();
    assert_eq!(seq.len(), events.len(), "every event has a sequence_number");
    assert_eq!(seq, (0..seq.len() as u64).collect::<Vec<_>>());
}

/// Checks that a continuation reused everything the previous turn prefilled (up to the partial
/// page a shared prefix is cut back to) and prefilled only what is new.
fn assert_prefilled_only_new(prev_input: usize, response: &ResponseObject) {
    let u = response.usage.expect("usage");
    let cached = u.input_tokens_details.cached_tokens;
    assert!(u.input_tokens > prev_input, "{u:?}");
    assert!(
        cached >= prev_input - prev_input % PAGE,
        "cached {cached} < previous input {prev_input} (page-aligned): {u:?}"
    );
    let new_tokens = u.input_tokens - prev_input;
    assert!(
        u.input_tokens - cached <= new_tokens + PAGE,
        "prefilled {} for {new_tokens} new tokens: {u:?}",
        u.input_tokens - cached
    );
}

#[actix_rt::test]
async fn a_ten_turn_agent_session_prefills_only_new_items() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let first = ws
        .turn(&body(json!("Fix the bug in main.rs."), None, 6))
        .await
        .unwrap();
    seq_numbers_are_consecutive(&first.events);
    let mut prev = first.response;
    for turn in 1..10 {
        let t = ws
            .turn(&body(tool_round(turn), Some(&prev.id), 6))
            .await
            .unwrap();
        seq_numbers_are_consecutive(&t.events);
        assert_eq!(t.response.previous_response_id.as_deref(), Some(&*prev.id));
        assert_eq!(t.response.conversation, prev.conversation, "one session");
        assert_prefilled_only_new(prev.usage.unwrap().input_tokens, &t.response);
        prev = t.response;
    }
    ws.close().await.unwrap();
    wait_idle(&s).await;
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "no page leaks");
}

#[actix_rt::test]
async fn reconnecting_continues_the_session_and_reuses_its_kv() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let t1 = ws
        .turn(&body(json!("List the files."), None, 8))
        .await
        .unwrap();
    ws.close().await.unwrap();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let t2 = ws
        .turn(&body(tool_round(1), Some(&t1.response.id), 8))
        .await
        .unwrap();
    assert_prefilled_only_new(t1.response.usage.unwrap().input_tokens, &t2.response);
    // HTTP continues the same stored conversation too.
    let r = post(
        &s.at("/v1/responses"),
        &body(tool_round(2), Some(&t2.response.id), 8),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let t3: ResponseObject = serde_json::from_value(r.json()).unwrap();
    assert_prefilled_only_new(t2.response.usage.unwrap().input_tokens, &t3);
}

#[actix_rt::test]
async fn cancel_mid_stream_stops_generation_and_frees_pages() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let mut b = body(json!("Write a long essay."), None, 3000);
    b["store"] = json!(false);
    ws.create(&b, None).await.unwrap();
    let mut response_id = None;
    let mut num_deltas = 0;
    let cancelled = loop {
        let e = ws.next_event().await.unwrap().event;
        match &e {
            ResponseEvent::Created { response, .. } => response_id = Some(response.id.clone()),
            ResponseEvent::OutputTextDelta { .. } => {
                num_deltas += 1;
                if num_deltas == 3 {
                    ws.cancel(response_id.as_deref(), None).await.unwrap();
                }
            }
            _ => {}
        }
        if let Some(r) = e.terminal_response() {
            break r.clone();
        }
    };
    assert_eq!(cancelled.status, "cancelled");
    assert!(matches!(
        cancelled.output.first(),
        Some(mtpx::api::responses::types::OutputItem::Message { .. })
    ));
    wait_idle(&s).await;
    let generated = s.engine().scheduler_stats().await.tokens_generated;
    assert!(generated < 3000, "cancelled early ({generated} tokens)");
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "pages freed");
    // The connection is still usable.
    let t = ws.turn(&body(json!("hi"), None, 3)).await.unwrap();
    assert_eq!(t.response.status, "incomplete");
}

async fn expect_error(ws: &mut ResponsesSocket) -> Value {
    let e = ws.next_event().await.unwrap();
    let ResponseEvent::Error { error } = e.event else {
        panic!("expected an error event, got {:?}", e.raw);
    };
    assert!(
        error["message"].is_string() && error["type"].is_string(),
        "{error}"
    );
    error
}

#[actix_rt::test]
async fn malformed_frames_get_error_events_and_keep_the_connection() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    ws.send_raw("{not json").await.unwrap();
    expect_error(&mut ws).await;
    ws.send_raw("[1, 2]").await.unwrap();
    expect_error(&mut ws).await;
    ws.send_raw(r#"{"type": "session.update"}"#).await.unwrap();
    assert_eq!(expect_error(&mut ws).await["code"], "unknown_event");
    ws.send_raw(r#"{"type": "response.create", "input": 5}"#)
        .await
        .unwrap();
    assert_eq!(expect_error(&mut ws).await["param"], "input");
    // A hosted tool is left out of the prompt (Codex declares `web_search`); forcing one is an
    // error, as the server runs none.
    ws.send_raw(r#"{"type": "response.create", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}, "tag": "t1"}"#)
        .await
        .unwrap();
    let e = ws.next_event().await.unwrap();
    assert_eq!(e.tag.as_deref(), Some("t1"), "errors carry the tag");
    assert_eq!(e.raw["error"]["code"], "unsupported_tool");
    ws.cancel(Some("resp_nothing"), None).await.unwrap();
    assert_eq!(expect_error(&mut ws).await["code"], "response_not_found");
    let t = ws
        .turn(&body(json!("still there?"), None, 3))
        .await
        .unwrap();
    assert_eq!(
        t.response.output_text().is_empty(),
        t.response.output.is_empty()
    );
}

#[actix_rt::test]
async fn an_unknown_previous_response_id_is_refused_not_restarted() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    ws.create(&body(json!("more"), Some("resp_unknown"), 3), None)
        .await
        .unwrap();
    let error = expect_error(&mut ws).await;
    assert_eq!(error["code"], "previous_response_not_found");
    assert_eq!(error["param"], "previous_response_id");
    let r = post(
        &s.at("/v1/responses"),
        &body(json!("more"), Some("resp_unknown"), 3),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.error()["code"], "previous_response_not_found");
    // A response that was not stored cannot be continued either.
    let mut b = body(json!("one"), None, 3);
    b["store"] = json!(false);
    let t = ws.turn(&b).await.unwrap();
    ws.create(&body(json!("two"), Some(&t.response.id), 3), None)
        .await
        .unwrap();
    assert_eq!(
        expect_error(&mut ws).await["code"],
        "previous_response_not_found"
    );
}

#[actix_rt::test]
async fn another_keys_previous_response_id_is_refused_and_invisible() {
    let mut config = test_config();
    config.api_keys = vec!["alice".into(), "bob".into()];
    let s = server_with(config);
    let mut alice = ResponsesSocket::connect(&s.url, Some("alice"))
        .await
        .unwrap();
    let first = alice.turn(&body(json!("one"), None, 3)).await.unwrap();
    let id = first.response.id.clone();
    let pages_before = s.engine().pool_stats().await.num_used;

    let mut bob = ResponsesSocket::connect(&s.url, Some("bob")).await.unwrap();
    bob.create(&body(json!("two"), Some(&id), 3), None)
        .await
        .unwrap();
    let error = expect_error(&mut bob).await;
    assert_eq!(error["code"], "previous_response_not_found");
    assert_eq!(error["param"], "previous_response_id");
    let as_bob = [("authorization", "Bearer bob")];
    let r = post_with(
        &s.at("/v1/responses"),
        &body(json!("two"), Some(&id), 3),
        &as_bob,
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.error()["code"], "previous_response_not_found");
    let r = get_with(&s.at(&format!("/v1/responses/{id}")), &as_bob).await;
    assert_eq!(r.status, 404, "another key's response is not even visible");
    let r = get_with(&s.at(&format!("/v1/responses/{id}/input_items")), &as_bob).await;
    assert_eq!(r.status, 404, "nor are its input items");
    assert_eq!(
        s.engine().pool_stats().await.num_used,
        pages_before,
        "the refusals touched no pages"
    );

    // Its owner continues it, reusing the session's KV.
    let second = alice.turn(&body(json!("two"), Some(&id), 3)).await.unwrap();
    assert_prefilled_only_new(first.response.usage.unwrap().input_tokens, &second.response);
}

#[actix_rt::test]
async fn a_peer_that_stops_answering_pings_is_dropped_and_its_response_cancelled() {
    let mut config = test_config();
    config.ws_ping = Duration::from_millis(100);
    let s = server_with(config);
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let mut b = body(json!("Write a long essay."), None, 3000);
    b["store"] = json!(false);
    ws.create(&b, None).await.unwrap();
    // Wait (without reading: an unread socket answers no pings) until the response runs.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.engine().scheduler_stats().await.num_running == 0 {
        assert!(Instant::now() < deadline, "the response never started");
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
    // Now silent: within a few ping intervals the server gives up on us and cancels.
    wait_idle(&s).await;
    let generated = s.engine().scheduler_stats().await.tokens_generated;
    assert!(generated < 3000, "cancelled early ({generated} tokens)");
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "pages freed");
    // Reading now drains what was sent, then the server's close.
    let close = loop {
        match ws.recv().await {
            Ok(Incoming::Event(_)) => continue,
            Ok(Incoming::Closed { code, reason }) => break (code, reason),
            Err(e) => panic!("expected a close frame, got {e}"),
        }
    };
    assert_eq!(close.0, Some(1001), "{close:?}");
    assert!(close.1.contains("ping"), "{close:?}");
}

#[actix_rt::test]
async fn a_frame_over_max_ws_frame_closes_with_1009() {
    let mut config = test_config();
    config.max_ws_frame = 64 << 10;
    let s = server_with(config);
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let big = json!({"type": "response.create", "input": "x".repeat(200 << 10)}).to_string();
    ws.send_raw(big).await.unwrap();
    match ws.recv().await.unwrap() {
        Incoming::Closed { code, .. } => assert_eq!(code, Some(1009)),
        Incoming::Event(e) => panic!("expected a close, got {:?}", e.raw),
    }
}

#[actix_rt::test]
async fn tagged_responses_run_concurrently_on_one_socket() {
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    ws.create(&body(json!("a"), None, 5), Some("a"))
        .await
        .unwrap();
    ws.create(&body(json!("b"), None, 5), Some("b"))
        .await
        .unwrap();
    ws.create(&body(json!("a again"), None, 5), Some("a"))
        .await
        .unwrap();
    let mut done = std::collections::BTreeMap::new();
    let mut in_flight_errors = 0;
    while done.len() < 2 {
        let e = ws.next_event().await.unwrap();
        if let ResponseEvent::Error { error } = &e.event {
            assert_eq!(error["code"], "response_in_flight");
            in_flight_errors += 1;
            continue;
        }
        let tag = e.tag.clone().expect("tagged events carry their tag");
        if let Some(r) = e.event.terminal_response() {
            done.insert(tag, r.id.clone());
        }
    }
    assert_eq!(in_flight_errors, 1);
    assert_ne!(done["a"], done["b"]);
}

#[actix_rt::test]
async fn fifty_concurrent_sockets_each_complete_a_turn() {
    let s = server();
    let turns = (0..50).map(|i| {
        let url = s.url.clone();
        async move {
            let mut ws = ResponsesSocket::connect(&url, None).await.unwrap();
            let t = ws
                .turn(&body(json!(format!("task {i}")), None, 4))
                .await
                .unwrap();
            ws.close().await.unwrap();
            t.response
        }
    });
    let responses = futures::future::join_all(turns).await;
    assert_eq!(responses.len(), 50);
    for r in &responses {
        assert_eq!(r.usage.unwrap().output_tokens, 4, "{r:?}");
    }
}

#[actix_rt::test]
async fn http_responses_stream_the_standard_events_and_match_json() {
    let s = server();
    let b = body(json!("Say something."), None, 10);
    let plain = post(&s.at("/v1/responses"), &b).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    let plain: ResponseObject = serde_json::from_value(plain.json()).unwrap();
    let mut streamed = b.clone();
    streamed["stream"] = json!(true);
    let r = post(&s.at("/v1/responses"), &streamed).await;
    assert_eq!(r.status, 200);
    let events: Vec<ResponseEvent> = r
        .events()
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
    seq_numbers_are_consecutive(&events);
    let kinds: Vec<&str> = events.iter().map(|e| e.kind()).collect();
    assert_eq!(
        kinds[..5],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
        ]
    );
    let n = kinds.len();
    assert_eq!(
        kinds[n - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    let deltas: String = events
        .iter()
        .filter_map(|e| match e {
            ResponseEvent::OutputTextDelta { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    let last = events.last().unwrap().terminal_response().unwrap();
    assert_eq!(deltas, last.output_text());
    assert_eq!(last.output_text(), plain.output_text(), "greedy: same text");
    assert_eq!(
        last.incomplete_details.as_ref().unwrap().reason,
        "max_output_tokens"
    );
    // Stored: GET returns it.
    let got = client::get(&s.at(&format!("/v1/responses/{}", plain.id))).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["id"], json!(plain.id));
    // Hosted tools are left out of the prompt and the reply is served as without them (Codex
    // declares `web_search` and `image_generation` with its functions); forcing one is refused.
    let mut hosted = b.clone();
    hosted["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "file_search"}));
    let r = post(&s.at("/v1/responses"), &hosted).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["output"][0]["content"][0]["text"],
        json!(plain.output_text())
    );
    hosted["tool_choice"] = json!({"type": "file_search"});
    let r = post(&s.at("/v1/responses"), &hosted).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.error()["param"], "tool_choice.type");
    assert_eq!(r.error()["code"], "unsupported_tool");
    // Stats answer with the pool and scheduler.
    let st = client::get(&s.at("/v1/stats")).await.json();
    assert!(st["pool"]["num_pages"].as_u64().unwrap() > 0, "{st}");
    assert!(st["scheduler"]["num_running"].is_u64(), "{st}");
}

#[actix_rt::test]
async fn the_ws_bench_session_reuses_its_kv_and_its_cold_peer_does_not() {
    use mtpx::cli::bench_ws::{run_ws_bench, WsBench};
    let s = server();
    let opts = WsBench {
        turns: 3,
        tool_tokens: 60,
        max_output_tokens: 4,
        api_key: None,
    };
    let rows = run_ws_bench(&s.url, &opts).await.unwrap();
    assert_eq!(rows.len(), 3);
    let mut previous_input = 0;
    for r in &rows {
        assert!(r.input_tokens > previous_input, "{r:?}");
        assert!(
            r.cached_tokens + PAGE > previous_input,
            "the session turn reused its KV: {r:?}"
        );
        assert!(r.cold_cached_tokens < PAGE, "the cold peer is cold: {r:?}");
        assert!(r.session_ttft_ms > 0.0 && r.cold_ttft_ms > 0.0);
        previous_input = r.input_tokens;
    }
}

#[actix_rt::test]
async fn websocket_turns_follow_text_format_and_forced_tool_choice() {
    // The random model can only write these under the grammar; its stop tokens are banned, so
    // each reply ends because the grammar ends it.
    let s = server();
    let mut ws = ResponsesSocket::connect(&s.url, None).await.unwrap();
    let mut b = body(json!("Pick."), None, 200);
    b["text"] = json!({"format": {"type": "json_schema", "name": "pick", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "l"]}},
        "required": ["ok", "size"], "additionalProperties": false}}});
    let t = ws.turn(&b).await.unwrap();
    assert_eq!(t.response.status, "completed");
    let v: Value = serde_json::from_str(&t.response.output_text()).unwrap();
    assert!(
        v["ok"].is_boolean() && (v["size"] == "s" || v["size"] == "l"),
        "{v}"
    );

    let mut b = body(json!("Read a file."), Some(&t.response.id), 200);
    b["tool_choice"] = json!("required");
    b["parallel_tool_calls"] = json!(false);
    let t = ws.turn(&b).await.unwrap();
    let call = serde_json::to_value(&t.response.output).unwrap();
    let call = call
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no call: {call}"))
        .clone();
    assert_eq!(call["name"], "read");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["path"].is_string(), "{args}");
    ws.close().await.unwrap();
}

/// Browsers send `Origin` on a WebSocket handshake and CORS does not guard it: the server lets
/// in this machine's pages (and `--cors-origin` ones) and refuses the rest with a JSON 403.
#[actix_rt::test]
async fn a_page_from_this_machine_may_open_the_socket_and_a_foreign_one_may_not() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Error;
    let s = server();
    let handshake = |origin: &str| {
        let mut request = format!("{}/v1/responses", s.url.replace("http://", "ws://"))
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
        tokio_tungstenite::connect_async(request)
    };
    let (mut local, _) = handshake("http://localhost:5173").await.unwrap();
    local.close(None).await.unwrap();
    match handshake("https://example.com").await {
        Err(Error::Http(reply)) => {
            assert_eq!(reply.status(), 403);
            let body: Value = serde_json::from_slice(reply.body().as_deref().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "origin_not_allowed");
        }
        other => panic!("a foreign origin was not refused: {other:?}"),
    }
    // The server keeps serving.
    let (mut again, _) = handshake("http://127.0.0.1:8000").await.unwrap();
    again.close(None).await.unwrap();
}

/// `input_items` lists what a stored response was generated from: a chain's earlier inputs and
/// outputs too, newest first by default, in pages that follow their cursors.
#[actix_rt::test]
async fn input_items_list_the_chain_a_response_was_generated_from() {
    let s = server();
    let first = post(
        &s.at("/v1/responses"),
        &body(json!("Fix main.rs."), None, 4),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let first: ResponseObject = serde_json::from_value(first.json()).unwrap();
    let second = post(
        &s.at("/v1/responses"),
        &body(tool_round(1), Some(&first.id), 4),
    )
    .await;
    let second: ResponseObject = serde_json::from_value(second.json()).unwrap();
    let list = |id: &str, query: &str| {
        let url = s.at(&format!("/v1/responses/{id}/input_items{query}"));
        async move { get(&url).await }
    };

    let only = list(&first.id, "").await;
    assert_eq!(only.status, 200, "{}", only.text());
    let only = only.json();
    assert_eq!(only["object"], "list");
    assert_eq!(only["data"].as_array().unwrap().len(), 1);
    let message = &only["data"][0];
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "user");
    assert_eq!(message["content"][0]["type"], "input_text");
    assert_eq!(message["content"][0]["text"], "Fix main.rs.");
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));

    // The second response's inputs: the first's input and output, then the tool round.
    let asc = list(&second.id, "?order=asc").await.json();
    let data = asc["data"].as_array().unwrap();
    let kinds: Vec<&str> = data.iter().map(|i| i["type"].as_str().unwrap()).collect();
    let outputs = first.output.len();
    assert_eq!(data.len(), 1 + outputs + 2, "{kinds:?}");
    assert_eq!(data[0], *message, "the same item, the same id");
    for (item, output) in data[1..=outputs].iter().zip(&first.output) {
        assert_eq!(*item, serde_json::to_value(output).unwrap());
    }
    assert_eq!(
        kinds[outputs + 1..],
        ["function_call", "function_call_output"]
    );
    assert_eq!(data[outputs + 1]["call_id"], "call_1");
    assert_eq!(data[outputs + 2]["output"], "fn f1() -> u32 { 1 }");
    assert_eq!(asc["has_more"], false);

    // Newest first by default; pages of 2 walk the same items backwards.
    let ids: Vec<&Value> = data.iter().map(|i| &i["id"]).rev().collect();
    let mut walked = Vec::new();
    let mut query = "?limit=2".to_string();
    loop {
        let page = list(&second.id, &query).await.json();
        walked.extend(
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["id"].clone()),
        );
        if page["has_more"] == false {
            break;
        }
        query = format!("?limit=2&after={}", page["last_id"].as_str().unwrap());
    }
    assert_eq!(walked.iter().collect::<Vec<_>>(), ids);

    let bad = list(&second.id, "?limit=0").await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.error()["param"], "limit");
    let bad = list(&second.id, "?after=msg_unknown").await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.error()["param"], "after");
    let missing = list("resp_unknown", "").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.error()["code"], "response_not_found");
}
