//! Structured outputs over a real pulled model (Qwen2.5-Coder-0.5B-Instruct): `response_format`
//! `json_schema` / `json_object` on chat and text completions and `text.format` on responses
//! give JSON valid against the schema where the same request without it gives prose; greedy
//! output is the same with speculative drafts (accepted and rejected), streamed or not; seeded
//! sampling is reproduced through speculation. Needs `mtpx pull qwen2.5-coder-0.5b`.

#[path = "fixtures/api/client.rs"]
mod client;
mod common;

use client::*;
use common::pulled_model;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::spec::{SpecConfig, SpecMode};
use serde_json::{json, Value};

fn server() -> TestServer {
    let engine = EngineConfig {
        context_window: Some(2048),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F16,
        // Drafts come from `prediction` (and context n-grams) at a fixed depth.
        speculative: SpecConfig {
            mode: SpecMode::Auto,
            depth: Some(6),
            ..SpecConfig::default()
        },
        ..EngineConfig::default()
    };
    TestServer::start_model(pulled_model("qwen2.5-coder-0.5b"), engine, test_config()).unwrap()
}

fn city_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["city", "country", "population", "landmarks"],
        "additionalProperties": false
    })
}

fn city_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "city", "strict": true, "schema": city_schema()}})
}

/// Panics unless `text` is a JSON object valid against [`city_schema`].
fn check_city(text: &str) -> Value {
    let v: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text:?}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["city", "country", "landmarks", "population"],
        "{text}"
    );
    assert!(o["city"].is_string() && o["country"].is_string(), "{text}");
    let population = o["population"].as_u64().unwrap_or_else(|| panic!("{text}"));
    assert!(population <= 100_000_000, "{text}");
    let landmarks = o["landmarks"].as_array().unwrap();
    assert!(
        landmarks.len() <= 3 && landmarks.iter().all(Value::is_string),
        "{text}"
    );
    v
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Tell me about Paris."}],
        "temperature": 0,
        "max_tokens": 120,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn content(s: &TestServer, body: &Value) -> (String, String) {
    let reply = post(&s.at("/v1/chat/completions"), body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let r = reply.json();
    let choice = &r["choices"][0];
    (
        choice["message"]["content"].as_str().unwrap().to_string(),
        choice["finish_reason"].as_str().unwrap().to_string(),
    )
}

#[actix_rt::test]
async fn a_schema_turns_prose_into_valid_json_on_every_endpoint() {
    let s = server();
    let off = json!({"speculative": false});
    let (prose, _) = content(&s, &chat(off.clone())).await;
    assert!(
        serde_json::from_str::<Value>(&prose).is_err(),
        "the unconstrained reply is already JSON, so this test shows nothing: {prose:?}"
    );
    let mut body = chat(off.clone());
    body["response_format"] = city_format();
    let (text, finish) = content(&s, &body).await;
    assert_eq!(finish, "stop", "{text}");
    let city = check_city(&text);
    assert_eq!(city["city"], "Paris");

    // Any JSON object: the first non-space character opens one.
    let mut body = chat(off);
    body["response_format"] = json!({"type": "json_object"});
    body["max_tokens"] = json!(24);
    let (text, _) = content(&s, &body).await;
    assert!(text.trim_start().starts_with('{'), "{text:?}");

    // Text completions take the same field.
    let reply = post(
        &s.at("/v1/completions"),
        &json!({"prompt": "Facts about Paris, as JSON:\n", "max_tokens": 120, "temperature": 0,
                "response_format": city_format()}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    check_city(reply.json()["choices"][0]["text"].as_str().unwrap());

    // Responses: `text.format`, echoed back in the response object.
    let format = json!({"type": "json_schema", "name": "city", "schema": city_schema()});
    let reply = post(
        &s.at("/v1/responses"),
        &json!({"input": "Tell me about Paris.", "max_output_tokens": 120, "temperature": 0,
                "text": {"format": format}}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let r = reply.json();
    assert_eq!(r["text"]["format"], format);
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap();
    check_city(text);
}

#[actix_rt::test]
async fn speculation_and_streaming_do_not_change_a_constrained_reply() {
    let s = server();
    let mut plain = chat(json!({"speculative": false}));
    plain["response_format"] = city_format();
    let (reference, _) = content(&s, &plain).await;
    check_city(&reference);

    // A prediction that is right at first, then wrong: accepted and rejected drafts, some of
    // them tokens the grammar forbids (the prose of the unconstrained reply).
    let half = &reference[..reference.len() / 2];
    for prediction in [
        reference.clone(),
        format!("{half} Paris is a city in France."),
    ] {
        let mut body = plain.clone();
        body["speculative"] = json!(true);
        body["prediction"] = json!({"type": "content", "content": prediction});
        let r = post(&s.at("/v1/chat/completions"), &body).await.json();
        assert_eq!(r["choices"][0]["message"]["content"], reference.as_str());
        let accepted = r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
            .as_u64()
            .unwrap();
        assert!(accepted > 0, "no draft was accepted: {r}");
    }

    // Streamed: the deltas join into the same document.
    let mut body = plain.clone();
    body["stream"] = json!(true);
    let reply = post(&s.at("/v1/chat/completions"), &body).await;
    let streamed: String = reply
        .events()
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, reference);

    // Seeded sampling is coupled to plain sampling, so drafts cannot change it; unseeded
    // sampling verifies by rejection sampling, where a forbidden draft must be rejected.
    let mut sampled = plain.clone();
    sampled["temperature"] = json!(0.8);
    sampled["seed"] = json!(11);
    let (alone, _) = content(&s, &sampled).await;
    check_city(&alone);
    sampled["speculative"] = json!(true);
    sampled["prediction"] = json!({"type": "content", "content": format!("{half} Paris!")});
    let (drafted, _) = content(&s, &sampled).await;
    assert_eq!(drafted, alone);
    sampled.as_object_mut().unwrap().remove("seed");
    for _ in 0..3 {
        let (text, finish) = content(&s, &sampled).await;
        if finish == "stop" {
            check_city(&text);
        }
    }
}

#[actix_rt::test]
async fn formats_that_cannot_be_enforced_are_refused_before_inference() {
    let s = server();
    let bad_schema = json!({"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "objekt"}}});
    let reply = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"response_format": bad_schema})),
    )
    .await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "response_format");
    assert!(
        reply.error()["message"]
            .as_str()
            .unwrap()
            .contains("objekt"),
        "{}",
        reply.text()
    );

    let reply = post(
        &s.at("/v1/responses"),
        &json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
            "schema": {"type": "objekt"}}}}),
    )
    .await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "text.format");

    // A forced tool call is not JSON of the format's schema: refused, not silently ignored.
    let tools = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {}}}}]);
    let reply = post(
        &s.at("/v1/chat/completions"),
        &chat(json!({"tools": tools, "tool_choice": "required",
            "response_format": {"type": "json_object"}})),
    )
    .await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "response_format");

    // The server still serves.
    let (text, _) = content(&s, &chat(json!({"max_tokens": 4}))).await;
    assert!(!text.is_empty());
}

fn smollm2() -> TestServer {
    let path = pulled_model("smollm2-135m");
    let engine = EngineConfig {
        context_window: Some(2048),
        kv_memory: KvMemory::Bytes(128 << 20),
        kv_dtype: KvDtype::F16,
        ..EngineConfig::default()
    };
    TestServer::start_model(path, engine, test_config()).unwrap()
}

#[actix_rt::test]
async fn a_forced_tool_choice_is_a_valid_call_even_from_a_model_never_trained_on_tools() {
    // SmolLM2-135M, forced by the prompt alone, wrote `<tool_call>` markup and prose into
    // `content` with no `tool_calls`. Under the grammar it can only write a call of a
    // declared tool whose arguments match the tool's schema.
    let s = smollm2();
    let parameters = json!({"type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather of a city", "parameters": parameters}}]);
    let check_args = |args: &str| {
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args:?}"));
        assert!(v["city"].is_string(), "{v}");
        assert!(v["unit"] == "c" || v["unit"] == "f", "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    };
    for tool_choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let body = chat(json!({
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
            "tools": tools, "tool_choice": tool_choice, "max_tokens": 100,
            // Allowed more, this model repeats the same call until `max_tokens`.
            "parallel_tool_calls": false}));
        let r = post(&s.at("/v1/chat/completions"), &body).await.json();
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
        assert!(choice["message"]["content"].is_null(), "{r}");
        let call = &choice["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather");
        check_args(call["arguments"].as_str().unwrap());
    }
    let r = post(
        &s.at("/v1/responses"),
        &json!({"input": "What is the weather like in Paris?", "temperature": 0,
            "max_output_tokens": 100, "tool_choice": "required", "parallel_tool_calls": false,
            "tools": [{"type": "function", "name": "get_weather", "parameters": parameters}]}),
    )
    .await
    .json();
    let item = &r["output"][0];
    assert_eq!(item["type"], "function_call", "{r}");
    assert_eq!(item["name"], "get_weather");
    check_args(item["arguments"].as_str().unwrap());
}

#[actix_rt::test]
async fn vllm_guided_fields_constrain_the_reply() {
    let s = server();
    let ask = |content: &str, extra: Value| {
        let mut body = chat(extra);
        body["messages"] = json!([{"role": "user", "content": content}]);
        body
    };
    let choices = json!(["positive", "negative", "neutral"]);
    let (text, finish) = content(
        &s,
        &ask(
            "Is this review positive or negative? 'Terrible food, rude staff.'",
            json!({"guided_choice": choices}),
        ),
    )
    .await;
    assert_eq!((text.as_str(), finish.as_str()), ("negative", "stop"));

    let (text, _) = content(
        &s,
        &ask(
            "Make up a US phone number.",
            json!({"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        ),
    )
    .await;
    let digits: Vec<char> = text.chars().filter(char::is_ascii_digit).collect();
    assert_eq!(digits.len(), 10, "{text:?}");
    assert_eq!(text.len(), 14, "{text:?}");
    assert!(
        text.starts_with('(') && text[5..6] == *" " && text[9..10] == *"-",
        "{text:?}"
    );

    let (text, _) = content(
        &s,
        &ask(
            "Tell me about Paris.",
            json!({"guided_json": city_schema()}),
        ),
    )
    .await;
    check_city(&text);

    // One constraint at a time; a bad one is named.
    let both = ask("x", json!({"guided_choice": ["a"], "guided_regex": "a"}));
    let reply = post(&s.at("/v1/chat/completions"), &both).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    let bad = ask("x", json!({"guided_regex": "(unclosed"}));
    let reply = post(&s.at("/v1/chat/completions"), &bad).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(reply.error()["param"], "guided_regex");
    let bad = ask("x", json!({"guided_json": {"type": "objekt"}}));
    let reply = post(&s.at("/v1/chat/completions"), &bad).await;
    assert_eq!(reply.error()["param"], "guided_json", "{}", reply.text());
}

/// vLLM's example grammar (`guided_grammar` with xgrammar), in GBNF.
const SQL_GBNF: &str = r#"
root ::= select-statement
# a comment, as grammar files have
select-statement ::= "SELECT " column (", " column)* " FROM " table ";"
column ::= [a-z_]{1,20}
table  ::= [a-z_]{1,20}
"#;

/// Panics unless `text` is `SELECT a, b FROM t;` with lowercase identifiers.
fn check_sql(text: &str) {
    let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_');
    let body = text
        .strip_prefix("SELECT ")
        .and_then(|t| t.strip_suffix(';'))
        .unwrap_or_else(|| panic!("{text:?}"));
    let (columns, table) = body
        .split_once(" FROM ")
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(columns.split(", ").all(ident) && ident(table), "{text:?}");
}

#[actix_rt::test]
async fn grammars_constrain_the_reply_and_ignore_eos_runs_to_max_tokens() {
    let s = server();
    let ask = |extra: Value| {
        let mut body = chat(extra);
        body["messages"] = json!([{"role": "user", "content": "Write a SQL query for the names and emails of all users."}]);
        body
    };
    // Unconstrained, the model answers in prose and markdown.
    let (prose, _) = content(&s, &ask(json!({}))).await;
    assert!(!prose.starts_with("SELECT "), "{prose:?}");

    // GBNF (vLLM's `guided_grammar`, llama.cpp's `grammar` on its OpenAI routes) and the same
    // grammar in Lark all give a bare query that the grammar ends.
    let lark = "start: \"SELECT \" column (\", \" column)* \" FROM \" table \";\"\n\
                column: /[a-z_]{1,20}/\ntable: /[a-z_]{1,20}/";
    let mut replies = Vec::new();
    for extra in [
        json!({"guided_grammar": SQL_GBNF}),
        json!({"grammar": SQL_GBNF}),
        json!({"guided_grammar": lark}),
    ] {
        let (text, finish) = content(&s, &ask(extra.clone())).await;
        check_sql(&text);
        assert_eq!(finish, "stop", "{extra}: {text:?}");
        replies.push(text);
    }
    assert_eq!(replies[0], replies[1]);
    assert!(replies[0].contains("email"), "{replies:?}");

    // llama.cpp's `/completion` with a GBNF list grammar.
    let list = "root ::= item{3}\nitem ::= \"- \" [A-Z] [a-z]{1,15} \"\\n\"";
    let reply = post(
        &s.at("/completion"),
        &json!({"prompt": "Three fruits, one per line:\n", "grammar": list,
                "n_predict": 40, "temperature": 0}),
    )
    .await
    .json();
    let text = reply["content"].as_str().unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{reply}");
    for line in lines {
        let word = line
            .strip_prefix("- ")
            .unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            word.chars().next().unwrap().is_ascii_uppercase(),
            "{text:?}"
        );
        assert!(
            word[1..].chars().all(|c| c.is_ascii_lowercase()),
            "{text:?}"
        );
    }
    assert_eq!(reply["stop_type"], "eos", "{reply}");

    // `ignore_eos`: the greedy reply goes on past where it ended, to `max_tokens`.
    let say_hi = |extra: Value| {
        let mut body = chat(extra);
        body["messages"] = json!([{"role": "user", "content": "Say hi."}]);
        body["max_tokens"] = json!(48);
        body
    };
    let short = post(&s.at("/v1/chat/completions"), &say_hi(json!({})))
        .await
        .json();
    let long = post(
        &s.at("/v1/chat/completions"),
        &say_hi(json!({"ignore_eos": true})),
    )
    .await
    .json();
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    assert!(
        short["usage"]["completion_tokens"].as_u64().unwrap() < 48,
        "{short}"
    );
    assert_eq!(long["choices"][0]["finish_reason"], "length", "{long}");
    assert_eq!(long["usage"]["completion_tokens"], 48, "{long}");
    let short_text = short["choices"][0]["message"]["content"].as_str().unwrap();
    let long_text = long["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        long_text.starts_with(short_text) && long_text.len() > short_text.len(),
        "{short_text:?} / {long_text:?}"
    );

    // Errors name the field (and for GBNF, the line); a grammar and a schema are refused
    // together; the server still serves.
    let bad = post(
        &s.at("/v1/chat/completions"),
        &ask(json!({"guided_grammar": "root ::= item\n\nitem ::= [a-z"})),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert_eq!(bad.error()["param"], "guided_grammar");
    let message = bad.error()["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("line 3") && message.contains("character class"),
        "{message}"
    );
    let bad = post(
        &s.at("/v1/chat/completions"),
        &ask(json!({"guided_grammar": "start: undefined_rule"})),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert_eq!(bad.error()["param"], "guided_grammar", "{}", bad.text());
    let bad = post(
        &s.at("/completion"),
        &json!({"prompt": "x", "grammar": "value ::= \"a\""}),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert_eq!(bad.error()["param"], "grammar");
    assert!(bad.text().contains("root"), "{}", bad.text());
    let both = ask(json!({"grammar": SQL_GBNF, "guided_json": {"type": "object"}}));
    let reply = post(&s.at("/v1/chat/completions"), &both).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    let (text, _) = content(&s, &ask(json!({"max_tokens": 4}))).await;
    assert!(!text.is_empty());
}
