//! Speculative decoding through the HTTP API: Predicted Outputs, `speculative: false`, the
//! usage and timings fields, and the /metrics counters.

#[path = "fixtures/api/client.rs"]
mod client;

use client::*;
use mtpx::api::testing::{test_config, TestServer, TEST_MODEL_ID};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use mtpx::spec::{SpecConfig, SpecMode};
use serde_json::{json, Value};

fn server() -> TestServer {
    let cfg = EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        kv_dtype: KvDtype::F32,
        context_window: Some(4096),
        // A fixed depth: an adaptive one follows verify costs timed while the machine runs
        // other tests, and once drafted only 3 predicted tokens (1 accepted) under load.
        speculative: SpecConfig {
            mode: SpecMode::Auto,
            depth: Some(8),
            ..SpecConfig::default()
        },
        ..EngineConfig::default()
    };
    TestServer::start(&TestModelSpec::default(), cfg, test_config()).unwrap()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": TEST_MODEL_ID,
        "messages": [{"role": "user", "content": "Rewrite the file with parse renamed."}],
        "temperature": 0,
        "max_tokens": 48,
        "logit_bias": ban_specials(),
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[actix_rt::test]
async fn a_predicted_output_is_accepted_and_reported_without_changing_the_reply() {
    let s = server();
    let url = s.at("/v1/chat/completions");
    let plain = post(&url, &chat(json!({"speculative": false})))
        .await
        .json();
    let text = plain["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(plain["timings"]["draft_n"], 0);
    let predicted = post(
        &url,
        &chat(json!({"prediction": {"type": "content", "content": text}})),
    )
    .await
    .json();
    assert_eq!(predicted["choices"][0]["message"]["content"], text.as_str());
    let details = &predicted["usage"]["completion_tokens_details"];
    let accepted = details["accepted_prediction_tokens"].as_u64().unwrap();
    // The random model's text does not always re-tokenize to the same ids, so not all are accepted.
    assert!(accepted > 5, "{predicted}");
    assert_eq!(predicted["timings"]["draft_n_accepted"], accepted);
    let draft_n = predicted["timings"]["draft_n"].as_u64().unwrap();
    assert_eq!(
        details["rejected_prediction_tokens"].as_u64().unwrap(),
        draft_n - accepted
    );
    // Streaming gives the same text.
    let streamed = post(
        &url,
        &chat(json!({"stream": true, "prediction": {"type": "content", "content": [{"type": "text", "text": text}]}})),
    )
    .await
    .events();
    let mut content = String::new();
    for e in &streamed[..streamed.len() - 1] {
        if let Some(t) = e["choices"][0]["delta"]["content"].as_str() {
            content.push_str(t);
        }
    }
    assert_eq!(content, text);
    check_draft_marks(&streamed, accepted);

    let metrics = get(&s.at("/metrics")).await.text();
    assert!(
        metrics.contains("mtpx_spec_accepted_tokens_total{drafter=\"prediction\",depth=\"1\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("mtpx_spec_rejected_tokens_total{drafter=\"ngram\"}"));
}

#[actix_rt::test]
async fn a_prediction_of_another_type_is_refused() {
    let s = server();
    let reply = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"prediction": {"type": "image", "content": "x"}})),
    )
    .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.error()["param"], "prediction.type");
}

#[actix_rt::test]
async fn the_speculative_field_takes_a_drafter_name_and_refuses_others() {
    let s = server();
    let url = s.at("/v1/chat/completions");
    let plain = post(&url, &chat(json!({"speculative": false})))
        .await
        .json();
    let ngram = post(&url, &chat(json!({"speculative": "ngram"}))).await;
    assert_eq!(ngram.status, 200);
    let ngram = ngram.json();
    assert_eq!(
        ngram["choices"][0]["message"]["content"],
        plain["choices"][0]["message"]["content"]
    );
    for (value, needle) in [
        (json!("eagle"), "got \"eagle\""),
        (json!("draft"), "--draft-model"),
        (json!(3), "speculative"),
    ] {
        let reply = post(&url, &chat(json!({ "speculative": value }))).await;
        assert_eq!(reply.status, 400, "{value}");
        let error = reply.error();
        assert!(
            error["message"].as_str().unwrap().contains(needle),
            "{error}"
        );
        assert!(
            error["param"]
                .as_str()
                .unwrap_or_default()
                .contains("speculative"),
            "{error}"
        );
    }
    // The test model has MTP heads: a request may ask for them alone.
    let mtp = post(&url, &chat(json!({"speculative": "mtp"}))).await;
    assert_eq!(mtp.status, 200);
    assert_eq!(
        mtp.json()["choices"][0]["message"]["content"],
        plain["choices"][0]["message"]["content"]
    );
    let stats = get(&s.at("/v1/stats")).await.json();
    assert_eq!(
        stats["speculation"]["drafters"],
        json!(["prediction", "ngram", "mtp"])
    );
}

/// Streamed chunks mark accepted drafts per token (`draft_depths`), and the final timings
/// break the drafts down by depth, consistently with the totals.
fn check_draft_marks(events: &[Value], accepted: u64) {
    let mut marked = 0u64;
    for e in events.iter().filter(|e| e.is_object()) {
        for choice in e["choices"].as_array().into_iter().flatten() {
            if let Some(depths) = choice["draft_depths"].as_array() {
                assert!(!depths.is_empty() && depths.iter().any(|d| d.as_u64() > Some(0)));
                marked += depths.iter().filter(|d| d.as_u64() > Some(0)).count() as u64;
            }
        }
    }
    assert_eq!(marked, accepted, "every accepted draft is marked once");
    let timings = &events
        .iter()
        .rev()
        .find(|e| e["timings"].is_object())
        .expect("timings")["timings"];
    let by_depth = timings["draft_by_depth"]
        .as_array()
        .expect("draft_by_depth");
    let sum = |key: &str| {
        by_depth
            .iter()
            .map(|d| d[key].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(sum("drafted"), timings["draft_n"].as_u64().unwrap());
    assert_eq!(sum("accepted"), accepted);
    for (i, d) in by_depth.iter().enumerate() {
        assert_eq!(d["depth"], i + 1);
        assert!(d["accepted"].as_u64() <= d["drafted"].as_u64());
    }
    // A round that drafts depth k also drafted depths 1..k.
    for w in by_depth.windows(2) {
        assert!(
            w[0]["drafted"].as_u64() >= w[1]["drafted"].as_u64(),
            "{by_depth:?}"
        );
    }
}
