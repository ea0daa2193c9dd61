//! Structured outputs: a grammar that every sampled token must keep satisfiable (OpenAI's
//! `response_format` `json_object` / `json_schema`).
//!
//! [llguidance](https://github.com/guidance-ai/llguidance) does the work (it is what
//! llama.cpp, vLLM and SGLang use for the same job): a JSON Schema becomes a grammar, and each
//! step it computes the set of tokens that can still lead to a valid document — a bitmask over
//! the vocabulary, ~0.1–1 ms for 152K tokens. The sampler sets every other logit to `-inf`
//! before anything else reads the row, so greedy, sampling, log-probabilities and speculative
//! verification all see the constrained distribution, and a rejected draft token is simply
//! one the mask removed.
//!
//! When the document is complete the mask allows only end-of-sequence, which the grammar
//! knows as one token; every stop token of the model is allowed then (the chat end token and
//! the text end token both end the request).

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use super::lazy_calls::LazyCalls;
use super::sampler::SamplingError;

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// Any JSON object.
    JsonObject,
    /// A JSON value valid against this JSON Schema.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this Lark grammar (llguidance's dialect): forced tool calls.
    ToolCalls(String),
    /// Tool calls under `tool_choice: "auto"`: free text until the model opens a call, which
    /// then follows one of these Lark grammars (see [`super::lazy_calls`]): `tagged` from a
    /// `<tool_call>` tag on, `bare` from the reply's start (a bare or fenced JSON call).
    LazyToolCalls { tagged: String, bare: String },
    /// Text of this Lark grammar (llguidance's dialect): vLLM's `guided_grammar` and
    /// llama.cpp's `grammar`, GBNF translated by [`super::gbnf`].
    Lark(String),
}

impl OutputFormat {
    /// The request field a refusal of this format names: `tools` for forced tool calls, else
    /// `response_format` (the API layer renames it to the field the format came from).
    pub fn param(&self) -> &'static str {
        match self {
            OutputFormat::ToolCalls(_) | OutputFormat::LazyToolCalls { .. } => "tools",
            _ => "response_format",
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        let mut schema = match self {
            OutputFormat::JsonObject => serde_json::json!({"type": "object"}),
            OutputFormat::JsonSchema(s) => s.clone(),
            OutputFormat::ToolCalls(lark) | OutputFormat::Lark(lark) => {
                return TopLevelGrammar::from_lark(lark.clone())
            }
            // Compiled as its two grammars by `Grammars::constraint`.
            OutputFormat::LazyToolCalls { tagged, .. } => {
                return TopLevelGrammar::from_lark(tagged.clone())
            }
            OutputFormat::Regex(rx) => return TopLevelGrammar::from_regex(rx),
            OutputFormat::Choice(options) => {
                // Lark string literals use JSON string syntax.
                let literals: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).expect("a string serialises"))
                    .collect();
                return TopLevelGrammar::from_lark(format!("start: {}", literals.join(" | ")));
            }
        };
        prepare_json_schema(&mut schema);
        TopLevelGrammar::from_json_schema(schema)
    }
}

/// A JSON Schema as the grammar compiles it: objects closed ([`close_objects`]) and whitespace
/// bounded. A schema's own `x-guidance` options win.
pub fn prepare_json_schema(schema: &mut serde_json::Value) {
    close_objects(schema);
    bound_whitespace(schema);
}

/// Whitespace between JSON tokens is free (so models write the JSON they are used to) but
/// bounded: an unbounded run lets a small model pad with newlines until `max_tokens`, a failure
/// llama.cpp's JSON grammar also bounds against.
fn bound_whitespace(schema: &mut serde_json::Value) {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,20}",
                "item_separator": ",",
                "key_separator": ":",
            })
        });
    }
}

/// Keywords whose value is a subschema, and those whose value maps names or positions to
/// subschemas (`allOf` is left out on purpose: see [`close_objects`]).
const SUBSCHEMA: [&str; 9] = [
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "unevaluatedItems",
];
const SUBSCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
const SUBSCHEMA_LISTS: [&str; 3] = ["anyOf", "oneOf", "prefixItems"];

/// An object schema that lists `properties` but says nothing of others admits only those (as
/// llama.cpp's grammars, vLLM's xgrammar and Ollama read schemas): JSON Schema's default
/// (any other property too) lets a small model add made-up keys until `max_tokens`, and no
/// client that sends a schema wants keys it did not declare. `additionalProperties: true` (or
/// `patternProperties`, `unevaluatedProperties`) keeps them open. The branches of an `allOf`
/// are not closed one by one, since each would then refuse the others' properties.
pub fn close_objects(schema: &mut serde_json::Value) {
    use serde_json::Value;
    let Some(object) = schema.as_object_mut() else {
        if let Value::Array(items) = schema {
            // `items` as a list (draft 4 tuples).
            items.iter_mut().for_each(close_objects);
        }
        return;
    };
    let open = [
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    ]
    .iter()
    .any(|k| object.contains_key(*k));
    if object.get("properties").is_some_and(Value::is_object) && !open {
        object.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in SUBSCHEMA {
        if let Some(sub) = object.get_mut(key) {
            close_objects(sub);
        }
    }
    for key in SUBSCHEMA_MAPS {
        if let Some(Value::Object(map)) = object.get_mut(key) {
            map.values_mut().for_each(close_objects);
        }
    }
    for key in SUBSCHEMA_LISTS {
        if let Some(Value::Array(list)) = object.get_mut(key) {
            list.iter_mut().for_each(close_objects);
        }
    }
}

/// Compiles grammars for one model's vocabulary. Built on first use (the token trie of a
/// 152K vocabulary takes a moment) and shared by every request.
pub struct Grammars {
    tokenizer: Arc<tokenizers::Tokenizer>,
    vocab_size: usize,
    stop_tokens: Arc<[u32]>,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Grammars {
    /// `vocab_size` is the width of the model's logits (it may exceed the tokenizer's).
    pub fn new(
        tokenizer: Arc<tokenizers::Tokenizer>,
        vocab_size: usize,
        stop_tokens: &[u32],
    ) -> Self {
        Self {
            tokenizer,
            vocab_size,
            stop_tokens: stop_tokens.into(),
            factory: OnceLock::new(),
        }
    }

    /// Builds the token trie now (about a second for a 152K vocabulary), so that the first
    /// request with a format does not wait for it. Blocking; a `constraint` call meanwhile
    /// waits for this one.
    pub fn prepare(&self) -> Result<(), String> {
        self.factory().map(|_| ())
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| self.build_factory().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| format!("structured outputs are unavailable for this model: {e}"))
    }

    /// A fresh constraint for one sequence, or why `format` cannot be enforced (an invalid or
    /// unsupported schema). Blocking: compiling a large schema can take milliseconds.
    pub fn constraint(&self, format: &OutputFormat) -> Result<TokenConstraint, String> {
        let factory = self.factory()?;
        let matcher = |grammar: TopLevelGrammar| {
            let parser = factory.create_parser(grammar).map_err(|e| e.to_string())?;
            let matcher = Matcher::new(Ok(parser));
            match matcher.get_error() {
                Some(e) => Err(e),
                None => Ok(matcher),
            }
        };
        let kind = match format {
            OutputFormat::LazyToolCalls { tagged, bare } => Kind::Lazy(Box::new(LazyCalls::new(
                matcher(TopLevelGrammar::from_lark(tagged.clone()))?,
                matcher(TopLevelGrammar::from_lark(bare.clone()))?,
                factory.tok_env().clone(),
            ))),
            _ => Kind::Eager(Box::new(matcher(format.grammar())?)),
        };
        Ok(TokenConstraint {
            kind,
            eos: factory.tok_env().tok_trie().eos_token(),
            stop_tokens: self.stop_tokens.clone(),
        })
    }

    fn build_factory(&self) -> anyhow::Result<ParserFactory> {
        let json = serde_json::to_value(self.tokenizer.as_ref())?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        anyhow::ensure!(
            words.len() <= self.vocab_size,
            "the tokenizer has {} tokens, more than the model's {} logits",
            words.len(),
            self.vocab_size
        );
        // Ids the tokenizer does not use (padding of the logits) stay empty: never allowed.
        words.resize(self.vocab_size, Vec::new());
        let eos = *self
            .stop_tokens
            .first()
            .ok_or_else(|| anyhow::anyhow!("the model has no stop token"))?;
        let info = TokRxInfo::new(self.vocab_size as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(factory)
    }
}

/// One sequence's grammar state: which tokens may come next.
pub struct TokenConstraint {
    kind: Kind,
    /// The grammar's end-of-sequence token (the model's first stop token).
    eos: u32,
    stop_tokens: Arc<[u32]>,
}

enum Kind {
    /// The grammar holds from the first token.
    Eager(Box<Matcher>),
    /// It holds once the model opens a tool call.
    Lazy(Box<LazyCalls>),
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.kind {
            Kind::Eager(m) => format!("stopped: {}", m.is_stopped()),
            Kind::Lazy(l) => format!("lazy, active: {}", l.is_active()),
        };
        f.debug_struct("TokenConstraint")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl TokenConstraint {
    /// Whether the next token is constrained at all (a lazy grammar is not until the model
    /// opens a call): the sampler leaves the logits untouched, uncopied, when it is not.
    pub fn is_active(&self) -> bool {
        match &self.kind {
            Kind::Eager(_) => true,
            Kind::Lazy(l) => l.is_active(),
        }
    }

    fn matcher(&mut self) -> Option<&mut Matcher> {
        match &mut self.kind {
            Kind::Eager(m) => Some(m),
            Kind::Lazy(l) => l.active(),
        }
    }

    /// Sets the logit of every token the grammar does not allow next to `-inf`. When the
    /// document may end and nothing allowed is left (a `logit_bias` banned the stop tokens),
    /// it ends: a complete document is never turned into a failed request.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), SamplingError> {
        let Some(matcher) = self.matcher() else {
            return Ok(());
        };
        let allowed = matcher.compute_mask_or_eos().map_err(failed)?;
        let end_allowed = allowed.is_allowed(self.eos);
        let mut any_left = false;
        for (token, logit) in logits.iter_mut().enumerate() {
            let token = token as u32;
            let ok =
                allowed.is_allowed(token) || (end_allowed && self.stop_tokens.contains(&token));
            if !ok {
                *logit = f32::NEG_INFINITY;
            }
            any_left |= *logit > f32::NEG_INFINITY;
        }
        if end_allowed && !any_left {
            if let Some(end) = logits.get_mut(self.eos as usize) {
                *end = 0.0;
            }
        }
        Ok(())
    }

    /// Advances past `token`, which [`TokenConstraint::mask`] allowed.
    pub fn consume(&mut self, token: u32) -> Result<(), SamplingError> {
        if self.stop_tokens.contains(&token) {
            // The sequence ends here; nothing reads the grammar again.
            return Ok(());
        }
        match &mut self.kind {
            Kind::Eager(m) => m.consume_token(token).map_err(failed),
            Kind::Lazy(l) => match l.active() {
                Some(m) => m.consume_token(token).map_err(failed),
                None => {
                    l.observe(token);
                    Ok(())
                }
            },
        }
    }
}

fn failed(e: anyhow::Error) -> SamplingError {
    SamplingError::Constraint(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::close_objects;
    use serde_json::json;

    #[test]
    fn objects_with_properties_are_closed_wherever_they_nest() {
        let mut schema = json!({
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
                "tags": {"type": "array", "items": {"properties": {"b": {}}}},
                "maybe": {"anyOf": [{"$ref": "#/$defs/Inner"}, {"type": "null"}]},
                "free": {"type": "object", "properties": {"c": {}}, "additionalProperties": true},
                "map": {"type": "object"},
            },
            "$defs": {"Inner": {"type": "object", "properties": {"d": {}}}},
            "allOf": [{"properties": {"e": {}}}],
        });
        close_objects(&mut schema);
        assert_eq!(schema["additionalProperties"], json!(false));
        let props = &schema["properties"];
        // A property named `properties` is a property, not a keyword.
        assert!(props.get("additionalProperties").is_none());
        assert_eq!(props["properties"]["additionalProperties"], json!(false));
        assert_eq!(props["tags"]["items"]["additionalProperties"], json!(false));
        assert_eq!(
            schema["$defs"]["Inner"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(props["free"]["additionalProperties"], json!(true));
        assert!(props["map"].get("additionalProperties").is_none());
        assert!(schema["allOf"][0].get("additionalProperties").is_none());
    }
}
