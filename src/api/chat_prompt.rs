//! OpenAI chat messages → what the model's chat template is given.
//!
//! The messages are passed on as the client sent them (key order kept, so the rendered prompt
//! matches `transformers`' `apply_chat_template` on the same input), normalised only where
//! templates need it:
//! - `developer` becomes `system` (the templates mtpx serves have no developer role);
//! - `content` that is null or missing becomes `""`; an array of text parts is joined;
//! - a tool call's `arguments` JSON string is parsed into an object (real Qwen/Hermes templates
//!   apply `tojson` to it, as vLLM and llama.cpp do).
//!
//! `tool_choice`: `none` renders without tools (and tool calls are not parsed); `auto` is the
//! default; `required` and a named function are enforced by beginning the assistant's reply for
//! it: the prompt ends with `<tool_call>\n{"name": "` (required) or `<tool_call>\n{"name": "NAME",
//! "arguments": ` (named), and the rest of the reply is sampled under a grammar of calls of the
//! declared tools with arguments valid against their `parameters` (see `tool_grammar`). The
//! forced text is fed to the tool-call parser before the model's output.

use super::errors::ApiError;
use super::tool_grammar;
use super::types::{ChatCompletionRequest, ToolChoice};
use crate::engine::Prompt;
use serde_json::{json, Map, Value};

/// The template's input and how to read the output.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub prompt: Prompt,
    /// Parse `<tool_call>` blocks of the output into tool calls.
    pub parse_tools: bool,
    /// `parallel_tool_calls: false`.
    pub single_call: bool,
    /// The declared tools (untagged calls of them are recognised too).
    pub tool_names: Vec<String>,
    /// The forced start of the reply (empty unless `tool_choice` forces a call).
    pub forced_prefix: String,
    /// The grammar the rest of a forced reply follows (see `tool_grammar`).
    pub forced_grammar: Option<String>,
    /// `tool_choice: "auto"` with tools: the grammars a call the model opens follows.
    pub lazy_calls: Option<tool_grammar::LazyCalls>,
    /// `tool_choice: "none"` with tools: they stay in the prompt, and the reply must not call
    /// one (see [`super::generate::Plan::ban_tool_calls`]).
    pub ban_tool_calls: bool,
}

impl ChatPrompt {
    /// Makes the reply continue `prefill`, the text of a final assistant message (Anthropic's
    /// prefill; Ollama's templates leave that message open the same way): the model goes on
    /// from it, and the reply is what follows. `format_param`: the request's output format
    /// field, when it has one (refused: the format applies to a whole reply).
    pub fn continue_prefill(
        &mut self,
        prefill: String,
        format_param: Option<&str>,
    ) -> Result<(), ApiError> {
        if let Some(field) = format_param {
            return Err(ApiError::invalid(
                Some(field),
                format!(
                    "a final assistant message (a prefill) cannot be combined with `{field}`: \
                     the format applies to the whole reply"
                ),
            ));
        }
        if !self.forced_prefix.is_empty() {
            return Err(ApiError::invalid(
                Some("messages"),
                "a final assistant message (a prefill) cannot be combined with a `tool_choice` \
                 that forces a tool call",
            ));
        }
        if let Prompt::Chat { messages, tools } =
            std::mem::replace(&mut self.prompt, Prompt::Tokens(Vec::new()))
        {
            self.prompt = Prompt::ChatContinued {
                messages,
                tools,
                assistant_prefix: prefill,
            };
        }
        Ok(())
    }
}

/// Builds the prompt from the raw request object and its typed view.
pub fn build(raw: &Value, req: &ChatCompletionRequest) -> Result<ChatPrompt, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "`messages` must not be empty",
        ));
    }
    let raw_messages = raw
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid(Some("messages"), "`messages` must be an array"))?;
    let messages = raw_messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;

    let tool_names: Vec<&str> = req
        .tools
        .iter()
        .flatten()
        .map(|t| t.function.name.as_str())
        .collect();
    for (i, tool) in req.tools.iter().flatten().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::invalid(
                Some(&format!("tools[{i}].type")),
                format!("only `function` tools are supported, got `{}`", tool.kind),
            ));
        }
    }
    let mut use_tools = !tool_names.is_empty();
    let render_tools = use_tools;
    let mut forced_prefix = String::new();
    match &req.tool_choice {
        None => {}
        Some(ToolChoice::Mode(mode)) => match mode.as_str() {
            "auto" => {}
            "none" => use_tools = false,
            // Forcing only the tag is not enough: small Qwen models end the reply right after
            // it. Opening the JSON object as well makes them name a function.
            "required" if use_tools => forced_prefix = "<tool_call>\n{\"name\": \"".into(),
            "required" => return Err(no_tools()),
            other => {
                return Err(ApiError::invalid(
                    Some("tool_choice"),
                    format!(
                    "`tool_choice` must be auto, none, required or a named function, got `{other}`"
                ),
                ))
            }
        },
        Some(ToolChoice::Named(named)) => {
            let name = &named.function.name;
            if !tool_names.contains(&name.as_str()) {
                return Err(ApiError::invalid(
                    Some("tool_choice.function.name"),
                    format!("`tool_choice` names `{name}`, which is not among `tools`"),
                ));
            }
            let name_json = serde_json::to_string(name).expect("a string serialises");
            forced_prefix = format!("<tool_call>\n{{\"name\": {name_json}, \"arguments\": ");
        }
    }
    let tools: Vec<(&str, Option<&Value>)> = req
        .tools
        .iter()
        .flatten()
        .map(|t| (t.function.name.as_str(), t.function.parameters.as_ref()))
        .collect();
    let parallel = req.parallel_tool_calls != Some(false);
    let lazy_calls =
        (use_tools && forced_prefix.is_empty()).then(|| tool_grammar::lazy_calls(&tools, parallel));
    let forced_grammar = (!forced_prefix.is_empty()).then(|| {
        let named = match &req.tool_choice {
            Some(ToolChoice::Named(named)) => Some(named.function.name.as_str()),
            _ => None,
        };
        let start = match named {
            Some(_) => tool_grammar::Start::InArguments,
            None => tool_grammar::Start::InName,
        };
        tool_grammar::forced_calls(&tools, named, parallel, start)
    });
    // With "none" the tools are still rendered, as vLLM and llama.cpp render them: an agent
    // that turns tools off for one turn keeps the prompt prefix its session has cached.
    let tools = render_tools.then(|| raw.get("tools").cloned()).flatten();
    let messages = Value::Array(messages);
    let prompt = if forced_prefix.is_empty() {
        Prompt::Chat { messages, tools }
    } else {
        Prompt::ChatContinued {
            messages,
            tools,
            assistant_prefix: forced_prefix.clone(),
        }
    };
    Ok(ChatPrompt {
        prompt,
        parse_tools: use_tools,
        single_call: req.parallel_tool_calls == Some(false),
        tool_names: tool_names.iter().map(|n| n.to_string()).collect(),
        forced_prefix,
        forced_grammar,
        lazy_calls,
        ban_tool_calls: render_tools && !use_tools,
    })
}

fn no_tools() -> ApiError {
    ApiError::invalid(
        Some("tool_choice"),
        "`tool_choice` is `required` but no `tools` were given",
    )
}

fn normalize_message(i: usize, raw: &Value) -> Result<Value, ApiError> {
    let mut m: Map<String, Value> = raw.as_object().cloned().unwrap_or_default();
    if m.get("role").and_then(Value::as_str) == Some("developer") {
        m.insert("role".into(), json!("system"));
    }
    let content = match m.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => join_parts(i, parts)?,
        Some(_) => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{i}].content")),
                "`content` must be a string or an array of text parts",
            ))
        }
    };
    m.insert("content".into(), Value::String(content));
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for call in calls.iter_mut() {
            if let Some(args) = call.pointer_mut("/function/arguments") {
                if let Value::String(s) = args {
                    if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                        *args = v;
                    }
                }
            }
        }
    } else if matches!(m.get("tool_calls"), Some(Value::Null)) {
        m.remove("tool_calls");
    }
    Ok(Value::Object(m))
}

fn join_parts(i: usize, parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
        match (kind, part.get("text").and_then(Value::as_str)) {
            ("text" | "input_text", Some(t)) => text.push_str(t),
            _ => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].content[{j}].type")),
                    format!("only text content parts are supported, got `{kind}`"),
                ))
            }
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::errors::from_value;

    fn build_json(v: Value) -> Result<ChatPrompt, ApiError> {
        let req: ChatCompletionRequest = from_value(&v)?;
        build(&v, &req)
    }

    fn messages(p: &ChatPrompt) -> &Value {
        match &p.prompt {
            Prompt::Chat { messages, .. } | Prompt::ChatContinued { messages, .. } => messages,
            _ => unreachable!(),
        }
    }

    #[test]
    fn messages_are_normalised_for_templates() {
        let p = build_json(json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}
        ]}))
        .unwrap();
        let m = messages(&p);
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["content"], "ab");
        assert_eq!(m[2]["content"], "");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert!(!p.parse_tools);
    }

    #[test]
    fn tool_choice_none_keeps_tools_unparsed_and_named_must_exist() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let base = |choice: Value| json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice});
        let p = build_json(base(json!("none"))).unwrap();
        assert!(!p.parse_tools && p.ban_tool_calls);
        assert!(matches!(p.prompt, Prompt::Chat { tools: Some(_), .. }));
        let p = build_json(base(json!("auto"))).unwrap();
        assert!(p.parse_tools && !p.ban_tool_calls);
        let p = build_json(base(json!({"type": "function", "function": {"name": "f"}}))).unwrap();
        assert_eq!(
            messages(&p).as_array().unwrap().len(),
            1,
            "no message is added"
        );
        assert_eq!(
            p.forced_prefix,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": "
        );
        assert!(
            matches!(&p.prompt, Prompt::ChatContinued { assistant_prefix, .. }
            if *assistant_prefix == p.forced_prefix)
        );
        let p = build_json(base(json!("required"))).unwrap();
        assert_eq!(p.forced_prefix, "<tool_call>\n{\"name\": \"");
        let err =
            build_json(base(json!({"type": "function", "function": {"name": "g"}}))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice.function.name"));
        let err = build_json(base(json!("sometimes"))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn bad_messages_name_their_field() {
        let err = build_json(json!({"messages": []})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
        let err = build_json(json!({"messages": [{"role": "robot", "content": "x"}]})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].role"));
        let err = build_json(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}))
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].content[0].type"));
    }
}
