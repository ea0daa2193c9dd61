//! The HTTP API over a real pulled model (Qwen2.5-Coder-0.5B-Instruct): tool calls streamed as
//! OpenAI deltas that reassemble into valid JSON, and the agent regression (the session of
//! `api_agent.rs`, shared through `fixtures/api/agent_session.rs`) at a 24,576-token window.
//! Needs `mtpx pull qwen2.5-coder-0.5b` (tests/run.sh does it).

#[path = "fixtures/agent.rs"]
mod agent;
#[path = "fixtures/api/agent_session.rs"]
mod agent_session;
#[path = "fixtures/api/client.rs"]
mod client;

use agent_session::{agent_session, AgentPlan};

use client::*;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use serde_json::{json, Value};
use std::path::PathBuf;

fn qwen() -> PathBuf {
    let home = std::env::var_os("MTPX_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/mtpx"));
    let path = home.join("models/qwen2.5-coder-0.5b.gguf");
    assert!(path.exists(), "run `mtpx pull qwen2.5-coder-0.5b` first");
    path
}

fn server(window: usize) -> TestServer {
    let engine = EngineConfig {
        context_window: Some(window),
        kv_memory: KvMemory::Bytes(1 << 30),
        kv_dtype: KvDtype::F16,
        ..EngineConfig::default()
    };
    TestServer::start_model(qwen(), engine, test_config()).unwrap()
}

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}}])
}

/// Reassembles streamed `delta.tool_calls` into (name, arguments) per call index, checking
/// that no tool-call markup leaks into `content`.
fn reassemble(events: &[Value]) -> (Vec<(String, String)>, String, Option<String>) {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut content = String::new();
    let mut finish = None;
    for e in events.iter().filter(|e| e.is_object()) {
        let Some(choice) = e["choices"].get(0) else {
            continue;
        };
        if let Some(text) = choice["delta"]["content"].as_str() {
            content.push_str(text);
        }
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = call["index"].as_u64().unwrap() as usize;
            if calls.len() <= index {
                calls.resize(index + 1, (String::new(), String::new()));
                assert!(
                    call["id"].as_str().is_some_and(|id| !id.is_empty()),
                    "first delta has an id"
                );
            }
            if let Some(name) = call["function"]["name"].as_str() {
                calls[index].0.push_str(name);
            }
            if let Some(args) = call["function"]["arguments"].as_str() {
                calls[index].1.push_str(args);
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (calls, content, finish)
}

#[actix_rt::test]
async fn qwen_streams_tool_calls_that_reassemble_into_valid_json() {
    let s = server(4096);
    let max_tokens = 64;
    // With `auto` the 0.5B model writes the call as a fenced JSON object without the
    // `<tool_call>` tags; it is recognised because it names a declared tool. `required` and a
    // named function force the tagged block. How many calls the model makes where several are
    // allowed is its own choice and moves with the attention path's rounding (greedy,
    // `required` repeats the same call until `max_tokens` on an AVX-512 BF16 CPU and stops after
    // one in f32), so the count is pinned only where the grammar allows one call: a named
    // function, or `parallel_tool_calls: false`.
    for (tool_choice, parallel, one_call) in [
        (json!("auto"), None, true),
        (json!("required"), Some(false), true),
        (json!("required"), None, false),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            None,
            true,
        ),
    ] {
        let case = format!("{tool_choice} parallel_tool_calls={parallel:?}");
        let mut body = json!({
            "messages": [{"role": "user", "content": "What is the weather like in Paris right now?"}],
            "tools": weather_tool(),
            "tool_choice": tool_choice,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": true,
        });
        if let Some(parallel) = parallel {
            body["parallel_tool_calls"] = json!(parallel);
        }
        let reply = post(&s.at("/v1/chat/completions"), &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let (calls, content, finish) = reassemble(&reply.events());

        // The same request without streaming gives the same reply.
        let mut plain = body.clone();
        plain["stream"] = json!(false);
        let reply = post(&s.at("/v1/chat/completions"), &plain).await.json();
        let message = &reply["choices"][0]["message"];
        let plain_calls = message["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{case}: no tool_calls in {reply}"));
        let unstreamed: Vec<(String, String)> = plain_calls
            .iter()
            .map(|c| {
                let f = &c["function"];
                let text = |v: &Value| v.as_str().unwrap().to_string();
                (text(&f["name"]), text(&f["arguments"]))
            })
            .collect();
        assert_eq!(unstreamed, calls, "{case}");
        assert_eq!(message["content"].as_str().unwrap_or(""), content, "{case}");
        assert_eq!(
            reply["choices"][0]["finish_reason"].as_str(),
            finish.as_deref(),
            "{case}"
        );
        let ids: std::collections::HashSet<&str> = plain_calls
            .iter()
            .map(|c| c["id"].as_str().unwrap())
            .collect();
        assert_eq!(
            ids.len(),
            plain_calls.len(),
            "{case}: ids repeat in {reply}"
        );

        // A reply cut by `max_tokens` ends `length`; a block it cut before the call's name stays
        // text, as llama.cpp's server and vLLM keep it. Otherwise no markup reaches the content.
        let cut = reply["usage"]["completion_tokens"] == json!(max_tokens);
        let expected = if cut { "length" } else { "tool_calls" };
        assert_eq!(finish.as_deref(), Some(expected), "{case}: {reply}");
        if !cut {
            assert!(
                !content.contains("<tool_call>"),
                "{case}: markup leaked: {content:?}"
            );
        }
        assert!(!calls.is_empty(), "{case}: no call / {content:?}");
        if one_call {
            assert_eq!(calls.len(), 1, "{case}: {calls:?}");
        }
        for (name, arguments) in &calls {
            assert_eq!(name, "get_weather", "{case}");
            let args: Value = serde_json::from_str(arguments)
                .unwrap_or_else(|e| panic!("{case}: arguments {arguments:?} are not JSON: {e}"));
            assert!(args["city"].as_str().unwrap().contains("Paris"), "{args}");
        }
    }
}

#[actix_rt::test]
async fn with_auto_a_request_that_needs_no_tool_gets_plain_content() {
    let s = server(4096);
    let body = json!({
        "messages": [{"role": "user", "content": "Write a haiku about autumn leaves."}],
        "tools": weather_tool(),
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 48,
        "stream": true,
    });
    let reply = post(&s.at("/v1/chat/completions"), &body).await;
    let (calls, content, finish) = reassemble(&reply.events());
    assert!(calls.is_empty(), "{calls:?}");
    assert!(content.split_whitespace().count() >= 5, "{content:?}");
    assert_ne!(finish.as_deref(), Some("tool_calls"));
}

/// The agent regression with the real model: a 3,400-token `write` call, then ~4,000-token tool
/// results past 16,384 and 19,295 prompt tokens toward a 24,576-token window, every turn
/// reusing the session's KV (each prefills only its new tokens, attending over the whole
/// session), the over-window turn refused with its counts, no pages leaked.
#[actix_rt::test]
async fn qwen_agent_session_grows_past_16k_and_19k_to_a_24k_window() {
    const WINDOW: usize = 24_576;
    let s = server(WINDOW);
    let plan = AgentPlan {
        window: WINDOW,
        tool_result_tokens: 4_000,
        max_tokens: 16,
        stop_within: 4_500,
        min_last_prompt: 20_000,
    };
    agent_session(&s, &plan).await;
    s.stop().await;
}

#[actix_rt::test]
async fn a_suffix_makes_qwen_fill_in_the_middle() {
    let s = server(4096);
    let url = s.at("/v1/completions");
    let body = |suffix: Option<&str>| {
        let mut b = json!({"prompt": "def add(a, b):\n    ", "max_tokens": 48, "temperature": 0});
        if let Some(suffix) = suffix {
            b["suffix"] = json!(suffix);
        }
        b
    };
    let filled = post(&url, &body(Some("\n\nprint(add(2, 3))\n")))
        .await
        .json();
    let choice = &filled["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(text.starts_with("return a + b"), "{text:?}");
    // It ends where the middle ends (the model's end-of-text token), not at max_tokens.
    assert_eq!(choice["finish_reason"], "stop", "{filled}");
    assert!(!text.contains("fim"), "{text:?}");
    // The three FIM tokens and the suffix are part of the prompt.
    let plain = post(&url, &body(None)).await.json();
    let (with, without) = (
        filled["usage"]["prompt_tokens"].as_u64().unwrap(),
        plain["usage"]["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(with > without + 3, "{with} vs {without}");
    assert_eq!(plain["choices"][0]["finish_reason"], "length");
    // A suffix needs a text prompt.
    let mut ids = body(Some("x"));
    ids["prompt"] = json!([1, 2, 3]);
    let reply = post(&url, &ids).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "prompt");
}

/// The log-likelihood of `continuation` after `context`, as evaluation harnesses (lm-eval's
/// `local-completions`) ask for it: the whole text with `echo`, `logprobs: 1`, `max_tokens: 1`,
/// summing the prompt tokens that start inside the continuation.
async fn loglikelihood(url: &str, context: &str, continuation: &str) -> (f64, Value) {
    let prompt = format!("{context}{continuation}");
    let reply = post(
        url,
        &json!({"prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 1,
                "temperature": 0}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let r = reply.json();
    let lp = &r["choices"][0]["logprobs"];
    let offsets = lp["text_offset"].as_array().unwrap();
    let sum = offsets
        .iter()
        .zip(lp["token_logprobs"].as_array().unwrap())
        .filter(|(o, _)| (context.len()..prompt.len()).contains(&(o.as_u64().unwrap() as usize)))
        .map(|(_, l)| l.as_f64().unwrap())
        .sum();
    (sum, r)
}

#[actix_rt::test]
async fn echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask() {
    let s = server(4096);
    let url = s.at("/v1/completions");
    let context = "The capital of France is";
    let (paris, r) = loglikelihood(&url, context, " Paris").await;
    let (berlin, _) = loglikelihood(&url, context, " Berlin").await;
    let (london, _) = loglikelihood(&url, context, " London").await;
    assert!(
        paris > berlin + 2.0 && paris > london + 2.0,
        "{paris} {berlin} {london}"
    );
    assert!(paris > -1.0, "{paris}");
    // The text is the prompt and the completion; one entry per prompt token, then the
    // generated one; the first prompt token has no logprob; offsets index into the text.
    let choice = &r["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(
        text.starts_with("The capital of France is Paris"),
        "{text:?}"
    );
    let lp = &choice["logprobs"];
    let prompt_tokens = r["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), prompt_tokens + 1);
    assert!(lp["token_logprobs"][0].is_null());
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let tokens = lp["tokens"].as_array().unwrap();
    for (token, offset) in tokens.iter().zip(lp["text_offset"].as_array().unwrap()) {
        let (token, offset) = (token.as_str().unwrap(), offset.as_u64().unwrap() as usize);
        assert_eq!(&text[offset..offset + token.len()], token, "{lp}");
    }

    // Streamed: the prompt with its scores comes first, then the generated tokens.
    let reply = post(
        &url,
        &json!({"prompt": "def add(a, b):", "echo": true, "logprobs": 0, "max_tokens": 4,
                "temperature": 0, "stream": true}),
    )
    .await;
    let events = reply.events();
    let first = &events[0]["choices"][0];
    assert_eq!(first["text"], "def add(a, b):");
    assert!(first["logprobs"]["token_logprobs"][0].is_null());
    let scored = first["logprobs"]["token_logprobs"].as_array().unwrap();
    assert!(
        scored[1..].iter().all(|l| l.as_f64().unwrap() < 0.0),
        "{first}"
    );
    let whole = post(
        &url,
        &json!({"prompt": "def add(a, b):", "echo": true, "max_tokens": 4, "temperature": 0}),
    )
    .await
    .json();
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["text"].as_str())
        .collect();
    assert_eq!(streamed, whole["choices"][0]["text"].as_str().unwrap());
    assert!(streamed.starts_with("def add(a, b):") && streamed.len() > 14);

    let reply = post(&url, &json!({"prompt": "x", "echo": true, "suffix": "y"})).await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.error()["param"], "echo");
}

#[actix_rt::test]
async fn llama_cpp_completion_and_infill_routes_answer_as_llama_cpp_does() {
    let s = server(4096);
    let props = get(&s.at("/props")).await.json();
    assert_eq!(props["default_generation_settings"]["n_ctx"], 4096);
    // `/completion` gives `/v1/completions`' greedy text, with llama.cpp's counts.
    let openai = post(
        &s.at("/v1/completions"),
        &json!({"prompt": "def fib(n):", "max_tokens": 16, "temperature": 0}),
    )
    .await
    .json();
    let body = json!({"prompt": "def fib(n):", "n_predict": 16, "temperature": 0});
    let native = post(&s.at("/completion"), &body).await.json();
    assert_eq!(native["content"], openai["choices"][0]["text"], "{native}");
    assert_eq!(native["stop"], true);
    assert_eq!(native["stop_type"], "limit");
    assert_eq!(native["tokens_predicted"], 16);
    assert_eq!(native["tokens_evaluated"], openai["usage"]["prompt_tokens"]);
    assert_eq!(native["timings"]["predicted_n"], 16);
    // A stop string: `stop_type` `word`, naming it.
    let content = native["content"].as_str().unwrap();
    let word = content.split_whitespace().nth(1).unwrap();
    let mut stopped = body.clone();
    stopped["stop"] = json!([word]);
    let cut = post(&s.at("/completion"), &stopped).await.json();
    assert_eq!(
        (cut["stop_type"].as_str(), cut["stopping_word"].as_str()),
        (Some("word"), Some(word)),
        "{cut}"
    );
    assert!(
        content.starts_with(cut["content"].as_str().unwrap()),
        "{cut}"
    );
    // Streamed: `data:` objects whose `content` adds up, the last with `stop: true`, and no
    // `[DONE]` (llama.cpp's native stream has none).
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n_probs"] = json!(2);
    let events = post(&s.at("/completion"), &streamed).await.events();
    let (last, pieces) = events.split_last().unwrap();
    assert_eq!(last["stop"], true, "{events:?}");
    assert!(pieces.iter().all(|e| e["stop"] == false));
    let text: String = pieces
        .iter()
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, native["content"].as_str().unwrap());
    let probs = &pieces[0]["completion_probabilities"][0];
    assert_eq!(probs["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(
        probs["top_logprobs"][0]["id"], probs["id"],
        "greedy took the best token"
    );

    // `/infill` with a file of the repository as context: the middle uses what it defines.
    let infill = post(
        &s.at("/infill"),
        &json!({"input_prefix": "from consts import *\n\ndef area(r):\n    ",
                "input_suffix": "\n\nprint(area(2))\n",
                "input_extra": [{"filename": "consts.py", "text": "PI = 3.14159\n"}],
                "n_predict": 12, "temperature": 0}),
    )
    .await
    .json();
    let middle = infill["content"].as_str().unwrap();
    assert!(middle.starts_with("return PI * r"), "{infill}");
    assert!(
        infill["tokens_evaluated"].as_u64().unwrap() > 20,
        "{infill}"
    );

    let refused = post(
        &s.at("/completion"),
        &json!({"prompt": "x", "grammar": "root ::= \"a"}),
    )
    .await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.error()["param"], "grammar");
    assert!(
        refused.text().contains("unterminated string"),
        "{}",
        refused.text()
    );
    // `n_predict` is a ceiling, as in llama.cpp; a prompt past the window is refused.
    let window = s.engine().info().context_window;
    let refused = post(
        &s.at("/completion"),
        &json!({"prompt": "x ".repeat(window + 8), "n_predict": 8}),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(refused.error()["code"], "context_length_exceeded");
}

/// What the editor plugins (llama.vim, llama.vscode) send, answered as llama.cpp's server
/// answers it: each expected value below is what llama-server (0c1e570) gave for the same
/// request on the same file.
#[actix_rt::test]
async fn llama_cpp_editor_plugin_requests_answer_as_llama_cpp_does() {
    let s = server(4096);
    let (infill, completion) = (s.at("/infill"), s.at("/completion"));
    // `prompt` (the cursor's line so far) ends the prefix, after the repository header
    // llama.cpp always writes: the layout spelled out as text gives the same tokens and reply.
    let body = json!({"input_prefix": "def add(a, b):\n", "prompt": "    return ",
                      "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 5, "temperature": 0});
    let middle = post(&infill, &body).await.json();
    let layout = "<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def add(a, b):\n    \
                  return <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>";
    let spelled = post(
        &completion,
        &json!({"prompt": layout, "n_predict": 5, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(middle["content"], spelled["content"], "{middle}");
    assert_eq!(middle["tokens_evaluated"], spelled["tokens_evaluated"]);
    assert!(
        middle["content"].as_str().unwrap().starts_with("a + b"),
        "{middle}"
    );
    // Code that spells a control token keeps it as text (llama.cpp: 10 and 19 tokens).
    let count = |prefix: &str| {
        let body = json!({"input_prefix": prefix, "input_suffix": "", "n_predict": 1});
        let url = infill.clone();
        async move { post(&url, &body).await.json()["tokens_evaluated"].clone() }
    };
    assert_eq!(count("").await, 10);
    assert_eq!(count("s = \"<|endoftext|>\"\n").await, 19);

    // `n_predict: 0` warms the cache: no text (`response_fields: [""]` → `{}`, as llama.cpp),
    // and the next request with the same context reuses the computed prompt.
    let extra = json!([{"filename": "consts.py", "text": "PI = 3.14159\n".repeat(40)}]);
    let warm = json!({"input_prefix": "", "input_suffix": "", "input_extra": extra,
                      "n_predict": 0, "response_fields": [""]});
    assert_eq!(post(&infill, &warm).await.json(), json!({}));
    let mut next = warm.clone();
    next["n_predict"] = json!(1);
    next["response_fields"] = json!(["tokens_cached", "tokens_evaluated"]);
    let next = post(&infill, &next).await.json();
    let (cached, evaluated) = (
        next["tokens_cached"].as_u64().unwrap(),
        next["tokens_evaluated"].as_u64().unwrap(),
    );
    assert!(cached + 16 >= evaluated && evaluated > 400, "{next}");

    // `n_indent`: the reply ends at a line indented less (llama.cpp: "return a + b\n").
    let indented = json!({"input_prefix": "def add(a, b):\n", "prompt": "    ",
                          "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 40,
                          "temperature": 0, "n_indent": 4});
    let cut = post(&infill, &indented).await.json();
    assert_eq!(
        (cut["content"].as_str(), cut["stop_type"].as_str()),
        (Some("return a + b\n"), Some("limit")),
        "{cut}"
    );
    // Streamed, nothing the cut removes is sent.
    let mut streamed = indented.clone();
    streamed["stream"] = json!(true);
    let events = post(&infill, &streamed).await.events();
    let text: String = events
        .iter()
        .filter_map(|e| e["content"].as_str())
        .collect();
    assert_eq!(text, "return a + b\n");

    // `t_max_predict_ms`: once the time is up, the reply ends at the next newline
    // (llama.cpp: "\n    if n <= 0:\n"), a prefix of the reply without the limit.
    let full = json!({"prompt": "def fibonacci(n):", "n_predict": 40, "temperature": 0});
    let whole = post(&completion, &full).await.json();
    let mut limited = full.clone();
    limited["t_max_predict_ms"] = json!(1);
    let quick = post(&completion, &limited).await.json();
    let (quick_text, whole_text) = (
        quick["content"].as_str().unwrap(),
        whole["content"].as_str().unwrap(),
    );
    assert!(
        quick_text.ends_with('\n') && quick_text.matches('\n').count() == 2,
        "{quick}"
    );
    assert!(whole_text.starts_with(quick_text), "{quick} / {whole}");
    assert_eq!(quick["stop_type"], "limit");

    // `max_tokens` stands for `n_predict`; an array of prompts answers each as alone.
    let one = post(
        &completion,
        &json!({"prompt": "class Foo:", "max_tokens": 3, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(one["tokens_predicted"], 3, "{one}");
    let both = post(
        &completion,
        &json!({"prompt": ["def add(a, b):", "class Foo:"], "n_predict": 3, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(both[1]["content"], one["content"], "{both}");
    assert_eq!(
        (both[0]["index"].clone(), both[1]["index"].clone()),
        (json!(0), json!(1))
    );

    // `logit_bias` by text bans the token; `return_tokens` gives the ids of `content`.
    let france = json!({"prompt": "The capital of France is", "n_predict": 2, "temperature": 0,
                        "return_tokens": true});
    let paris = post(&completion, &france).await.json();
    assert!(
        paris["content"].as_str().unwrap().starts_with(" Paris"),
        "{paris}"
    );
    let ids = paris["tokens"].clone();
    let detok = post(&s.at("/detokenize"), &json!({"tokens": ids}))
        .await
        .json();
    assert_eq!(detok["content"], paris["content"]);
    let mut banned = france.clone();
    banned["logit_bias"] = json!([[" Paris", false]]);
    let other = post(&completion, &banned).await.json();
    assert!(
        !other["content"].as_str().unwrap().starts_with(" Paris"),
        "{other}"
    );
    // A token named twice, by id and by text, gets the sum of its biases (as llama.cpp adds
    // them): −100 + 5 still bans it, whichever comes last.
    banned["logit_bias"] = json!([[paris["tokens"][0], -100], [" Paris", 5]]);
    let summed = post(&completion, &banned).await.json();
    assert!(
        !summed["content"].as_str().unwrap().starts_with(" Paris"),
        "{summed}"
    );
}

/// Logprobs' `bytes` are the tokens' raw bytes: Qwen splits an emoji's zero-width joiner over
/// two tokens, each of whose text alone is U+FFFD, yet the bytes together spell the reply
/// exactly (the end-of-turn token is not listed, as OpenAI lists none).
#[actix_rt::test]
async fn logprob_bytes_spell_the_reply_even_across_split_characters() {
    let s = server(4096);
    let body = json!({"messages": [{"role": "user",
        "content": "Reply with exactly these emoji and nothing else: 🦀🐍🎉👨‍👩‍👧"}],
        "max_tokens": 30, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let r = post(&s.at("/v1/chat/completions"), &body).await.json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{r}");
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    let bytes = logprob_bytes(choice);
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(
        content.contains('\u{200D}'),
        "the test needs a joiner: {content:?}"
    );
    assert!(
        entries.iter().any(|t| t["token"] == "\u{FFFD}"),
        "the test needs a split character: {r}"
    );
    assert_eq!(String::from_utf8(bytes).unwrap(), content);
}
