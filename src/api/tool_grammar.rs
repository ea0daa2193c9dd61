//! The grammar of a reply that `tool_choice` forces to be tool calls: Hermes/Qwen
//! `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>` blocks, where NAME is one of
//! the declared tools (or the named one) and ARGS is valid against that tool's `parameters`
//! schema. Sampled under it (see `sampling::constraint`), even a model never trained on tools
//! writes a call the tool-call parser reads, instead of prose or half-tagged markup.
//!
//! The grammar is Lark (llguidance's dialect: `%json {schema}` embeds a JSON Schema). Chat
//! completions already end the prompt with the start of the call (`ChatPrompt::forced_prefix`),
//! so their grammar begins where that prefix stops.

use crate::sampling::prepare_json_schema;
use serde_json::{json, Value};

/// How much of the first call the prompt already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Nothing: the reply starts with `<tool_call>`.
    Empty,
    /// `<tool_call>\n{"name": "` (chat, `required`).
    InName,
    /// `<tool_call>\n{"name": "NAME", "arguments": ` (chat, a named function).
    InArguments,
}

/// The opening of a call up to its name.
const CALL_OPEN: &str = "<tool_call>\n{\"name\": \"";
const CALL_CLOSE: &str = "}\n</tool_call>";

/// A Lark grammar for the forced calls. `tools` are (name, parameters schema); `named` picks
/// one of them (one call of it), else any of them, several calls when `parallel`.
pub fn forced_calls(
    tools: &[(&str, Option<&Value>)],
    named: Option<&str>,
    parallel: bool,
    start: Start,
) -> String {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, (name, parameters)) in tools.iter().enumerate() {
        if named.is_some_and(|n| n != *name) {
            continue;
        }
        rules.push(format!("args_{i}: %json {}", arguments_schema(*parameters)));
        // The rest of the call after `{"name": "`.
        let after_name = format!("{}\", \"arguments\": ", json_string_body(name));
        rules.push(format!(
            "after_name_{i}: {} args_{i} {}",
            literal(&after_name),
            literal(CALL_CLOSE)
        ));
        alternatives.push(format!("after_name_{i}"));
    }
    rules.push(format!("after_name: {}", alternatives.join(" | ")));
    rules.push(format!("call: {} after_name", literal(CALL_OPEN)));
    let first = match start {
        Start::Empty => "call".to_string(),
        Start::InName => "after_name".to_string(),
        // A named call: exactly one alternative.
        Start::InArguments => format!(
            "{} {}",
            alternatives[0].replace("after_name_", "args_"),
            literal(CALL_CLOSE)
        ),
    };
    let more = if parallel && named.is_none() {
        format!(" ({} call)*", literal("\n"))
    } else {
        String::new()
    };
    rules.insert(0, format!("start: {first}{more}"));
    rules.join("\n")
}

/// The schema the arguments must follow: the tool's `parameters`, or any object without one.
/// Whitespace inside is bounded as for `response_format`.
fn arguments_schema(parameters: Option<&Value>) -> Value {
    let mut schema = match parameters {
        Some(p) if p.is_object() => p.clone(),
        _ => json!({"type": "object"}),
    };
    prepare_json_schema(&mut schema);
    schema
}

/// A Lark string literal (JSON string syntax) matching `text` exactly.
fn literal(text: &str) -> String {
    serde_json::to_string(text).expect("a string serialises")
}

/// `name` as it appears between the quotes of a JSON string.
fn json_string_body(name: &str) -> String {
    let quoted = serde_json::to_string(name).expect("a string serialises");
    quoted[1..quoted.len() - 1].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_call_starts_at_its_arguments_and_allows_one_call() {
        let params = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let g = forced_calls(
            &[("other", None), ("get_weather", Some(&params))],
            Some("get_weather"),
            true,
            Start::InArguments,
        );
        let start = g.lines().next().unwrap();
        assert_eq!(start, r#"start: args_1 "}\n</tool_call>""#);
        assert!(!g.contains("args_0"), "{g}");
        assert!(g.contains(r#""city""#), "{g}");
    }

    #[test]
    fn required_calls_repeat_only_when_parallel() {
        let tools = [("a", None), ("b\"c", None)];
        let g = forced_calls(&tools, None, true, Start::InName);
        assert_eq!(
            g.lines().next().unwrap(),
            r#"start: after_name ("\n" call)*"#
        );
        // A quote in a name is escaped once for JSON and once for the Lark literal.
        assert!(g.contains(r#""b\\\"c\", \"arguments\": ""#), "{g}");
        let single = forced_calls(&tools, None, false, Start::Empty);
        assert_eq!(single.lines().next().unwrap(), "start: call");
    }
}
