//! Python `json.dumps` formatting of template values, as transformers' `tojson` filter uses it:
//! `", "` / `": "` separators (`","` when indented), `ensure_ascii=False`, key order kept.
//! minijinja's own `tojson` differs (compact, HTML-escapes `<`, `>`, `&`, `'`), which changes the
//! bytes of every tool schema a template renders.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};
use std::fmt::Write;

/// `json.dumps` options (the subset `tojson` exposes).
#[derive(Debug, Clone)]
pub(crate) struct JsonStyle {
    /// Indentation per level; `None` writes everything on one line.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
}

impl JsonStyle {
    /// Python's defaults for the given indent: `(", ", ": ")`, or `(",", ": ")` when indented.
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        Self {
            indent,
            item_separator: item_separator.to_string(),
            key_separator: ": ".to_string(),
            ensure_ascii: false,
            sort_keys: false,
        }
    }
}

/// Serializes `value` exactly as Python's `json.dumps` would with `style`.
pub(crate) fn dumps(value: &Value, style: &JsonStyle) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, style, 0)?;
    Ok(out)
}

fn write_value(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Map => write_map(out, value, style, depth)?,
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items.len(), style, depth, |out, i| {
                write_value(out, &items[i], style, depth + 1)
            })?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_map(out: &mut String, map: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    let mut entries = Vec::new();
    for key in map.try_iter()? {
        let item = map.get_item(&key)?;
        entries.push((key_string(&key)?, item));
    }
    if style.sort_keys {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
    }
    write_container(out, ('{', '}'), entries.len(), style, depth, |out, i| {
        let (key, item) = &entries[i];
        write_string(out, key, style.ensure_ascii);
        out.push_str(&style.key_separator);
        write_value(out, item, style, depth + 1)
    })
}

/// Writes `open item sep item ... close`, with Python's newline + indent layout when indented.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        newline(out, style, depth + 1);
        write_item(out, i)?;
    }
    newline(out, style, depth);
    out.push(close);
    Ok(())
}

fn newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// Python converts non-string keys: numbers via repr, `True` → `"true"`, `None` → `"null"`.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut s = String::new();
            write_value(&mut s, key, &JsonStyle::new(None), 0)?;
            Ok(s)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        out.push_str(&value.to_string());
        return Ok(());
    }
    let x = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(x));
    Ok(())
}

/// Python's `float.__repr__`: shortest round-trip digits, scientific notation when the
/// decimal exponent is below -4 or at least 16 (`1e+16`, `1.5e-07`), always a `.0` otherwise.
pub(crate) fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        let zeros = "0".repeat(int_len - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
    }
}

/// A JSON string literal as Python escapes it (`\uXXXX` in lowercase hex).
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps_json(json: &str, style: &JsonStyle) -> String {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        dumps(&Value::from_serialize(&value), style).unwrap()
    }

    #[test]
    fn default_separators_match_python() {
        let got = dumps_json(
            r#"{"a": [1, 2.5, true, null], "b": "x"}"#,
            &JsonStyle::new(None),
        );
        assert_eq!(got, r#"{"a": [1, 2.5, true, null], "b": "x"}"#);
    }

    #[test]
    fn indent_uses_comma_without_space_and_keeps_empty_containers_short() {
        let got = dumps_json(
            r#"{"a": [1, {}], "b": []}"#,
            &JsonStyle::new(Some("  ".into())),
        );
        assert_eq!(got, "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
    }

    #[test]
    fn strings_keep_non_ascii_and_escape_controls_like_python() {
        let value = Value::from("é 😀 <b>&'\"\\\n\u{1}\u{7f}");
        let got = dumps(&value, &JsonStyle::new(None)).unwrap();
        assert_eq!(got, "\"é 😀 <b>&'\\\"\\\\\\n\\u0001\u{7f}\"");
        let ascii = JsonStyle {
            ensure_ascii: true,
            ..JsonStyle::new(None)
        };
        assert_eq!(
            dumps(&Value::from("é😀"), &ascii).unwrap(),
            r#""\u00e9\ud83d\ude00""#
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (123456.789, "123456.789"),
            (0.0001, "0.0001"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (1234567890123456.0, "1234567890123456.0"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn sort_keys_orders_map_entries() {
        let style = JsonStyle {
            sort_keys: true,
            ..JsonStyle::new(None)
        };
        let value = Value::from_iter([("b", 1), ("a", 2)]);
        assert_eq!(dumps(&value, &style).unwrap(), r#"{"a": 2, "b": 1}"#);
    }
}
