//! Ollama requests → the OpenAI request objects the rest of the API layer already validates
//! and plans. Translating the JSON (instead of a second path to the engine) keeps one set of
//! rules for prompts, tools, sampling and structured outputs; only the field names differ.

use super::super::errors::ApiError;
use serde_json::{json, Map, Value};

/// Ollama's own defaults where a request leaves a sampling option out (its `DefaultOptions`):
/// clients written against Ollama expect them, not OpenAI's `temperature: 1`.
const DEFAULT_TEMPERATURE: f64 = 0.8;
const DEFAULT_TOP_K: i64 = 40;
const DEFAULT_TOP_P: f64 = 0.9;

/// `options` fields and the OpenAI fields they become. Options mtpx cannot honour in a
/// meaningful way (`num_ctx`, `num_thread`, `num_gpu`, `mirostat`, ...) are ignored, as Ollama
/// ignores options a model does not use; `num_ctx` cannot raise the enforced window.
const NUMERIC_OPTIONS: [(&str, &str); 8] = [
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("repeat_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
];

/// `POST /api/chat`'s body as a `/v1/chat/completions` body.
pub fn chat(body: &Value) -> Result<Value, ApiError> {
    let mut out = common(body)?;
    let messages = match body.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(messages)) => messages
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("messages"),
                "`messages` must be an array",
            ))
        }
    };
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        out.insert("tools".into(), tools.clone());
    }
    Ok(Value::Object(out))
}

/// The fields `/api/chat` and `/api/generate` share: options and format (the model is
/// checked by the handler: Ollama names carry a `:tag`).
pub fn common(body: &Value) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    let options = match body.get("options") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("options"),
                "`options` must be an object",
            ))
        }
    };
    for (option, field) in NUMERIC_OPTIONS {
        if let Some(v) = options.get(option).filter(|v| !v.is_null()) {
            if !v.is_number() {
                return Err(ApiError::invalid(
                    Some(&format!("options.{option}")),
                    format!("`options.{option}` must be a number, got `{v}`"),
                ));
            }
            out.insert(field.into(), v.clone());
        }
    }
    out.entry("temperature")
        .or_insert(json!(DEFAULT_TEMPERATURE));
    out.entry("top_k").or_insert(json!(DEFAULT_TOP_K));
    out.entry("top_p").or_insert(json!(DEFAULT_TOP_P));
    match options.get("num_predict") {
        None | Some(Value::Null) => {}
        // -1 (the default) is "until the model stops", -2 "until the context is full": both
        // are "up to the window" here.
        Some(v) if v.as_i64().is_some_and(|n| n <= 0) => {}
        Some(v) if v.as_u64().is_some() => {
            out.insert("max_tokens".into(), v.clone());
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("options.num_predict"),
                format!("`options.num_predict` must be an integer, got `{v}`"),
            ))
        }
    }
    match options.get("stop") {
        None | Some(Value::Null) => {}
        Some(stop @ Value::String(_)) => {
            out.insert("stop".into(), json!([stop]));
        }
        Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
            out.insert("stop".into(), Value::Array(stops.clone()));
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("options.stop"),
                format!("`options.stop` must be an array of strings, got `{v}`"),
            ))
        }
    }
    if let Some(format) = response_format(body.get("format"))? {
        out.insert("response_format".into(), format);
    }
    Ok(out)
}

/// `format`: `"json"` or a JSON Schema object → `response_format`.
fn response_format(format: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(json!({"type": "json_object"}))),
        Some(schema @ Value::Object(_)) => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": schema},
        }))),
        Some(other) => Err(ApiError::invalid(
            Some("format"),
            format!("`format` must be \"json\" or a JSON Schema object, got `{other}`"),
        )),
    }
}

/// One Ollama message as an OpenAI one: `thinking` is the reasoning, `tool_name` the tool's
/// name, and tool calls get ids (Ollama's carry none).
fn message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let field = |name: &str| format!("messages[{i}].{name}");
    let Some(m) = m.as_object() else {
        return Err(ApiError::invalid(
            Some(&format!("messages[{i}]")),
            "each message must be an object",
        ));
    };
    if m.get("images")
        .and_then(Value::as_array)
        .is_some_and(|images| !images.is_empty())
    {
        return Err(ApiError::invalid(
            Some(&field("images")),
            "the served model reads text only: `images` cannot be used",
        ));
    }
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(Some(&field("role")), "each message needs a string `role`")
    })?;
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    let content = match m.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                Some(&field("content")),
                format!("`content` must be a string, got `{v}`"),
            ))
        }
    };
    out.insert("content".into(), json!(content));
    if let Some(thinking) = m.get("thinking").and_then(Value::as_str) {
        out.insert("reasoning_content".into(), json!(thinking));
    }
    if let Some(name) = m.get("tool_name").and_then(Value::as_str) {
        out.insert("name".into(), json!(name));
    }
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        let calls = calls.as_array().ok_or_else(|| {
            ApiError::invalid(Some(&field("tool_calls")), "`tool_calls` must be an array")
        })?;
        let calls = calls
            .iter()
            .enumerate()
            .map(|(j, call)| {
                let function = call
                    .get("function")
                    .filter(|f| f.is_object())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            Some(&field(&format!("tool_calls[{j}].function"))),
                            "each tool call needs a `function` object with `name` and `arguments`",
                        )
                    })?;
                Ok(json!({
                    "id": format!("call_{i}_{j}"),
                    "type": "function",
                    "function": {
                        "name": function.get("name").cloned().unwrap_or(json!("")),
                        "arguments": function.get("arguments").cloned().unwrap_or(json!({})),
                    },
                }))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_openai_fields_and_ollama_defaults_fill_the_rest() {
        let body = json!({
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0, "num_predict": 7, "repeat_penalty": 1.2,
                        "stop": ["\n"], "num_ctx": 999999, "seed": 3},
            "format": "json",
        });
        let out = chat(&body).unwrap();
        assert_eq!(out["temperature"], json!(0));
        assert_eq!(out["max_tokens"], json!(7));
        assert_eq!(out["repetition_penalty"], json!(1.2));
        assert_eq!(out["stop"], json!(["\n"]));
        assert_eq!(out["seed"], json!(3));
        assert_eq!(out["top_k"], json!(40));
        assert_eq!(out["top_p"], json!(0.9));
        assert_eq!(out["response_format"], json!({"type": "json_object"}));
        assert!(out.get("num_ctx").is_none());
        let unlimited = chat(&json!({"options": {"num_predict": -1}})).unwrap();
        assert!(unlimited.get("max_tokens").is_none());
        assert_eq!(unlimited["temperature"], json!(0.8));
    }

    #[test]
    fn messages_carry_thinking_tool_names_and_calls_with_ids() {
        let body = json!({"messages": [
            {"role": "assistant", "content": "", "thinking": "hmm",
             "tool_calls": [{"function": {"name": "read", "arguments": {"path": "a"}}}]},
            {"role": "tool", "content": "text of a", "tool_name": "read"},
        ]});
        let out = chat(&body).unwrap();
        let m = &out["messages"];
        assert_eq!(m[0]["reasoning_content"], json!("hmm"));
        assert_eq!(m[0]["tool_calls"][0]["id"], json!("call_0_0"));
        assert_eq!(
            m[0]["tool_calls"][0]["function"]["arguments"],
            json!({"path": "a"})
        );
        assert_eq!(m[1]["name"], json!("read"));
    }

    #[test]
    fn refusals_name_the_ollama_field() {
        let param = |body: Value| chat(&body).unwrap_err().param.clone();
        assert_eq!(
            param(json!({"options": {"temperature": "hot"}})).as_deref(),
            Some("options.temperature")
        );
        assert_eq!(
            param(json!({"options": {"num_predict": 1.5}})).as_deref(),
            Some("options.num_predict")
        );
        assert_eq!(param(json!({"format": "yaml"})).as_deref(), Some("format"));
        assert_eq!(
            param(json!({"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}))
                .as_deref(),
            Some("messages[0].images")
        );
    }
}
