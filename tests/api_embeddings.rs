//! Embeddings over HTTP with a real pulled model (Qwen2.5-Coder-0.5B-Instruct): `/v1/embeddings`
//! in every input shape and both encodings, batched inputs equal to each alone, embeddings
//! interleaved with a running generation leave it unchanged, refusals before inference with
//! nothing leaked, and Ollama's `/api/embed` and `/api/embeddings`. (Their values against the
//! numpy reference: `tests/reference_parity.rs`; the `openai` and `ollama` packages:
//! `tests/python/`.)

#[path = "fixtures/api/client.rs"]
mod client;
mod common;

use base64::Engine as _;
use client::*;
use common::small_qwen_server;
use serde_json::{json, Value};

const TEXTS: [&str; 8] = [
    "def add(a, b):\n    return a + b",
    "SELECT name, email FROM users WHERE age > 30;",
    "The cat sat on the mat and purred.",
    "fn main() { println!(\"hello\"); }",
    "<html><body><h1>Title</h1></body></html>",
    "import numpy as np\nx = np.zeros(10)",
    "git rebase -i HEAD~3",
    "A binary search halves the interval each step.",
];

fn vectors(reply: &Reply) -> Vec<Vec<f32>> {
    assert_eq!(reply.status, 200, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["object"], "list");
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["object"], "embedding");
            assert_eq!(d["index"], i);
            let v: Vec<f32> = serde_json::from_value(d["embedding"].clone()).unwrap();
            v
        })
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

async fn token_count(s: &mtpx::api::testing::TestServer, text: &str) -> usize {
    let r = post(&s.at("/tokenize"), &json!({ "prompt": text })).await;
    r.json()["count"].as_u64().unwrap() as usize
}

#[actix_rt::test]
async fn a_batch_of_inputs_equals_each_alone_in_every_shape_and_encoding() {
    let s = small_qwen_server();
    let url = s.at("/v1/embeddings");
    let batch = post(&url, &json!({ "model": "test-model", "input": TEXTS })).await;
    let body = batch.json();
    let together = vectors(&batch);
    assert_eq!(together.len(), TEXTS.len());
    let mut expected_tokens = 0;
    for (text, v) in TEXTS.iter().zip(&together) {
        assert_eq!(v.len(), 896);
        assert!((dot(v, v) - 1.0).abs() < 1e-4, "not unit length");
        let alone = vectors(&post(&url, &json!({ "input": text })).await);
        let cosine = dot(&alone[0], v);
        assert!(
            cosine > 0.9999,
            "{text:?}: alone vs in a batch of 8: {cosine}"
        );
        expected_tokens += token_count(&s, text).await;
    }
    assert_eq!(body["usage"]["prompt_tokens"], expected_tokens);
    assert_eq!(body["usage"]["total_tokens"], expected_tokens);
    assert_eq!(body["model"], "test-model");
    // Different texts are different vectors, and related ones closer than unrelated ones.
    assert!(dot(&together[0], &together[1]) < 0.99);

    // base64: little-endian float32 of the same vector.
    let encoded = post(
        &url,
        &json!({ "input": TEXTS[0], "encoding_format": "base64" }),
    )
    .await;
    let b64 = encoded.json()["data"][0]["embedding"]
        .as_str()
        .unwrap()
        .to_string();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let alone = vectors(&post(&url, &json!({ "input": TEXTS[0] })).await);
    assert!(dot(&decoded, &alone[0]) > 0.9999);

    // Token ids, alone and as lists, embed as their text does.
    let ids: Vec<u32> = serde_json::from_value(
        post(&s.at("/tokenize"), &json!({ "prompt": TEXTS[1] }))
            .await
            .json()["tokens"]
            .clone(),
    )
    .unwrap();
    let by_ids = vectors(&post(&url, &json!({ "input": ids })).await);
    assert!(dot(&by_ids[0], &together[1]) > 0.9999);
    let lists = vectors(&post(&url, &json!({ "input": [ids.clone(), ids] })).await);
    assert_eq!(lists.len(), 2);
    assert!(dot(&lists[1], &together[1]) > 0.9999);
}

#[actix_rt::test]
async fn embeddings_between_the_steps_of_a_generation_leave_it_unchanged() {
    let s = small_qwen_server();
    let chat = json!({
        "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}],
        "temperature": 0, "max_tokens": 48,
    });
    let alone = post(&s.at("/v1/chat/completions"), &chat).await.json();
    let expected = alone["choices"][0]["message"]["content"].clone();
    let chat_url = s.at("/v1/chat/completions");
    let generation = post(&chat_url, &chat);
    let embeddings = async {
        let mut all = Vec::new();
        for text in TEXTS {
            all.push(vectors(
                &post(&s.at("/v1/embeddings"), &json!({ "input": text })).await,
            ));
        }
        all
    };
    let (generated, embedded) = futures::join!(generation, embeddings);
    assert_eq!(
        generated.json()["choices"][0]["message"]["content"],
        expected
    );
    assert_eq!(embedded.len(), TEXTS.len());
}

#[actix_rt::test]
async fn bad_requests_are_refused_before_inference_and_leak_nothing() {
    let s = small_qwen_server();
    let url = s.at("/v1/embeddings");
    let long = "word ".repeat(3000);
    let cases: [(Value, u16, &str, &str); 7] = [
        (
            json!({ "input": long }),
            400,
            "input",
            "`input[0]` is 3001 tokens long but the model's maximum context length is 2048",
        ),
        (json!({ "input": "" }), 400, "input", "`input[0]` is empty"),
        (json!({ "input": [] }), 400, "input", "no text"),
        (
            json!({ "input": "x", "dimensions": 256 }),
            400,
            "dimensions",
            "896 dimensions",
        ),
        (
            json!({ "input": "x", "encoding_format": "int8" }),
            400,
            "encoding_format",
            "`float` or `base64`",
        ),
        (
            json!({ "input": [1, 999999] }),
            400,
            "input",
            "token id 999999",
        ),
        (
            json!({ "input": "x", "model": "gpt-4" }),
            404,
            "model",
            "gpt-4",
        ),
    ];
    for (body, status, param, words) in cases {
        let r = post(&url, &body).await;
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let e = r.error();
        assert_eq!(e["param"], param, "{e}");
        assert!(e["message"].as_str().unwrap().contains(words), "{e}");
    }
    let over = post(&url, &json!({ "input": ["short", long] })).await;
    let e = over.error();
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(
        (&e["prompt_tokens"], &e["context_window"]),
        (&json!(3001), &json!(2048))
    );
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("`input[1]` is 3001 tokens"),
        "{e}"
    );
    let missing = post(&url, &json!({ "model": "test-model" })).await;
    assert_eq!(missing.status, 400, "{}", missing.text());
    // Still serving, and every page back in the pool.
    assert_eq!(
        vectors(&post(&url, &json!({ "input": "ok" })).await).len(),
        1
    );
    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0);
}

#[actix_rt::test]
async fn ollama_embed_and_embeddings() {
    let s = small_qwen_server();
    let openai = vectors(&post(&s.at("/v1/embeddings"), &json!({ "input": TEXTS[..2] })).await);
    let r = post(
        &s.at("/api/embed"),
        &json!({ "model": "test-model", "input": TEXTS[..2] }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["model"], "test-model");
    let ollama: Vec<Vec<f32>> = serde_json::from_value(body["embeddings"].clone()).unwrap();
    for (a, b) in openai.iter().zip(&ollama) {
        assert!(dot(a, b) > 0.9999);
    }
    let tokens = token_count(&s, TEXTS[0]).await + token_count(&s, TEXTS[1]).await;
    assert_eq!(body["prompt_eval_count"], tokens);
    assert!(body["total_duration"].as_u64().unwrap() > 0);

    // Nothing to embed loads the model in Ollama: an empty answer.
    let load = post(&s.at("/api/embed"), &json!({ "model": "test-model" })).await;
    assert_eq!(load.json()["embeddings"], json!([]));

    // A text over the window: the first 2,048 tokens by default, refused with truncate: false.
    let long = "word ".repeat(3000);
    let cut = post(&s.at("/api/embed"), &json!({ "input": long }))
        .await
        .json();
    assert_eq!(cut["prompt_eval_count"], 2048);
    let refused = post(
        &s.at("/api/embed"),
        &json!({ "input": long, "truncate": false }),
    )
    .await;
    assert_eq!(refused.status, 400);
    let error = refused.json();
    assert!(
        error["error"].as_str().unwrap().contains("2048"),
        "Ollama's error shape: {error}"
    );

    // The older route: one prompt, the pooled vector as is (not unit length).
    let old = post(&s.at("/api/embeddings"), &json!({ "prompt": TEXTS[0] }))
        .await
        .json();
    let raw: Vec<f32> = serde_json::from_value(old["embedding"].clone()).unwrap();
    let norm = dot(&raw, &raw).sqrt();
    assert!((norm - 1.0).abs() > 0.01, "norm {norm}");
    let unit: Vec<f32> = raw.iter().map(|x| x / norm).collect();
    assert!(dot(&unit, &openai[0]) > 0.9999);
}

#[actix_rt::test]
async fn llamacpp_native_embedding_route() {
    let s = small_qwen_server();
    let openai = vectors(&post(&s.at("/v1/embeddings"), &json!({ "input": TEXTS[..2] })).await);
    let r = post(&s.at("/embedding"), &json!({ "content": TEXTS[..2] })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let items = r.json();
    for (i, item) in items.as_array().unwrap().iter().enumerate() {
        assert_eq!(item["index"], i);
        let v: Vec<Vec<f32>> = serde_json::from_value(item["embedding"].clone()).unwrap();
        assert_eq!(v.len(), 1, "one pooled vector per input");
        assert!(dot(&v[0], &openai[i]) > 0.9999);
    }
    // embd_normalize -1: the pooled vector as is, which Ollama's older route also sends.
    let raw = post(
        &s.at("/embeddings"),
        &json!({ "input": TEXTS[0], "embd_normalize": -1 }),
    )
    .await;
    let raw: Vec<f32> = serde_json::from_value(raw.json()[0]["embedding"][0].clone()).unwrap();
    let old = post(&s.at("/api/embeddings"), &json!({ "prompt": TEXTS[0] }))
        .await
        .json();
    let old: Vec<f32> = serde_json::from_value(old["embedding"].clone()).unwrap();
    assert_eq!(raw, old);
    let bad = post(
        &s.at("/embedding"),
        &json!({ "content": "x", "embd_normalize": "l2" }),
    )
    .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.error()["param"], "embd_normalize");
    let none = post(&s.at("/embedding"), &json!({ "prompt": "x" })).await;
    assert_eq!(none.status, 400);
    assert_eq!(none.error()["param"], "content");
}
