//! The grammar of a reply that `tool_choice` forces to be tool calls: Hermes/Qwen
//! `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>` blocks, where NAME is one of
//! the declared tools (or the named one) and ARGS is valid against that tool's `parameters`
//! schema. Sampled under it (see `sampling::constraint`), even a model never trained on tools
//! writes a call the tool-call parser reads, instead of prose or half-tagged markup.
//!
//! The grammar is Lark (llguidance's dialect: `%json {schema}` embeds a JSON Schema). Chat
//! completions already end the prompt with the start of the call (`ChatPrompt::forced_prefix`),
//! so their grammar begins where that prefix stops.
//!
//! With `tool_choice: "auto"` the same calls are the grammar of a *lazy* constraint
//! ([`lazy_calls`], see `sampling::lazy_calls`): the reply is free until the model opens a call
//! (`<tool_call>`, or a reply that starts with a bare or fenced `{"name": "`), and from there
//! the call must name a declared tool and give it arguments valid against its schema, so a
//! small model's call always parses.

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
/// The opening of a bare call up to the colon after `"name"`, as the model may space it (what
/// `bare_tool_calls` reads as a call), without and with a code fence. The constraint starts
/// there: a token that opens the name's string may already hold its first letters.
const BARE_OPEN: &str = r#"/[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:/"#;
/// With doubled braces, as Qwen2.5-Coder-1.5B's template spells its example call.
const DOUBLED_OPEN: &str = r#"/[ \t\r\n]*\{\{[ \t\r\n]*"name"[ \t\r\n]*:/"#;
const FENCED_OPEN: &str =
    r#"/[ \t\r\n]*```(json|JSON)?[ \t]*\n[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:/"#;
/// The quote that opens the name.
const NAME_QUOTE: &str = r#"/[ \t]*"/"#;

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

/// The two grammars of the lazy constraint for `tool_choice: "auto"`: from a `<tool_call>` tag
/// (Hermes/Qwen blocks, several when `parallel`), and from the start of a reply that opens a
/// bare or fenced JSON call (one call).
#[derive(Debug, Clone, PartialEq)]
pub struct LazyCalls {
    pub tagged: String,
    pub bare: String,
}

pub fn lazy_calls(tools: &[(&str, Option<&Value>)], parallel: bool) -> LazyCalls {
    let tagged = forced_calls(tools, None, parallel, Start::Empty);
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, (name, parameters)) in tools.iter().enumerate() {
        rules.push(format!("args_{i}: %json {}", arguments_schema(*parameters)));
        let after_name = format!("{}\", \"arguments\": ", json_string_body(name));
        rules.push(format!(
            "after_name_{i}: {} args_{i} {}",
            literal(&after_name),
            literal("}")
        ));
        alternatives.push(format!("after_name_{i}"));
    }
    rules.push(format!("after_name: {}", alternatives.join(" | ")));
    rules.push(format!("BARE_OPEN: {BARE_OPEN}"));
    rules.push(format!("DOUBLED_OPEN: {DOUBLED_OPEN}"));
    rules.push(format!("FENCED_OPEN: {FENCED_OPEN}"));
    rules.push(format!("NAME_QUOTE: {NAME_QUOTE}"));
    rules.insert(
        0,
        format!(
            "start: BARE_OPEN NAME_QUOTE after_name | DOUBLED_OPEN NAME_QUOTE after_name {} \
             | FENCED_OPEN NAME_QUOTE after_name {}",
            literal("}"),
            literal("\n```")
        ),
    );
    LazyCalls {
        tagged,
        bare: rules.join("\n"),
    }
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
