//! Hugging Face chat templates rendered with minijinja, set up as transformers sets up Jinja2
//! for `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, loop controls, `namespace`,
//! Python string/dict methods (`.startswith`, `.split`, `.items()`, ...), and the globals and
//! filters transformers adds: `raise_exception`, `strftime_now` and a `tojson` that formats
//! like Python's `json.dumps`. `{% generation %}` blocks (assistant masks) render their body.
//!
//! The template sees what `apply_chat_template` gives it: objects in their key order (minijinja's
//! `preserve_order`), messages without their null-valued keys, a message's reasoning under both
//! `reasoning_content` and `thinking`, and the tokenizer's special tokens (`bos_token`,
//! `eos_token`, `unk_token`, `pad_token`). `tests/tokenizer.rs` checks the rendering byte for
//! byte against transformers itself.

use super::gguf::token_text;
use super::pyjson::{self, JsonStyle};
use anyhow::{anyhow, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::time::{SystemTime, UNIX_EPOCH};

const TEMPLATE_NAME: &str = "chat_template";
const GGUF_TEMPLATE_KEY: &str = "tokenizer.chat_template";
/// GGUF token-id keys and the template variables transformers' GGUF loader makes of them.
const GGUF_SPECIAL_TOKENS: [(&str, &str); 4] = [
    ("tokenizer.ggml.bos_token_id", "bos_token"),
    ("tokenizer.ggml.eos_token_id", "eos_token"),
    ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ("tokenizer.ggml.padding_token_id", "pad_token"),
];
/// Names a message's reasoning goes by; transformers gives the first one set under both
/// `thinking` and `reasoning_content`.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A compiled chat template. Rendering is read-only, so one instance serves every request.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Variables every rendering gets, as transformers passes the tokenizer's
    /// `special_tokens_map` (`bos_token`, ...).
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a template source (Jinja, as found in `tokenizer_config.json` or GGUF).
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, replace_generation_tags(source))
            .map_err(|e| anyhow!("compiling the chat template: {e:#}"))?;
        Ok(Self {
            env,
            special_tokens: Vec::new(),
        })
    }

    /// The template stored under `tokenizer.chat_template`, or `None` when the file has none,
    /// with the file's special tokens.
    pub fn from_gguf(content: &Content) -> Result<Option<Self>> {
        match content.metadata.get(GGUF_TEMPLATE_KEY) {
            None => Ok(None),
            Some(GgufValue::String(source)) => Self::new(source)
                .with_context(|| format!("GGUF key `{GGUF_TEMPLATE_KEY}`"))?
                .with_gguf_special_tokens(content)
                .map(Some),
            Some(other) => Err(anyhow!("`{GGUF_TEMPLATE_KEY}` is not a string: {other:?}")),
        }
    }

    /// Gives the template the GGUF's bos/eos/unk/pad tokens as `bos_token`, `eos_token`,
    /// `unk_token` and `pad_token` (those the file names), as transformers does for a tokenizer
    /// loaded from it.
    pub fn with_gguf_special_tokens(mut self, content: &Content) -> Result<Self> {
        self.special_tokens.clear();
        for (key, name) in GGUF_SPECIAL_TOKENS {
            if let Some(token) = token_text(content, key)? {
                self.special_tokens.push((name.to_string(), token));
            }
        }
        Ok(self)
    }

    /// Renders a conversation as `apply_chat_template(messages, tools=tools, tokenize=False,
    /// add_generation_prompt=..., **extra)` does. `messages` is the list of message objects,
    /// `tools` the list of tool schemas (passed to the template as `none` when absent), `extra`
    /// an object of further variables (`enable_thinking`, ...) that override the special tokens
    /// but never the named arguments.
    ///
    /// Objects keep the key order they have in `serde_json::Value` (the request's order: mtpx
    /// enables serde_json's `preserve_order`).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let mut vars: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => vars.extend(
                map.iter()
                    .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
            ),
            other => {
                return Err(anyhow!(
                    "template extra variables must be an object, not {other}"
                ))
            }
        }
        vars.retain(|(k, _)| {
            !matches!(
                k.as_str(),
                "messages" | "tools" | "documents" | "add_generation_prompt"
            )
        });
        // A later variable of the same name replaces an earlier one (extra over special tokens).
        vars.push((
            "messages".into(),
            Value::from_serialize(prepare_messages(messages)?),
        ));
        vars.push((
            "tools".into(),
            tools.map_or(Value::from(()), Value::from_serialize),
        ));
        vars.push(("documents".into(), Value::from(())));
        vars.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("{e}"))?;
        template
            .render(Value::from_iter(vars))
            .map_err(|e| anyhow!("rendering the chat template: {e:#}"))
    }
}

/// The conversation as transformers hands it to the template (`_normalize_chat_messages` and
/// `_alias_reasoning_fields`): each message without its null-valued keys, and a message with
/// reasoning (the first of [`REASONING_FIELDS`] set) gets it as `thinking` (first key, unless
/// present) and `reasoning_content` (last key, unless present).
fn prepare_messages(messages: &serde_json::Value) -> Result<serde_json::Value> {
    use serde_json::Value as Json;
    let Json::Array(messages) = messages else {
        return Err(anyhow!("chat messages must be a list, not {messages}"));
    };
    let prepared = messages.iter().map(|message| {
        let Json::Object(message) = message else {
            return Err(anyhow!("a chat message must be an object, not {message}"));
        };
        let mut message: serde_json::Map<String, Json> = message
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|field| message.get(*field))
            .cloned();
        if let Some(reasoning) = reasoning {
            let mut aliased = serde_json::Map::new();
            aliased.insert("thinking".into(), reasoning.clone());
            aliased.extend(message);
            aliased.insert("reasoning_content".into(), reasoning);
            message = aliased;
        }
        Ok(Json::Object(message))
    });
    prepared.collect::<Result<_>>().map(Json::Array)
}

/// `raise_exception(message)`: templates call it to reject a conversation they can't render.
fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("chat template raised an exception: {message}"),
    ))
}

/// `x | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, the
/// filter transformers installs (Python `json.dumps` with those arguments).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(" ".repeat(usize::try_from(v)?)),
        Some(v) => Some(v.as_str().map(str::to_string).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an int or a string",
            )
        })?),
    };
    let mut style = JsonStyle::new(indent);
    if let Some(separators) = kwargs.get::<Option<Vec<String>>>("separators")? {
        let [item, key]: [String; 2] = separators.try_into().map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            )
        })?;
        style.item_separator = item;
        style.key_separator = key;
    }
    style.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    pyjson::dumps(value, &style)
}

/// `strftime_now(format)`: the current time formatted like Python's `strftime`. Uses UTC
/// (a server's local zone is usually UTC; Python would use the process's local time).
fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime_utc(secs, format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with the common C `strftime` directives, including glibc's `%-d`
/// style "no padding" flag. Unknown directives are kept verbatim, as glibc does.
fn strftime_utc(unix_secs: i64, format: &str) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.next_if_eq(&'-').is_some();
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let text = match directive {
            'Y' => year.to_string(),
            'y' => num(year.rem_euclid(100), 2),
            'm' => num(month, 2),
            'd' => num(day, 2),
            'e' => format!("{day:>2}"),
            'H' => num(hour, 2),
            'I' => num(hour12, 2),
            'M' => num(minute, 2),
            'S' => num(second, 2),
            'j' => num(day_of_year, 3),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'B' => MONTHS[month as usize - 1].to_string(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => format!("%{}{other}", if unpadded { "-" } else { "" }),
        };
        out.push_str(&text);
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
pub(crate) fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `AssistantTracker` extension adds `{% generation %}…{% endgeneration %}` to
/// mark assistant text; for rendering it is a plain block. minijinja has no custom tags, so the
/// tags become `{% if true %}…{% endif %}`, keeping their whitespace-control markers.
fn replace_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..end];
        let body = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+']);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(new_body) => out.push_str(&tag[..end + 2].replacen(body.trim(), new_body, 1)),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> String {
        ChatTemplate::new(source)
            .unwrap()
            .render(&messages, None, false, &json!({}))
            .unwrap()
    }

    #[test]
    fn templates_and_tokenizers_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<tokenizers::Tokenizer>();
    }

    #[test]
    fn strftime_formats_known_instants() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc(t, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(strftime_utc(t, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            strftime_utc(t, "%A, %B %-d, %I %p, day %j"),
            "Thursday, February 29, 01 PM, day 060"
        );
        assert_eq!(
            strftime_utc(0, "%a %F %T %Z %%"),
            "Thu 1970-01-01 00:00:00 UTC %"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let template = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let err = template
            .render(&json!([]), None, false, &json!({}))
            .unwrap_err();
        assert!(format!("{err:#}").contains("no system role"), "{err:#}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            json!([{"a": "<é>", "b": [1, 2.0]}]),
        );
        assert_eq!(
            out,
            "{\"a\": \"<é>\", \"b\": [1, 2.0]}|{\n  \"a\": \"<é>\",\n  \"b\": [\n    1,\n    2.0\n  ]\n}"
        );
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let source = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n";
        let out = render(source, json!([{"role": "user", "content": "hi"}]));
        assert_eq!(out, "[hi]\n");
    }

    #[test]
    fn python_methods_and_slices_work() {
        let source = "{% for m in messages[::-1] %}{{ m.content.strip().split(',')[0].upper() }}{{ m.content.startswith(' a') }}{% endfor %}";
        let out = render(source, json!([{"content": " a,b "}, {"content": "c"}]));
        assert_eq!(out, "CFalseATrue");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let source =
            "{%- generation -%} x {%- endgeneration %}|{% generation %}y{% endgeneration %}";
        assert_eq!(render(source, json!([])), "x|y");
    }

    #[test]
    fn literal_braces_inside_strings_are_text() {
        let out = render(r#"{{- "{{\"name\": 1}}" }}"#, json!([]));
        assert_eq!(out, r#"{{"name": 1}}"#);
    }
}
