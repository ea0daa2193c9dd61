//! Tool calls written without `<tool_call>` tags.
//!
//! Small Qwen2.5-Coder models, asked with `tool_choice: "auto"`, often answer a tool request
//! with the call's JSON alone, bare or in a fenced code block:
//!
//! ````text
//! ```json
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! ```
//! ````
//!
//! llama.cpp's server accepts these forms for Hermes-style templates too. Only text that
//! *starts* with such an object (after whitespace: the reply, a line of it, or what follows
//! another call) and names a tool the request declared is taken as a call, so JSON an
//! assistant writes as an answer stays content. The object may be written with doubled braces
//! (`{{"name": …}}`), as Qwen2.5-Coder-1.5B's chat template spells its example call and the
//! model then copies.

use serde_json::Value;

/// What the text held so far is.
#[derive(Debug, Clone, PartialEq)]
pub enum BareCall {
    /// It may still become a call: wait for more text.
    Undecided,
    /// It is not a call: release it as content.
    NotACall,
    /// A call, taking the first `consumed` bytes of the text.
    Call {
        name: String,
        arguments: String,
        consumed: usize,
    },
}

/// Decides `text` (held from the start of a reply or after a call); `at_end`: no more text
/// will come.
pub fn bare_call(text: &str, tool_names: &[String], at_end: bool) -> BareCall {
    let undecided = if at_end {
        BareCall::NotACall
    } else {
        BareCall::Undecided
    };
    let mut i = text.len() - text.trim_start().len();
    let fenced = text[i..].starts_with('`');
    if fenced {
        let rest = &text[i..];
        let Some(line_end) = rest.find('\n') else {
            return if "```json".starts_with(rest) || rest.starts_with("```json") {
                undecided
            } else {
                BareCall::NotACall
            };
        };
        if !matches!(rest[..line_end].trim_end(), "```" | "```json" | "```JSON") {
            return BareCall::NotACall;
        }
        i += line_end + 1;
        i += text[i..].len() - text[i..].trim_start().len();
    }
    let body = &text[i..];
    if body.is_empty() {
        return undecided;
    }
    let doubled = body.starts_with("{{");
    if doubled {
        i += 1;
    }
    let body = &text[i..];
    // `{` then `"name"`: anything else is an answer, not a call.
    let Some(after_brace) = body.strip_prefix('{') else {
        return BareCall::NotACall;
    };
    let key = after_brace.trim_start();
    if key.len() < 6 {
        return if "\"name\"".starts_with(key) {
            undecided
        } else {
            BareCall::NotACall
        };
    }
    if !key.starts_with("\"name\"") {
        return BareCall::NotACall;
    }
    let Some(object_len) = object_end(body) else {
        return undecided;
    };
    let Ok(value) = serde_json::from_str::<Value>(&body[..object_len]) else {
        return BareCall::NotACall;
    };
    let Some(name) = value
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| tool_names.iter().any(|t| t == n))
    else {
        return BareCall::NotACall;
    };
    let arguments = match value.get("arguments") {
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => {
            s.clone()
        }
        None | Some(Value::Null) => "{}".to_string(),
        Some(_) => return BareCall::NotACall,
    };
    let mut consumed = i + object_len;
    if doubled {
        let rest = &text[consumed..];
        let close = rest.len() - rest.trim_start().len();
        if rest[close..].starts_with('}') {
            consumed += close + 1;
        } else if !at_end && rest[close..].is_empty() {
            return BareCall::Undecided; // the second closing brace may still come
        }
    }
    if fenced {
        let rest = &text[consumed..];
        let close = rest.len() - rest.trim_start().len();
        if rest[close..].starts_with("```") {
            consumed += close + 3;
        } else if !at_end && "```".starts_with(&rest[close..]) {
            return BareCall::Undecided; // the closing fence may still come
        }
    }
    BareCall::Call {
        name: name.to_string(),
        arguments,
        consumed,
    }
}

/// Byte length of the JSON object at the start of `s` once it is closed.
fn object_end(s: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escape) = (0usize, false, false);
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escape => escape = false,
                '\\' => escape = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into()]
    }

    fn call(text: &str) -> BareCall {
        bare_call(text, &names(), true)
    }

    #[test]
    fn fenced_and_bare_calls_are_recognised() {
        let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        assert_eq!(
            call(fenced),
            BareCall::Call {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
                consumed: fenced.len(),
            }
        );
        let bare =
            "\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"} and";
        let BareCall::Call {
            arguments,
            consumed,
            ..
        } = call(bare)
        else {
            panic!("{:?}", call(bare));
        };
        assert_eq!(arguments, r#"{"city": "Oslo"}"#);
        assert_eq!(&bare[consumed..], " and");
        // Doubled braces, as the 1.5B's template spells its example call.
        let doubled = "{{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}}\n";
        assert_eq!(
            call(doubled),
            BareCall::Call {
                name: "get_weather".into(),
                arguments: r#"{"city":"Rome"}"#.into(),
                consumed: doubled.len() - 1,
            }
        );
        assert_eq!(
            bare_call(&doubled[..doubled.len() - 2], &names(), false),
            BareCall::Undecided,
            "the second closing brace may still come"
        );
    }

    #[test]
    fn answers_that_merely_look_like_json_stay_content() {
        for text in [
            "Sure! {\"name\": \"get_weather\"}",
            "{\"city\": \"Paris\"}",
            "{\"name\": \"other_tool\", \"arguments\": {}}",
            "{\"name\": \"get_weather\", \"arguments\": [1]}",
            "```python\nprint(1)\n```",
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
        ] {
            assert_eq!(call(text), BareCall::NotACall, "{text}");
        }
    }

    #[test]
    fn prefixes_wait_for_more_text() {
        for text in [
            "",
            "  ",
            "`",
            "```js",
            "```json",
            "```json\n",
            "{",
            "{ \"na",
            "{\"name\": \"get_weather\", \"arg",
        ] {
            assert_eq!(
                bare_call(text, &names(), false),
                BareCall::Undecided,
                "{text:?}"
            );
        }
        // An object that is closed but whose fence is not yet: the fence may still come.
        let open = "```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n`";
        assert_eq!(bare_call(open, &names(), false), BareCall::Undecided);
        assert!(matches!(
            bare_call(open, &names(), true),
            BareCall::Call { .. }
        ));
    }
}
