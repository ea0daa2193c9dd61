//! The tool-call parser fed whole, char by char and in every two-way split: the decided
//! output is the same, tags never leak into content, arguments reassemble into valid JSON.

use super::*;

/// What a client reassembles from the pieces.
#[derive(Debug, Default, PartialEq)]
struct Reassembled {
    content: String,
    reasoning: String,
    /// (name, arguments) per index.
    calls: Vec<(String, String)>,
    ids: Vec<String>,
}

fn reassemble(pieces: &[Piece]) -> Reassembled {
    let mut r = Reassembled::default();
    for p in pieces {
        match p {
            Piece::Content(t) => r.content.push_str(t),
            Piece::Reasoning(t) => r.reasoning.push_str(t),
            Piece::ToolCallStart { index, id, name } => {
                assert_eq!(*index, r.calls.len(), "indices are dense and in order");
                r.calls.push((name.clone(), String::new()));
                r.ids.push(id.clone());
            }
            Piece::ToolCallArgs { index, fragment } => {
                assert!(
                    *index < r.calls.len(),
                    "arguments before their call's start"
                );
                r.calls[*index].1.push_str(fragment);
            }
        }
    }
    r
}

fn feed(mut parser: ToolCallParser, chunks: &[&str]) -> (Reassembled, ToolCallParser) {
    let mut pieces = Vec::new();
    for c in chunks {
        pieces.extend(parser.push(c));
    }
    pieces.extend(parser.finish());
    let mut r = reassemble(&pieces);
    r.ids.clear();
    (r, parser)
}

fn run_in(chunks: &[&str], parse_tools: bool, single: bool) -> (Reassembled, ToolCallParser) {
    feed(ToolCallParser::new(parse_tools, single), chunks)
}

fn run(text: &str) -> Reassembled {
    run_in(&[text], true, false).0
}

/// The same result whole, char by char, and split at every char boundary, from parsers made
/// by `parser`.
fn splits_agree(text: &str, parser: impl Fn() -> ToolCallParser) -> Reassembled {
    let whole = feed(parser(), &[text]).0;
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(feed(parser(), &refs).0, whole, "char by char: {text:?}");
    for (at, _) in text.char_indices().skip(1) {
        let (a, b) = text.split_at(at);
        assert_eq!(feed(parser(), &[a, b]).0, whole, "split at {at}");
    }
    whole
}

fn check_all_splits(text: &str) -> Reassembled {
    splits_agree(text, || ToolCallParser::new(true, false))
}

fn call(name: &str, args: &str) -> (String, String) {
    (name.to_string(), args.to_string())
}

#[test]
fn plain_text_is_content() {
    let r = check_all_splits("Hello <b>world</b> a < b");
    assert_eq!(r.content, "Hello <b>world</b> a < b");
    assert!(r.calls.is_empty());
}

#[test]
fn a_qwen_tool_call_becomes_a_call_and_never_content() {
    let text = "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a.txt\", \"content\": \"x </tool_call> y {\\\"q\\\": 1}\"}}\n</tool_call>";
    let r = check_all_splits(text);
    assert_eq!(r.content, "");
    assert_eq!(r.calls.len(), 1);
    assert_eq!(r.calls[0].0, "write");
    let args: Value = serde_json::from_str(&r.calls[0].1).unwrap();
    assert_eq!(args["path"], "a.txt");
    assert_eq!(args["content"], "x </tool_call> y {\"q\": 1}");
}

#[test]
fn several_calls_with_text_before_get_dense_indices() {
    let text = "Let me look.\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"read\",\"arguments\":{\"path\":\"b\",\"n\":[1,{\"x\":2}]}}\n</tool_call>";
    let r = check_all_splits(text);
    assert_eq!(r.content, "Let me look.\n");
    assert_eq!(
        r.calls,
        vec![
            call("read", "{\"path\": \"a\"}"),
            call("read", "{\"path\":\"b\",\"n\":[1,{\"x\":2}]}")
        ]
    );
}

#[test]
fn arguments_stream_as_they_are_written() {
    let mut parser = ToolCallParser::new(true, false);
    let mut pieces = parser.push("<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": ");
    assert!(
        matches!(&pieces[..], [Piece::ToolCallStart { index: 0, name, id }, Piece::ToolCallArgs { fragment, .. }]
            if name == "write" && id.starts_with("call_") && fragment == "{\"path\": "),
        "{pieces:?}"
    );
    pieces = parser.push("\"x.rs\"");
    assert_eq!(
        pieces,
        vec![Piece::ToolCallArgs {
            index: 0,
            fragment: "\"x.rs\"".into()
        }]
    );
    pieces = parser.push("}}\n</tool_");
    assert_eq!(
        pieces,
        vec![Piece::ToolCallArgs {
            index: 0,
            fragment: "}".into()
        }]
    );
    assert!(parser.push("call>").is_empty());
    assert!(parser.finish().is_empty());
    assert_eq!(parser.tool_calls().len(), 1);
    assert_eq!(
        parser.tool_calls()[0].function.arguments,
        Value::String("{\"path\": \"x.rs\"}".into())
    );
}

#[test]
fn malformed_blocks_fall_back_to_content() {
    for text in [
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"arguments\": {}, \"nam\": 3}</tool_call>",
        "<tool_call>{\"name\": 3}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": 5}</tool_call>",
        "<tool_call><tool_call><tool_call>",
    ] {
        let r = check_all_splits(text);
        assert!(r.calls.is_empty(), "{text}: {r:?}");
        assert_eq!(
            r.content.replace("</tool_call>", ""),
            text.replace("</tool_call>", ""),
            "{text}"
        );
    }
}

#[test]
fn keys_in_another_order_or_string_arguments_are_parsed_whole() {
    let r = check_all_splits("<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>");
    assert_eq!(r.calls, vec![call("f", "{\"a\":1}")]);
    let r = check_all_splits(
        "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
    );
    assert_eq!(r.calls, vec![call("f", "{\"a\": 1}")]);
}

#[test]
fn an_unclosed_block_at_the_end_keeps_what_was_written() {
    let r = run("<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a\"}}");
    assert_eq!(r.calls, vec![call("write", "{\"path\": \"a\"}")]);
    let r = run("<tool_call>\n{\"name\": \"wri");
    assert!(r.calls.is_empty());
    assert_eq!(r.content, "<tool_call>\n{\"name\": \"wri");
}

#[test]
fn think_goes_to_reasoning() {
    let r = check_all_splits("<think>\nplan it\n</think>\n\nThe answer.");
    assert_eq!(r.reasoning, "\nplan it\n");
    assert_eq!(r.content, "The answer.");
}

#[test]
fn without_tools_the_tags_are_plain_content() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
    let (r, _) = run_in(&[text], false, false);
    assert_eq!(r.content, text);
    assert!(r.calls.is_empty());
}

#[test]
fn single_call_mode_drops_later_blocks() {
    let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
    let (r, parser) = run_in(&[text], true, true);
    assert_eq!(r.calls, vec![call("a", "{}")]);
    assert_eq!(r.content, "");
    assert_eq!(parser.tool_calls().len(), 1);
}

#[test]
fn a_partial_tag_is_held_back_then_released() {
    let mut parser = ToolCallParser::new(true, false);
    assert_eq!(parser.push("a <tool_"), vec![Piece::Content("a ".into())]);
    assert_eq!(parser.push("x"), vec![Piece::Content("<tool_x".into())]);
    assert_eq!(parser.push("<thi"), vec![]);
    assert_eq!(parser.finish(), vec![Piece::Content("<thi".into())]);
}

#[test]
fn ids_are_unique() {
    let a = new_call_id();
    let b = new_call_id();
    assert_ne!(a, b);
    assert_eq!(a.len(), "call_".len() + 24);
}

/// With the declared tool names: the result whole, char by char and at every split.
fn run_named(text: &str) -> Reassembled {
    let names = vec!["get_weather".to_string(), "read".to_string()];
    splits_agree(text, || {
        ToolCallParser::new(true, false).with_tool_names(names.clone())
    })
}

#[test]
fn untagged_calls_of_declared_tools_are_calls() {
    let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```";
    let r = run_named(fenced);
    assert_eq!(r.content, "");
    assert_eq!(
        r.calls,
        vec![("get_weather".into(), r#"{"city":"Paris"}"#.into())]
    );
    let two = "{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}\n{\"name\": \"read\", \"arguments\": {\"path\": \"b\"}}";
    let r = run_named(two);
    assert_eq!(r.calls.len(), 2, "{r:?}");
    assert_eq!(r.content, "");
    // Tagged calls are unchanged.
    let tagged =
        "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"x\"}}\n</tool_call>";
    assert_eq!(
        run_named(tagged).calls,
        vec![("read".into(), r#"{"path": "x"}"#.into())]
    );
}

#[test]
fn json_answers_and_unknown_tools_stay_content() {
    for text in [
        "{\"name\": \"Ada\", \"age\": 36}",
        "```json\n{\"name\": \"unknown_tool\", \"arguments\": {}}\n```",
        "Here it is: {\"name\": \"read\", \"arguments\": {}}",
        "```python\nprint('hi')\n```",
        "{\"name\": \"read\", \"arguments\": {\"path\": ",
    ] {
        let r = run_named(text);
        assert!(r.calls.is_empty(), "{text}: {r:?}");
        assert_eq!(r.content, text);
    }
    // Without the declared names (the old constructor) nothing untagged is a call.
    let r = run("{\"name\": \"read\", \"arguments\": {}}");
    assert!(r.calls.is_empty());
}

#[test]
fn a_call_on_a_line_of_its_own_after_text_is_a_call() {
    // What Qwen2.5-Coder-1.5B writes under Codex's and opencode's prompts: a line of its own,
    // then the call (here with the doubled braces its template's example spells).
    let text =
        "<tools></tools>\n<result>\n{{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}}";
    let r = run_named(text);
    assert_eq!(r.content, "<tools></tools>\n<result>\n");
    assert_eq!(r.calls, vec![("read".into(), r#"{"path":"a"}"#.into())]);
    let fenced =
        "I will read it.\n```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n```\nDone.";
    let r = run_named(fenced);
    assert_eq!(r.content, "I will read it.\n\nDone.", "{r:?}");
    assert_eq!(r.calls, vec![("get_weather".into(), "{}".into())]);
    // Code and JSON that are no calls stay content, line starts included.
    for text in [
        "Use this:\n{\n  \"city\": \"Paris\"\n}\n",
        "Example:\n```python\nx = {\"name\": 1}\n```",
        "A call of an unknown tool:\n{\"name\": \"delete_all\", \"arguments\": {}}",
        "Ends with a newline\n",
        "Ends with spaces after a newline\n  ",
    ] {
        let r = run_named(text);
        assert!(r.calls.is_empty(), "{text}: {r:?}");
        assert_eq!(r.content, text);
    }
}
