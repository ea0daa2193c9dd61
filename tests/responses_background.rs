//! Background responses on the generated test model over real HTTP: `background: true` answers
//! at once, the run finishes without the client and is read back with `GET`, `cancel` stops it
//! and frees its pages, and what cannot work (no `store`, `stream`, continuing a response that
//! has not ended, cancelling a foreground one) gets a precise error.

#[path = "fixtures/api/client.rs"]
mod client;

use client::{ban_specials, client, get, post, send, wait_idle, Reply};
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

fn error_of(reply: &Reply, status: u16) -> Value {
    assert_eq!(reply.status, status, "{}", reply.text());
    reply.json()["error"].clone()
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
    let mut b = body("Write a long essay.", 3000);
    b["background"] = json!(true);
    let created = response(&post(&s.at("/v1/responses"), &b).await);

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
    let generated = s.engine().scheduler_stats().await.tokens_generated;
    assert!(generated < 3000, "cancelled early ({generated} tokens)");
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "pages freed");
    assert!(s.state.background.is_empty(), "no run left registered");
}

#[actix_rt::test]
async fn deleting_a_running_background_response_stops_it() {
    let s = server();
    let mut b = body("Write a long essay.", 3000);
    b["background"] = json!(true);
    let created = response(&post(&s.at("/v1/responses"), &b).await);
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
    b["store"] = json!(true);
    b["stream"] = json!(true);
    let e = error_of(&post(&s.at("/v1/responses"), &b).await, 400);
    assert_eq!(e["param"], "stream");

    let foreground = response(&post(&s.at("/v1/responses"), &body("hi", 4)).await);
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
