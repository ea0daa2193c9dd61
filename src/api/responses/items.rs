//! Responses input items and tools → the chat messages and tools the model's chat template is
//! given. The rendered conversation is a pure function of the stored items, so a continuation
//! renders the same prefix and the session reuses its KV.
//!
//! - a string input is one user message; a `message` item (or an item with just `role` and
//!   `content`) is a message, `developer` becoming `system`;
//! - a `function_call` item is a tool call of an assistant message (consecutive calls, or a call
//!   right after an assistant message, join that message);
//! - a `function_call_output` item is a `tool` message;
//! - `reasoning` items are skipped; other item types are refused naming their index.

use super::super::errors::ApiError;
use super::tools::ToolNamespaces;
use super::types::Input;
use serde_json::{json, Value};

/// The chat messages of a request's `input`, appended to `messages`; a call of a namespace's
/// function gets the name the model is offered for it (`namespaces`).
pub fn append_input(
    messages: &mut Vec<Value>,
    input: &Input,
    namespaces: &ToolNamespaces,
) -> Result<(), ApiError> {
    match input {
        Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
        Input::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                append_item(messages, i, item, namespaces)?;
            }
        }
    }
    Ok(())
}

/// A request's `input` as the items `GET /v1/responses/{id}/input_items` lists: a string
/// becomes a user `message` item; every item gets an `id` (generated when the client sent
/// none) and a `type` (`message` for a bare `role` + `content`); a message's string `content`
/// becomes one text part (`input_text`, or `output_text` for the assistant), as OpenAI lists
/// them. Validation is [`append_input`]'s: this runs on input it accepted.
pub fn listed_items(input: &Input) -> Vec<Value> {
    let items = match input {
        Input::Text(text) => vec![json!({"role": "user", "content": text})],
        Input::Items(items) => items.clone(),
    };
    items.into_iter().map(listed_item).collect()
}

fn listed_item(mut item: Value) -> Value {
    let Some(fields) = item.as_object_mut() else {
        return item;
    };
    if !fields.contains_key("type") && fields.contains_key("role") {
        fields.insert("type".into(), json!("message"));
    }
    let kind = fields.get("type").and_then(Value::as_str).unwrap_or("");
    let prefix = match kind {
        "message" => "msg",
        "function_call" => "fc",
        "function_call_output" => "fco",
        "reasoning" => "rs",
        _ => "item",
    };
    if kind == "message" {
        if let Some(Value::String(text)) = fields.get("content") {
            let part = if fields.get("role").and_then(Value::as_str) == Some("assistant") {
                "output_text"
            } else {
                "input_text"
            };
            let parts = json!([{"type": part, "text": text}]);
            fields.insert("content".into(), parts);
        }
    }
    if !fields.get("id").is_some_and(Value::is_string) {
        fields.insert("id".into(), json!(super::builder::new_item_id(prefix)));
    }
    item
}

fn append_item(
    messages: &mut Vec<Value>,
    i: usize,
    item: &Value,
    namespaces: &ToolNamespaces,
) -> Result<(), ApiError> {
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or(if item.get("role").is_some() {
            "message"
        } else {
            ""
        });
    match kind {
        "message" => messages.push(message(i, item)?),
        "function_call" => {
            let namespace = item.get("namespace").and_then(Value::as_str);
            let name = namespaces.offered(namespace, &str_field(i, item, "name")?);
            let call = json!({
                "id": str_field(i, item, "call_id")?,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments_value(item.get("arguments")),
                },
            });
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" => {
                    let calls = last
                        .as_object_mut()
                        .expect("messages are objects")
                        .entry("tool_calls")
                        .or_insert_with(|| json!([]));
                    if let Some(calls) = calls.as_array_mut() {
                        calls.push(call);
                    }
                }
                _ => {
                    messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                }
            }
        }
        "function_call_output" => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => text_of_parts(i, parts)?,
                _ => return Err(field_error(i, "output", "a string")),
            };
            let call_id = str_field(i, item, "call_id")?;
            // As OpenAI answers: an output must answer a call made earlier in the conversation
            // (this input, or the chain `previous_response_id` continues).
            let called = messages.iter().any(|m| {
                m["tool_calls"]
                    .as_array()
                    .is_some_and(|calls| calls.iter().any(|c| c["id"] == call_id.as_str()))
            });
            if !called {
                return Err(ApiError::invalid(
                    Some(&format!("input[{i}].call_id")),
                    format!("No tool call found for function call output with call_id {call_id}."),
                ));
            }
            messages.push(json!({
                "role": "tool",
                "tool_call_id": call_id,
                "content": output,
            }));
        }
        "reasoning" => {}
        other => {
            return Err(ApiError::invalid(
                Some(&format!("input[{i}].type")),
                format!(
                    "input items must be `message`, `function_call`, `function_call_output` or \
                     `reasoning`, got `{other}`"
                ),
            )
            .with_code("unsupported_input_item"))
        }
    }
    Ok(())
}

fn message(i: usize, item: &Value) -> Result<Value, ApiError> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some("developer" | "system") => "system",
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(field_error(
                i,
                "role",
                "one of `user`, `assistant`, `system`, `developer`",
            ))
        }
    };
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_of_parts(i, parts)?,
        None | Some(Value::Null) => String::new(),
        Some(_) => return Err(field_error(i, "content", "a string or text parts")),
    };
    Ok(json!({"role": role, "content": content}))
}

fn text_of_parts(i: usize, parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        match (kind, part.get("text").and_then(Value::as_str)) {
            ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
            _ => {
                return Err(ApiError::invalid(
                    Some(&format!("input[{i}].content[{j}].type")),
                    format!("only text content parts are supported, got `{kind}`"),
                ))
            }
        }
    }
    Ok(text)
}

fn str_field(i: usize, item: &Value, name: &str) -> Result<String, ApiError> {
    item.get(name)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| field_error(i, name, "a string"))
}

fn field_error(i: usize, name: &str, what: &str) -> ApiError {
    ApiError::invalid(
        Some(&format!("input[{i}].{name}")),
        format!("`input[{i}].{name}` must be {what}"),
    )
}

/// A tool call's arguments for the template: the object when the string parses as one
/// (templates apply `tojson`), else the string.
pub fn arguments_value(args: Option<&Value>) -> Value {
    match args {
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => Value::String(s.clone()),
        },
        Some(v) => v.clone(),
        None => json!({}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_messages() {
        let input: Input = serde_json::from_value(json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{\"path\": \"a\"}"},
            {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "A"},
            {"type": "reasoning", "summary": []},
        ]))
        .unwrap();
        let mut m = Vec::new();
        append_input(&mut m, &input, &ToolNamespaces::default()).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1]["content"], "hi");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"path": "a"})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "A"})
        );
    }

    #[test]
    fn bad_items_name_their_field() {
        let mut m = Vec::new();
        let bad = Input::Items(vec![json!({"type": "item_reference", "id": "x"})]);
        let e = append_input(&mut m, &bad, &ToolNamespaces::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
        let bad = Input::Items(vec![json!({"type": "function_call_output", "output": "x"})]);
        let e = append_input(&mut m, &bad, &ToolNamespaces::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].call_id"));
        // An output for a call nobody made.
        let stray = Input::Items(vec![
            json!({"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "c9", "output": "x"}),
        ]);
        let e = append_input(&mut Vec::new(), &stray, &ToolNamespaces::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[1].call_id"));
        assert!(e.message.contains("c9"), "{}", e.message);
        // One answering a call the earlier turns made (the `previous_response_id` chain).
        let mut earlier = vec![json!({"role": "assistant", "content": "",
            "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "read", "arguments": {}}}]})];
        let answer = Input::Items(vec![
            json!({"type": "function_call_output", "call_id": "c9", "output": "x"}),
        ]);
        append_input(&mut earlier, &answer, &ToolNamespaces::default()).unwrap();
        assert_eq!(earlier[1]["tool_call_id"], "c9");
    }
}
