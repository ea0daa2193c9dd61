//! Responses `tools` and `tool_choice` → the chat-completions tools the model's template is
//! given, and the names its calls come back under.
//!
//! - `function` tools are offered as they are;
//! - `namespace` tools (Codex's `multi_agent_v1`: a named group of function tools) are offered
//!   as their functions, each under its own name, or as `namespace.name` where two tools
//!   would share a name; a call of one comes back as a `function_call` item with the
//!   function's `name` and the group's `namespace`, which is how Codex routes it;
//! - tools the server would have to run itself (`web_search`, `file_search`,
//!   `code_interpreter`, `image_generation`, `computer_use_preview`, `mcp`, …) are left out of
//!   the prompt, with a log line, instead of failing the request: clients such as Codex always
//!   declare them. A `tool_choice` that forces one is refused.

use super::super::errors::ApiError;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// The tools of a request as the template gets them.
#[derive(Debug, Clone, Default)]
pub struct ResponseTools {
    /// Chat-completions function tools, in the request's order.
    pub chat: Vec<Value>,
    /// Which offered names stand for a namespace's function.
    pub namespaces: ToolNamespaces,
    /// The types of the tools left out (run by OpenAI's servers, not this one).
    pub hosted: Vec<String>,
}

impl ResponseTools {
    /// The names the model is offered.
    pub fn names(&self) -> Vec<&str> {
        self.chat
            .iter()
            .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
            .collect()
    }
}

/// Offered name ↔ (namespace, function name) for the functions of `namespace` tools.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolNamespaces {
    by_offered: HashMap<String, (String, String)>,
}

impl ToolNamespaces {
    /// A call's `(name, namespace)` as the client declared them, from the name the model used.
    pub fn split(&self, offered: &str) -> (String, Option<String>) {
        match self.by_offered.get(offered) {
            Some((namespace, name)) => (name.clone(), Some(namespace.clone())),
            None => (offered.to_string(), None),
        }
    }

    /// The name the model was offered for `name` in `namespace` (a call item sent back in
    /// `input`, or one of the response's own calls).
    pub fn offered(&self, namespace: Option<&str>, name: &str) -> String {
        let Some(namespace) = namespace else {
            return name.to_string();
        };
        self.by_offered
            .iter()
            .find(|(_, (ns, n))| ns == namespace && n == name)
            .map(|(offered, _)| offered.clone())
            .unwrap_or_else(|| name.to_string())
    }
}

/// Reads `tools`: function and namespace tools become chat tools; hosted tools are set aside.
pub fn chat_tools(tools: &[Value]) -> Result<ResponseTools, ApiError> {
    // (offered-name candidate, namespace, the function object), in order.
    let mut functions: Vec<(Option<String>, Map<String, Value>, String)> = Vec::new();
    let mut hosted = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        match tool.get("type").and_then(Value::as_str).unwrap_or("") {
            "function" => {
                let (name, f) = function(tool, &format!("tools[{i}]"))?;
                functions.push((None, f, name));
            }
            "namespace" => {
                let namespace = tool.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(
                        Some(&format!("tools[{i}].name")),
                        "a namespace tool needs a `name`",
                    )
                })?;
                let inner = tool.get("tools").and_then(Value::as_array).ok_or_else(|| {
                    ApiError::invalid(
                        Some(&format!("tools[{i}].tools")),
                        "a namespace tool needs its `tools` (a list of function tools)",
                    )
                })?;
                for (j, t) in inner.iter().enumerate() {
                    let at = format!("tools[{i}].tools[{j}]");
                    if t.get("type").and_then(Value::as_str).unwrap_or("function") != "function" {
                        return Err(ApiError::invalid(
                            Some(&format!("{at}.type")),
                            "a namespace holds function tools only",
                        ));
                    }
                    let (name, f) = function(t, &at)?;
                    functions.push((Some(namespace.to_string()), f, name));
                }
            }
            "" => {
                return Err(ApiError::invalid(
                    Some(&format!("tools[{i}].type")),
                    "every tool needs a `type` (`function` for the tools the client runs)",
                ))
            }
            kind => hosted.push(kind.to_string()),
        }
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (_, _, name) in &functions {
        *seen.entry(name).or_default() += 1;
    }
    let mut out = ResponseTools {
        hosted,
        ..ResponseTools::default()
    };
    let mut offered_names = std::collections::HashSet::new();
    for (namespace, mut f, name) in functions.iter().cloned() {
        let offered = match &namespace {
            Some(ns) if seen[name.as_str()] > 1 => format!("{ns}.{name}"),
            _ => name.clone(),
        };
        if !offered_names.insert(offered.clone()) {
            return Err(ApiError::invalid(
                Some("tools"),
                format!("two tools are both named `{offered}`"),
            ));
        }
        if let Some(ns) = namespace {
            out.namespaces
                .by_offered
                .insert(offered.clone(), (ns, name));
        }
        f.insert("name".into(), json!(offered));
        out.chat.push(json!({"type": "function", "function": f}));
    }
    if !out.hosted.is_empty() {
        tracing::info!(
            hosted = out.hosted.join(", "),
            "hosted tools left out of the prompt: this server runs none of them"
        );
    }
    Ok(out)
}

/// A function tool (Responses shape, or chat's `function: {...}`) as the template's function
/// object, and its name.
fn function(tool: &Value, at: &str) -> Result<(String, Map<String, Value>), ApiError> {
    let f = tool.get("function").unwrap_or(tool);
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            Some(&format!("{at}.name")),
            "a function tool needs a `name`",
        )
    })?;
    let mut function = Map::new();
    function.insert("name".into(), json!(name));
    for key in ["description", "parameters"] {
        if let Some(v) = f.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), v.clone());
        }
    }
    Ok((name.to_string(), function))
}

/// How `tool_choice` shapes the prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    Auto,
    None,
    Required,
    Named(String),
}

/// `"auto" | "none" | "required" | {"type": "function", "name"}` (the chat shape
/// `{"function": {"name"}}` is accepted too). A hosted tool's type (`{"type": "web_search"}`)
/// is refused: this server cannot run it.
pub fn tool_mode(choice: Option<&Value>, tools: &ResponseTools) -> Result<ToolMode, ApiError> {
    let names = tools.names();
    let invalid = |msg: String| ApiError::invalid(Some("tool_choice"), msg);
    let mode = match choice {
        None | Some(Value::Null) => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolMode::Auto,
            "none" => ToolMode::None,
            "required" => ToolMode::Required,
            other => {
                return Err(invalid(format!(
                    "`tool_choice` must be auto, none, required or a named function, got `{other}`"
                )))
            }
        },
        Some(v) => {
            let kind = v.get("type").and_then(Value::as_str).unwrap_or("function");
            if kind != "function" {
                return Err(ApiError::invalid(
                    Some("tool_choice.type"),
                    format!(
                        "`tool_choice` forces the hosted tool `{kind}`, which this server does \
                         not run; only `function` tools can be forced"
                    ),
                )
                .with_code("unsupported_tool"));
            }
            let name = v
                .get("name")
                .or_else(|| v.pointer("/function/name"))
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("`tool_choice` object needs a function `name`".into()))?;
            let namespace = v.get("namespace").and_then(Value::as_str);
            let offered = tools.namespaces.offered(namespace, name);
            if !names.contains(&offered.as_str()) {
                return Err(ApiError::invalid(
                    Some("tool_choice.name"),
                    format!("`tool_choice` names `{name}`, which is not among `tools`"),
                ));
            }
            ToolMode::Named(offered)
        }
    };
    if mode == ToolMode::Required && names.is_empty() {
        let why = if tools.hosted.is_empty() {
            "no `tools` were given".to_string()
        } else {
            format!(
                "the only tools given are hosted ({}), which this server does not run",
                tools.hosted.join(", ")
            )
        };
        return Err(invalid(format!("`tool_choice` is `required` but {why}")));
    }
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str) -> Value {
        json!({"type": "function", "name": name, "parameters": {"type": "object"}})
    }

    #[test]
    fn codex_tools_offer_the_functions_and_leave_out_hosted_ones() {
        let tools = chat_tools(&[
            f("exec_command"),
            json!({"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                "tools": [f("spawn_agent"), f("wait_agent")]}),
            json!({"type": "web_search", "external_web_access": false}),
        ])
        .unwrap();
        assert_eq!(tools.names(), ["exec_command", "spawn_agent", "wait_agent"]);
        assert_eq!(tools.hosted, ["web_search"]);
        assert_eq!(
            tools.namespaces.split("wait_agent"),
            ("wait_agent".into(), Some("multi_agent_v1".into()))
        );
        assert_eq!(
            tools.namespaces.split("exec_command"),
            ("exec_command".into(), None)
        );
        assert_eq!(
            tools
                .namespaces
                .offered(Some("multi_agent_v1"), "wait_agent"),
            "wait_agent"
        );
        assert_eq!(tool_mode(None, &tools).unwrap(), ToolMode::Auto);
        let e = tool_mode(Some(&json!({"type": "web_search"})), &tools).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.type"));
        assert_eq!(e.code, Some("unsupported_tool"));
        let named =
            json!({"type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"});
        assert_eq!(
            tool_mode(Some(&named), &tools).unwrap(),
            ToolMode::Named("wait_agent".into())
        );
    }

    #[test]
    fn a_name_two_tools_share_is_qualified_by_its_namespace() {
        let tools = chat_tools(&[
            f("close"),
            json!({"type": "namespace", "name": "agents", "tools": [f("close")]}),
        ])
        .unwrap();
        assert_eq!(tools.names(), ["close", "agents.close"]);
        assert_eq!(
            tools.namespaces.split("agents.close"),
            ("close".into(), Some("agents".into()))
        );
        assert_eq!(
            tools.namespaces.offered(Some("agents"), "close"),
            "agents.close"
        );
        assert_eq!(tools.namespaces.offered(None, "close"), "close");
        let twice = chat_tools(&[f("x"), f("x")]).unwrap_err();
        assert_eq!(twice.param.as_deref(), Some("tools"));
    }

    #[test]
    fn only_hosted_tools_cannot_be_required() {
        let tools = chat_tools(&[json!({"type": "file_search"})]).unwrap();
        assert!(tools.chat.is_empty());
        let e = tool_mode(Some(&json!("required")), &tools).unwrap_err();
        assert!(e.message.contains("file_search"), "{}", e.message);
        let e = chat_tools(&[json!({"name": "f"})]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = chat_tools(&[json!({"type": "namespace", "name": "n"})]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].tools"));
    }
}
