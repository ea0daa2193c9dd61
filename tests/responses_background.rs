//! Background responses on the generated test model over real HTTP: `background: true` answers
//! at once, the run finishes without the client and is read back with `GET`, `cancel` stops it
//! and frees its pages; with `stream: true` its events outlive the creating stream and are
//! streamed again from any sequence number; and what cannot work (no `store`, streaming a
//! response that kept no events, continuing a response that has not ended, cancelling a
//! foreground one) gets a precise error.

#[path = "fixtures/api/client.rs"]
mod client;

use actix_web::web::Bytes;
use client::{ban_specials, client, get, post, send, wait_idle, Reply};
use futures::{Stream, StreamExt};
use mtpx::api::responses::types::ResponseObject;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn server() -> TestServer {
    let engine = EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        context_window: Some(4096),
        page_size: 16,
        ..EngineConfig::default()
    };
    TestServer::start(&TestModelSpec::default(), engine, test_config()).unwrap()
}

fn body(input: &str, max_output_tokens: usize) -> Value {
    json!({
        "input": input,
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
        "logit_bias": ban_specials(),
    })
}

fn response(reply: &Reply) -> ResponseObject {
    assert_eq!(reply.status, 200, "{}", reply.text());
    serde_json::from_value(reply.json()).unwrap()
}

async fn delete(url: &str) -> Reply {
    send(client().delete(url), None).await
}

/// Polls `GET /v1/responses/{id}` as a client of background mode does, until it has ended.
async fn poll_until_ended(s: &TestServer, id: &str) -> ResponseObject {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = response(&get(&s.at(&format!("/v1/responses/{id}"))).await);
        if r.status != "in_progress" {
            return r;
        }
        assert!(Instant::now() < deadline, "{id} still in progress");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads SSE events from `body` until one satisfies `stop` (included) or the body ends; what
/// follows stays unread.
async fn events_until<S, E>(body: &mut S, stop: impl Fn(&Value) -> bool) -> Vec<Value>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Debug,
{
    let (mut text, mut events) = (String::new(), Vec::new());
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.expect("reading the stream")).unwrap());
        while let Some(end) = text.find("\n\n") {
            let frame: String = text.drain(..end + 2).collect();
            let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue; // a keep-alive comment
            };
            let event: Value = serde_json::from_str(data).unwrap();
            let done = stop(&event);
            events.push(event);
            if done {
                return events;
            }
        }
    }
    events
}

fn streamed(b: &Value) -> Value {
    let mut b = b.clone();
    b["background"] = json!(true);
    b["stream"] = json!(true);
    b
}

fn error_of(reply: &Reply, status: u16) -> Value {
    assert_eq!(reply.status, status, "{}", reply.text());
    reply.json()["error"].clone()
}

/// Tokens a run asked for that only a cancel ends early.
const LONG: usize = 3000;

/// A background response that runs until stopped.
async fn start_long(s: &TestServer) -> ResponseObject {
    let mut b = body("Write a long essay.", LONG);
    b["background"] = json!(true);
    response(&post(&s.at("/v1/responses"), &b).await)
}

/// After a long run was stopped and the engine went idle: it stopped early, every page came
/// back, and no run is left registered.
async fn assert_stopped_early_and_freed(s: &TestServer) {
    let generated = s.engine().scheduler_stats().await.tokens_generated;
    assert!(
        (generated as usize) < LONG,
        "cancelled early ({generated} tokens)"
    );
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "pages freed");
    assert!(s.state.background.is_empty(), "no run left registered");
}

#[actix_rt::test]
async fn a_background_response_finishes_without_the_client_as_a_foreground_one_does() {
    let s = server();
    let mut b = body("Fix main.rs.", 12);
    let foreground = response(&post(&s.at("/v1/responses"), &b).await);
    assert!(!foreground.background);
    b["background"] = json!(true);
    let created = response(&post(&s.at("/v1/responses"), &b).await);
    assert!(created.background);
    assert_eq!(created.status, "in_progress");
    assert!(created.output.is_empty());
    // Its input is listed while it runs.
    let items = get(&s.at(&format!("/v1/responses/{}/input_items", created.id))).await;
    assert_eq!(
        items.json()["data"][0]["content"][0]["text"],
        "Fix main.rs."
    );

    let done = poll_until_ended(&s, &created.id).await;
    assert_eq!(done.id, created.id);
    assert!(done.background);
    // Greedy: the same text as in the foreground, and the same ending.
    assert_eq!(done.status, foreground.status);
    assert_eq!(done.output_text(), foreground.output_text());
    assert_eq!(
        done.usage.unwrap().output_tokens,
        foreground.usage.unwrap().output_tokens
    );
    // Cancelling a response that has ended answers it as it is.
    let again = response(
        &post(
            &s.at(&format!("/v1/responses/{}/cancel", done.id)),
            &json!({}),
        )
        .await,
    );
    assert_eq!(again, done);
    // And it continues like any stored response.
    let mut next = body("And lib.rs.", 4);
    next["previous_response_id"] = json!(done.id);
    let next = response(&post(&s.at("/v1/responses"), &next).await);
    assert_eq!(next.previous_response_id.as_deref(), Some(done.id.as_str()));
    assert!(next.usage.unwrap().input_tokens_details.cached_tokens > 0);
}

#[actix_rt::test]
async fn cancelling_a_background_response_stops_it_and_frees_its_pages() {
    let s = server();
    let created = start_long(&s).await;

    // Continuing it before it has ended is refused, not started from half a turn.
    let mut next = body("More.", 4);
    next["previous_response_id"] = json!(created.id);
    let refused = error_of(&post(&s.at("/v1/responses"), &next).await, 400);
    assert_eq!(refused["code"], "previous_response_not_completed");
    assert_eq!(refused["param"], "previous_response_id");

    let cancel = s.at(&format!("/v1/responses/{}/cancel", created.id));
    let cancelled = response(&post(&cancel, &json!({})).await);
    assert_eq!(cancelled.status, "cancelled");
    assert!(cancelled.background);
    let polled = response(&get(&s.at(&format!("/v1/responses/{}", created.id))).await);
    assert_eq!(polled, cancelled);
    assert_eq!(
        response(&post(&cancel, &json!({})).await),
        cancelled,
        "idempotent"
    );

    wait_idle(&s).await;
    assert_stopped_early_and_freed(&s).await;
}

#[actix_rt::test]
async fn deleting_a_running_background_response_stops_it() {
    let s = server();
    let created = start_long(&s).await;
    let url = s.at(&format!("/v1/responses/{}", created.id));
    let deleted = delete(&url).await;
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(
        get(&url).await.status,
        404,
        "not stored again when its run ends"
    );
    wait_idle(&s).await;
    assert!(s.state.background.is_empty());
}

#[actix_rt::test]
async fn what_background_mode_cannot_do_gets_a_precise_error() {
    let s = server();
    let mut b = body("hi", 4);
    b["background"] = json!(true);
    b["store"] = json!(false);
    let e = error_of(&post(&s.at("/v1/responses"), &b).await, 400);
    assert_eq!(e["param"], "background");

    // Streaming again needs a background response created with `stream: true`.
    let foreground = response(&post(&s.at("/v1/responses"), &body("hi", 4)).await);
    b["store"] = json!(true);
    let quiet = response(&post(&s.at("/v1/responses"), &b).await);
    let again = |id: &str| s.at(&format!("/v1/responses/{id}?stream=true"));
    let e = error_of(&get(&again(&foreground.id)).await, 400);
    assert_eq!(e["param"], "stream");
    assert!(e["message"].as_str().unwrap().contains("background"), "{e}");
    let e = error_of(&get(&again(&quiet.id)).await, 400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("without `stream: true`"),
        "{e}"
    );
    let e = error_of(&get(&again("resp_unknown")).await, 404);
    assert_eq!(e["code"], "response_not_found");
    let e = error_of(
        &get(&s.at(&format!("/v1/responses/{}?stream=maybe", quiet.id))).await,
        400,
    );
    assert!(e["message"].is_string(), "{e}");

    let cancel = |id: &str| s.at(&format!("/v1/responses/{id}/cancel"));
    let e = error_of(&post(&cancel(&foreground.id), &json!({})).await, 400);
    assert!(e["message"].as_str().unwrap().contains("background"), "{e}");
    let e = error_of(&post(&cancel("resp_unknown"), &json!({})).await, 404);
    assert_eq!(e["code"], "response_not_found");
    // The server still serves.
    assert_eq!(
        post(&s.at("/v1/responses"), &body("hi", 2)).await.status,
        200
    );
}

#[actix_rt::test]
async fn a_streamed_background_response_outlives_its_stream_and_streams_again_from_any_event() {
    let s = server();
    let b = body("Fix main.rs.", 40);
    let foreground = response(&post(&s.at("/v1/responses"), &b).await);

    let mut res = client()
        .post(s.at("/v1/responses"))
        .send_json(&streamed(&b))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let first = events_until(&mut res, |e| e["sequence_number"] == 5).await;
    drop(res); // The client hangs up; the run goes on.
    assert_eq!(first[0]["type"], "response.created");
    assert_eq!(first[0]["response"]["background"], true);
    let id = first[0]["response"]["id"].as_str().unwrap().to_string();
    let url = s.at(&format!("/v1/responses/{id}?stream=true"));
    // Streamed again from the event after the last one it got (while it runs, or after).
    let rest = get(&format!("{url}&starting_after=5")).await;
    assert_eq!(rest.status, 200, "{}", rest.text());
    assert_eq!(
        rest.header("content-type").as_deref(),
        Some("text/event-stream; charset=utf-8")
    );
    let rest = rest.events();

    let done = poll_until_ended(&s, &id).await;
    let all = get(&url).await.events();
    for (n, e) in all.iter().enumerate() {
        assert_eq!(e["sequence_number"], n, "numbered without gaps: {e}");
    }
    assert_eq!(all[..6], first[..], "the same events as the first stream");
    assert_eq!(all[6..], rest[..], "and the same after the resumption");
    // Ending with the stored response, whose text is the foreground one (greedy).
    let last: ResponseObject =
        serde_json::from_value(all.last().unwrap()["response"].clone()).unwrap();
    assert_eq!(last, done);
    assert_eq!(done.output_text(), foreground.output_text());
    let deltas: String = all
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, done.output_text());

    // From the last event on there is nothing more; past it is an error.
    let n = all.len() - 1;
    assert!(get(&format!("{url}&starting_after={n}"))
        .await
        .events()
        .is_empty());
    let e = error_of(&get(&format!("{url}&starting_after={}", n + 1)).await, 400);
    assert_eq!(e["param"], "starting_after");
    // Deleted with its response.
    assert_eq!(
        delete(&s.at(&format!("/v1/responses/{id}"))).await.status,
        200
    );
    assert_eq!(get(&url).await.status, 404);
    assert_eq!(s.state.responses.event_log_bytes(), 0);
    wait_idle(&s).await;
    assert!(s.state.background.is_empty());
}

#[actix_rt::test]
async fn cancelling_a_streamed_background_response_ends_its_streams() {
    let s = server();
    let b = streamed(&body("Write a long essay.", LONG));
    let mut res = client()
        .post(s.at("/v1/responses"))
        .send_json(&b)
        .await
        .unwrap();
    let first = events_until(&mut res, |e| e["sequence_number"] == 3).await;
    let id = first[0]["response"]["id"].as_str().unwrap().to_string();
    // A second reader from the start, following it live.
    let mut follower = client()
        .get(s.at(&format!("/v1/responses/{id}?stream=true")))
        .send()
        .await
        .unwrap();
    // The server reports the run and its log.
    let stats = get(&s.at("/v1/stats")).await.json();
    assert_eq!(stats["background_responses_running"], 1, "{stats}");
    assert!(
        stats["response_event_log_bytes"].as_u64().unwrap() > 0,
        "{stats}"
    );
    let metrics = get(&s.at("/metrics")).await.text();
    assert!(
        metrics.contains("\nmtpx_background_responses_running 1\n"),
        "{metrics}"
    );
    // A sequence number it has not sent yet is a mistake, not a wait.
    let ahead = get(&s.at(&format!(
        "/v1/responses/{id}?stream=true&starting_after=100000"
    )))
    .await;
    assert_eq!(error_of(&ahead, 400)["param"], "starting_after");
    let cancelled = response(&post(&s.at(&format!("/v1/responses/{id}/cancel")), &json!({})).await);
    assert_eq!(cancelled.status, "cancelled");
    // Both streams end, with the cancelled response last.
    let rest = events_until(&mut res, |_| false).await;
    let all = events_until(&mut follower, |_| false).await;
    assert_eq!(all[..4], first[..]);
    assert_eq!(all[4..], rest[..]);
    let last = all.last().unwrap();
    assert_eq!(last["type"], "response.cancelled", "{last}");
    let last: ResponseObject = serde_json::from_value(last["response"].clone()).unwrap();
    assert_eq!(last, cancelled);

    wait_idle(&s).await;
    let stats = get(&s.at("/v1/stats")).await.json();
    assert_eq!(stats["background_responses_running"], 0, "{stats}");
    assert!(
        stats["response_event_log_bytes"].as_u64().unwrap() > 0,
        "kept: {stats}"
    );
    assert_stopped_early_and_freed(&s).await;
}
