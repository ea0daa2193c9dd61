//! Anthropic Messages requests → `/v1/chat/completions` bodies, translated as JSON (as Ollama's
//! are, see `ollama::request`) so that prompts, tools, sampling and admission follow one set
//! of rules. Content blocks map onto OpenAI messages: `text` is content, `tool_use` an
//! assistant tool call, `tool_result` a `tool` message, `thinking` the assistant's
//! `reasoning_content`. A final assistant message is a prefill: the reply continues it.

use super::super::errors::ApiError;
use serde_json::{json, Map, Value};

/// A Messages request as a chat body, and the text of a final assistant message.
pub struct Translated {
    pub chat: Value,
    pub prefill: Option<String>,
}

/// `POST /v1/messages`'s body (`count_tokens`: `max_tokens` not required).
pub fn chat(body: &Value, count_only: bool) -> Result<Translated, ApiError> {
    let mut out = Map::new();
    match body.get("max_tokens") {
        Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {
            out.insert("max_tokens".into(), v.clone());
        }
        None | Some(Value::Null) if count_only => {}
        None | Some(Value::Null) => return Err(invalid("max_tokens", "`max_tokens` is required")),
        Some(v) => {
            return Err(invalid(
                "max_tokens",
                format!("`max_tokens` must be a positive integer, got `{v}`"),
            ))
        }
    }
    for field in ["temperature", "top_p", "top_k"] {
        if let Some(v) = body.get(field).filter(|v| !v.is_null()) {
            out.insert(field.into(), v.clone());
        }
    }
    match body.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
            out.insert("stop".into(), Value::Array(stops.clone()));
        }
        Some(v) => {
            return Err(invalid(
                "stop_sequences",
                format!("`stop_sequences` must be an array of strings, got `{v}`"),
            ))
        }
    }
    output_format(body, &mut out)?;
    let mut messages = Vec::new();
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let list = match body.get("messages") {
        Some(Value::Array(list)) => list,
        _ => return Err(invalid("messages", "`messages` must be an array")),
    };
    let mut prefill = None;
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").unwrap_or(&Value::Null);
        match role {
            Some("user") => user_message(i, content, &mut messages)?,
            Some("assistant") if i + 1 == list.len() && has_tool_use(content) => {
                return Err(invalid(
                    &format!("messages[{i}].content"),
                    "the last message is an assistant `tool_use`: send its `tool_result` in a \
                     user message",
                ))
            }
            Some("assistant") if i + 1 == list.len() => {
                let text = assistant_text(i, content)?;
                if text != text.trim_end() {
                    return Err(invalid(
                        &format!("messages[{i}].content"),
                        "final assistant content cannot end with trailing whitespace",
                    ));
                }
                prefill = Some(text).filter(|t| !t.is_empty());
            }
            Some("assistant") => messages.push(assistant_message(i, content)?),
            // Claude Code puts system reminders between the turns.
            Some("system") => {
                let text = text_of(content, &format!("messages[{i}].content"))?;
                messages.push(json!({"role": "system", "content": text}));
            }
            _ => {
                return Err(invalid(
                    &format!("messages[{i}].role"),
                    "`role` must be `user`, `assistant` or `system`",
                ))
            }
        }
    }
    if !list.is_empty() && !messages.iter().any(|m| m["role"] != "system") {
        return Err(invalid(
            "messages",
            "`messages` needs a `user` message: a final `assistant` message only continues the \
             reply to one",
        ));
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        out.insert("tools".into(), self::tools(tools)?);
    }
    if let Some(choice) = body.get("tool_choice").filter(|t| !t.is_null()) {
        tool_choice(choice, &mut out)?;
    }
    Ok(Translated {
        chat: Value::Object(out),
        prefill,
    })
}

/// Structured outputs: `output_config.format` (or the beta's top-level `output_format`),
/// `{"type": "json_schema", "schema": {...}}`, as `response_format`.
fn output_format(body: &Value, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    let (format, path) = match body.get("output_config").and_then(|c| c.get("format")) {
        Some(f) if !f.is_null() => (f, "output_config.format"),
        _ => match body.get("output_format") {
            Some(f) if !f.is_null() => (f, "output_format"),
            _ => return Ok(()),
        },
    };
    match (
        format.get("type").and_then(Value::as_str),
        format.get("schema"),
    ) {
        (Some("json_schema"), Some(schema)) if schema.is_object() => {
            out.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
            );
            Ok(())
        }
        _ => Err(invalid(
            path,
            format!("`{path}` must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}"),
        )),
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param), message)
}

/// A string, or an array of `text` blocks, as one string (`system`, `tool_result` content).
fn text_of(value: &Value, path: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.iter().enumerate() {
                match block_type(block) {
                    "text" => push_block(&mut text, block_text(block, &format!("{path}[{j}]"))?),
                    other => return Err(unsupported_block(&format!("{path}[{j}]"), other)),
                }
            }
            Ok(text)
        }
        other => Err(invalid(
            path,
            format!("`{path}` must be a string or an array of text blocks, got `{other}`"),
        )),
    }
}

/// Text blocks of one turn, a line apart (Claude Code sends a `<system-reminder>` block and
/// the request as two).
fn push_block(text: &mut String, block: &str) {
    if !text.is_empty() && !block.is_empty() {
        text.push('\n');
    }
    text.push_str(block);
}

fn block_type(block: &Value) -> &str {
    block.get("type").and_then(Value::as_str).unwrap_or("")
}

fn block_text<'a>(block: &'a Value, path: &str) -> Result<&'a str, ApiError> {
    block
        .get("text")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(path, format!("`{path}` needs a `text` string")))
}

fn unsupported_block(path: &str, kind: &str) -> ApiError {
    let why = match kind {
        "image" | "document" => "the served model reads text only".to_string(),
        "" => "a content block needs a `type`".to_string(),
        other => format!("`{other}` blocks are not supported here"),
    };
    invalid(&format!("{path}.type"), format!("`{path}`: {why}"))
}

fn blocks(content: &Value) -> Vec<Value> {
    match content {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(blocks) => blocks.clone(),
        _ => Vec::new(),
    }
}

fn has_tool_use(content: &Value) -> bool {
    blocks(content).iter().any(|b| block_type(b) == "tool_use")
}

/// A user turn: its `tool_result` blocks become `tool` messages and its text a user message,
/// in the order they come.
fn user_message(i: usize, content: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    if !(content.is_string() || content.is_array()) {
        return Err(invalid(
            &format!("messages[{i}].content"),
            "`content` must be a string or an array of content blocks",
        ));
    }
    let before = out.len();
    let mut text = String::new();
    let flush = |text: &mut String, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": std::mem::take(text)}));
        }
    };
    for (j, block) in blocks(content).iter().enumerate() {
        let path = format!("messages[{i}].content[{j}]");
        match block_type(block) {
            "text" => push_block(&mut text, block_text(block, &path)?),
            "tool_result" => {
                flush(&mut text, out);
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        invalid(&path, format!("`{path}` needs a `tool_use_id` string"))
                    })?;
                let mut result = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{path}.content"))?,
                };
                if block.get("is_error") == Some(&Value::Bool(true)) {
                    result = format!("Error: {result}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            other => return Err(unsupported_block(&path, other)),
        }
    }
    flush(&mut text, out);
    if out.len() == before {
        return Err(invalid(
            &format!("messages[{i}].content"),
            "user messages must have non-empty content",
        ));
    }
    Ok(())
}

/// The text of an assistant turn (a prefill has text blocks only).
fn assistant_text(i: usize, content: &Value) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, block) in blocks(content).iter().enumerate() {
        let path = format!("messages[{i}].content[{j}]");
        match block_type(block) {
            "text" => text.push_str(block_text(block, &path)?),
            "thinking" | "redacted_thinking" => {}
            other => return Err(unsupported_block(&path, other)),
        }
    }
    Ok(text)
}

fn assistant_message(i: usize, content: &Value) -> Result<Value, ApiError> {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, block) in blocks(content).iter().enumerate() {
        let path = format!("messages[{i}].content[{j}]");
        match block_type(block) {
            "text" => text.push_str(block_text(block, &path)?),
            "thinking" => {
                reasoning.push_str(block.get("thinking").and_then(Value::as_str).unwrap_or(""))
            }
            "redacted_thinking" => {}
            "tool_use" => {
                let field = |name: &str| block.get(name).filter(|v| !v.is_null());
                let (Some(Value::String(id)), Some(Value::String(name))) =
                    (field("id"), field("name"))
                else {
                    return Err(invalid(
                        &path,
                        format!("`{path}` needs `id` and `name` strings"),
                    ));
                };
                let input = field("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            other => return Err(unsupported_block(&path, other)),
        }
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    Ok(message)
}

/// `tools`: client tools (`input_schema`) as OpenAI function tools; Anthropic's server tools
/// (web search, code execution, ...) run on Anthropic's side and are refused.
fn tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| invalid("tools", "`tools` must be an array"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("tools[{i}].type"),
                    format!("`{other}` is a tool Anthropic runs; only client tools (with `input_schema`) are supported"),
                ))
            }
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(invalid(
                &format!("tools[{i}].name"),
                "a tool needs a `name`",
            ));
        };
        let mut function = json!({"name": name});
        if let Some(d) = tool.get("description").filter(|d| !d.is_null()) {
            function["description"] = d.clone();
        }
        if let Some(schema) = tool.get("input_schema").filter(|s| !s.is_null()) {
            function["parameters"] = schema.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice`: `auto`, `any` (some tool), `tool` (that one), `none`; and
/// `disable_parallel_tool_use`.
fn tool_choice(choice: &Value, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    let openai = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match choice.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                return Err(invalid(
                    "tool_choice.name",
                    "`tool_choice` `tool` needs a `name`",
                ))
            }
        },
        _ => {
            return Err(invalid(
                "tool_choice.type",
                "`tool_choice.type` must be `auto`, `any`, `tool` or `none`",
            ))
        }
    };
    out.insert("tool_choice".into(), openai);
    if choice.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) {
        out.insert("parallel_tool_calls".into(), json!(false));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_become_openai_messages() {
        let body = json!({
            "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0.2,
            "tools": [{"name": "get_weather", "description": "Weather",
                       "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
                {"role": "assistant", "content": "Tomorrow it will be"},
            ],
        });
        let t = chat(&body, false).unwrap();
        assert_eq!(t.prefill.as_deref(), Some("Tomorrow it will be"));
        let c = &t.chat;
        assert_eq!(c["max_tokens"], 64);
        assert_eq!(c["stop"], json!(["END"]));
        assert_eq!(c["tool_choice"], "required");
        assert_eq!(c["parallel_tool_calls"], false);
        assert_eq!(
            c["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        let m = c["messages"].as_array().unwrap();
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["reasoning_content"], "Use the tool.");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "And tomorrow?"}));
    }

    #[test]
    fn system_messages_between_turns_stay_in_place() {
        let body = json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": "b"}]});
        let m = chat(&body, false).unwrap().chat["messages"].clone();
        assert_eq!(m[1], json!({"role": "system", "content": "reminder"}));
        assert_eq!(m.as_array().unwrap().len(), 3);
    }

    #[test]
    fn text_blocks_of_a_turn_are_a_line_apart() {
        let body = json!({"max_tokens": 8, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                {"type": "text", "text": "fix it"}]}]});
        let m = chat(&body, false).unwrap().chat["messages"].clone();
        assert_eq!(m[0]["content"], "a\nb");
        assert_eq!(
            m[1]["content"],
            "<system-reminder>r</system-reminder>\nfix it"
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let param = |body: Value| chat(&body, false).err().unwrap().param.clone().unwrap();
        let msgs = json!([{"role": "user", "content": "x"}]);
        assert_eq!(param(json!({"messages": msgs})), "max_tokens");
        assert!(
            chat(&json!({"messages": msgs}), true).is_ok(),
            "count_tokens needs none"
        );
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert_eq!(
            param(json!({"max_tokens": 1, "messages": image})),
            "messages[0].content[0].type"
        );
        let trailing =
            json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a "}]);
        assert_eq!(
            param(json!({"max_tokens": 1, "messages": trailing})),
            "messages[1].content"
        );
        let unanswered = json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]);
        assert_eq!(
            param(json!({"max_tokens": 1, "messages": unanswered})),
            "messages[1].content"
        );
        let server_tool = json!([{"type": "web_search_20250305", "name": "web_search"}]);
        assert_eq!(
            param(json!({"max_tokens": 1, "messages": msgs, "tools": server_tool})),
            "tools[0].type"
        );
        assert_eq!(
            param(json!({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]})),
            "messages[0].role"
        );
    }
}
