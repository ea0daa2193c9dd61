//! Streaming parser of the model's text into content, reasoning and tool calls.
//!
//! Qwen/Hermes models write a tool call as
//! `<tool_call>\n{"name": "write", "arguments": {...}}\n</tool_call>`, and reasoning models
//! write `<think>…</think>`. Text arrives in arbitrary fragments; the parser turns it into
//! [`Piece`]s: content, reasoning, the start of a tool call (`id`, `name`), and fragments of its
//! `arguments` exactly as the model writes them (concatenated, they are the arguments JSON).
//!
//! Rules:
//! - The text of a tool-call block never reaches content; a partial tag at the end of a
//!   fragment is held back until it is decided.
//! - A block whose header (`{"name": "…", "arguments":`) is well formed and whose arguments
//!   are an object is streamed as it is written, and stays a tool call.
//! - Any other block is buffered to its end and parsed whole: a JSON object with a string
//!   `name` and `arguments` becomes a tool call, anything else (malformed) falls back to plain
//!   content, tags included. Never an error.
//! - With `single_call` (`parallel_tool_calls: false`) blocks after the first call are dropped.
//! - Given the declared tool names ([`ToolCallParser::with_tool_names`]), a reply that starts
//!   with an untagged call (bare or fenced JSON, see [`super::bare_tool_calls`]) is held until
//!   decided, then becomes a call or content; so is a line of the reply that starts one (small
//!   models introduce calls with a line of their own, `<result>` or prose: what comes before
//!   stays content). A line that starts with `{` or a fence is held only until its first key
//!   or its fence's language tells it is no call.

use super::bare_tool_calls::{bare_call, BareCall};
use super::types::{FunctionCall, ToolCall};
use rand::distr::{Alphanumeric, SampleString};
use serde_json::Value;

pub(crate) const OPEN_TOOL: &str = "<tool_call>";
const CLOSE_TOOL: &str = "</tool_call>";
const OPEN_THINK: &str = "<think>";
const CLOSE_THINK: &str = "</think>";

/// A decided piece of output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArgs {
        index: usize,
        fragment: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Text,
    Think,
    /// Inside a block, before its header is decided.
    Header,
    /// Streaming the arguments object.
    Args,
    /// Arguments done; skipping to the closing tag.
    Tail,
    /// Collecting the whole block to parse it at its end.
    Buffered,
    /// A block after the first call when only one is allowed.
    Dropped,
    /// Holding text that may be an untagged call.
    Bare,
}

#[derive(Debug, Clone)]
pub struct ToolCallParser {
    parse_tools: bool,
    single_call: bool,
    state: State,
    pending: String,
    /// Raw text of the current block since its open tag (for buffered parsing / fallback).
    block: String,
    current: Option<ToolCall>,
    scan: ArgScan,
    calls: Vec<ToolCall>,
    /// Strip leading newlines of the content that follows `</think>`.
    after_think: bool,
    /// Declared tools, for untagged calls (none: untagged calls are not recognised).
    tool_names: Vec<String>,
    /// No content but whitespace since the start or the last call: an untagged call may begin.
    bare_allowed: bool,
}

impl ToolCallParser {
    /// `parse_tools`: whether tool calls are recognised at all (the request offered tools).
    pub fn new(parse_tools: bool, single_call: bool) -> Self {
        Self {
            parse_tools,
            single_call,
            state: State::Text,
            pending: String::new(),
            block: String::new(),
            current: None,
            scan: ArgScan::default(),
            calls: Vec::new(),
            after_think: false,
            tool_names: Vec::new(),
            bare_allowed: true,
        }
    }

    /// Also recognises untagged calls of these tools at the start of the reply.
    pub fn with_tool_names(mut self, names: Vec<String>) -> Self {
        self.tool_names = names;
        self
    }

    /// The tool calls completed so far.
    pub fn tool_calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Whether any tool call has started (decides `finish_reason: tool_calls`).
    pub fn has_tool_calls(&self) -> bool {
        !self.calls.is_empty() || (self.current.is_some() && self.scan.announced)
    }

    /// Feeds a fragment of model output; returns what can be decided now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        merge(out)
    }

    /// The output ended: flushes everything held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        self.flush(&mut out);
        merge(out)
    }

    /// One transition; `true` when it made progress.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.state {
            State::Text => self.step_text(out),
            State::Think => self.step_think(out),
            State::Header => self.step_header(),
            State::Args => self.step_args(out),
            State::Tail | State::Dropped => self.step_skip(),
            State::Buffered => self.step_buffered(out),
            State::Bare => self.step_bare(out, false),
        }
    }

    fn step_text(&mut self, out: &mut Vec<Piece>) -> bool {
        if self.bare_allowed && self.parse_tools && !self.tool_names.is_empty() {
            let body = self.pending.trim_start();
            if body.is_empty() {
                return false; // whitespace: wait to see what follows
            }
            if body.starts_with(['{', '`']) {
                self.block.clear();
                self.state = State::Bare;
                return true;
            }
            self.bare_allowed = false;
        }
        let mut tags = vec![OPEN_THINK];
        if self.parse_tools {
            tags.push(OPEN_TOOL);
        }
        let found = tags
            .iter()
            .filter_map(|t| self.pending.find(t).map(|at| (at, *t)))
            .min();
        let bare_lines = self.parse_tools && !self.tool_names.is_empty();
        let line_call = bare_lines.then(|| line_call_start(&self.pending)).flatten();
        if let Some(at) = line_call.filter(|&at| found.is_none_or(|(tag_at, _)| at < tag_at)) {
            let before: String = self.pending.drain(..at).collect();
            self.emit_content(&before, out);
            self.block.clear();
            self.state = State::Bare;
            return true;
        }
        if let Some((at, tag)) = found {
            let before: String = self.pending.drain(..at).collect();
            if !(self.has_tool_calls() && before.trim().is_empty()) {
                self.emit_content(&before, out);
            }
            self.pending.drain(..tag.len());
            self.block.clear();
            self.state = match tag {
                OPEN_THINK => State::Think,
                _ if self.single_call && !self.calls.is_empty() => State::Dropped,
                _ => State::Header,
            };
            return true;
        }
        let mut keep = tags
            .iter()
            .map(|t| suffix_prefix_len(&self.pending, t))
            .max()
            .unwrap_or(0);
        if bare_lines {
            keep = keep.max(open_line_len(&self.pending));
        }
        let cut = self.pending.len() - keep;
        // After a tool call, whitespace alone is held until something else follows.
        if self.has_tool_calls() && self.pending[..cut].trim().is_empty() {
            return false;
        }
        let text: String = self.pending.drain(..cut).collect();
        self.emit_content(&text, out);
        false
    }

    fn emit_content(&mut self, text: &str, out: &mut Vec<Piece>) {
        let text = if self.after_think {
            let t = text.trim_start_matches(['\n', '\r']);
            if !t.is_empty() {
                self.after_think = false;
            }
            t
        } else {
            text
        };
        if !text.is_empty() {
            out.push(Piece::Content(text.to_string()));
        }
        if !text.trim().is_empty() {
            self.bare_allowed = false;
        }
    }

    /// Holds text while it may be an untagged call; `at_end`: the output is over.
    fn step_bare(&mut self, out: &mut Vec<Piece>, at_end: bool) -> bool {
        self.block.push_str(&std::mem::take(&mut self.pending));
        match bare_call(&self.block, &self.tool_names, at_end) {
            BareCall::Undecided => false,
            BareCall::NotACall => {
                self.bare_allowed = false;
                self.state = State::Text;
                self.pending = std::mem::take(&mut self.block);
                true
            }
            BareCall::Call {
                name,
                arguments,
                consumed,
            } => {
                self.pending = self.block.split_off(consumed);
                self.block.clear();
                self.state = State::Text;
                if !self.single_call || self.calls.is_empty() {
                    self.push_whole_call(name, arguments, out);
                }
                true
            }
        }
    }

    fn step_think(&mut self, out: &mut Vec<Piece>) -> bool {
        if let Some(at) = self.pending.find(CLOSE_THINK) {
            let text: String = self.pending.drain(..at).collect();
            self.pending.drain(..CLOSE_THINK.len());
            if !text.is_empty() {
                out.push(Piece::Reasoning(text));
            }
            self.state = State::Text;
            self.after_think = true;
            return true;
        }
        let cut = self.pending.len() - suffix_prefix_len(&self.pending, CLOSE_THINK);
        if cut > 0 {
            out.push(Piece::Reasoning(self.pending.drain(..cut).collect()));
        }
        false
    }

    fn step_header(&mut self) -> bool {
        // Take text up to a closing tag (left in `pending`) or a possible partial one.
        let closed_at = self.pending.find(CLOSE_TOOL);
        let cut = closed_at
            .unwrap_or_else(|| self.pending.len() - suffix_prefix_len(&self.pending, CLOSE_TOOL));
        self.block.extend(self.pending.drain(..cut));
        match parse_header(&self.block) {
            Header::Incomplete if closed_at.is_none() => false,
            Header::Incomplete | Header::Invalid => {
                self.state = State::Buffered;
                true
            }
            Header::Complete { name, args_start } => {
                // Announced when the arguments turn out to be an object (`step_args`).
                let rest = self.block.split_off(args_start);
                self.pending.insert_str(0, &rest);
                self.current = Some(ToolCall {
                    id: new_call_id(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: Value::String(String::new()),
                    },
                });
                self.scan = ArgScan::default();
                self.state = State::Args;
                true
            }
        }
    }

    fn step_args(&mut self, out: &mut Vec<Piece>) -> bool {
        let mut fragment = String::new();
        let mut consumed = 0;
        let mut next_state = None;
        for (i, c) in self.pending.char_indices() {
            if c == '<' && !self.scan.in_string && self.scan.started {
                let rest = &self.pending[i..];
                if rest.starts_with(CLOSE_TOOL) {
                    // The block closed before its arguments did: keep what was written.
                    consumed = i + CLOSE_TOOL.len();
                    next_state = Some(State::Text);
                    break;
                }
                if CLOSE_TOOL.starts_with(rest) {
                    consumed = i;
                    break; // undecided: wait for more text
                }
            }
            match self.scan.feed(c) {
                Scan::Skip => self.block.push(c),
                Scan::NotObject => {
                    // Not an object: parse the block whole at its end.
                    consumed = i;
                    next_state = Some(State::Buffered);
                    break;
                }
                Scan::Continue => {
                    if !self.scan.announced {
                        self.scan.announced = true;
                        self.announce(out);
                    }
                    fragment.push(c);
                }
                Scan::Done => {
                    fragment.push(c);
                    consumed = i + c.len_utf8();
                    next_state = Some(State::Tail);
                    break;
                }
            }
            consumed = i + c.len_utf8();
        }
        self.pending.drain(..consumed);
        if !fragment.is_empty() {
            self.block.push_str(&fragment);
            self.push_args(&fragment, out);
        }
        match next_state {
            Some(State::Text) => {
                self.finish_call();
                self.state = State::Text;
                true
            }
            Some(State::Buffered) => {
                // Nothing was announced yet (only whitespace was skipped).
                self.current = None;
                self.state = State::Buffered;
                true
            }
            Some(s) => {
                self.state = s;
                true
            }
            None => false,
        }
    }

    fn announce(&self, out: &mut Vec<Piece>) {
        if let Some(call) = &self.current {
            out.push(Piece::ToolCallStart {
                index: self.calls.len(),
                id: call.id.clone(),
                name: call.function.name.clone(),
            });
        }
    }

    fn push_args(&mut self, fragment: &str, out: &mut Vec<Piece>) {
        if let Some(call) = &mut self.current {
            if let Value::String(args) = &mut call.function.arguments {
                args.push_str(fragment);
            }
        }
        out.push(Piece::ToolCallArgs {
            index: self.calls.len(),
            fragment: fragment.to_string(),
        });
    }

    fn step_skip(&mut self) -> bool {
        if let Some(at) = self.pending.find(CLOSE_TOOL) {
            self.pending.drain(..at + CLOSE_TOOL.len());
            self.finish_call();
            self.state = State::Text;
            return true;
        }
        let cut = self.pending.len() - suffix_prefix_len(&self.pending, CLOSE_TOOL);
        self.pending.drain(..cut);
        false
    }

    fn step_buffered(&mut self, out: &mut Vec<Piece>) -> bool {
        if let Some(at) = self.pending.find(CLOSE_TOOL) {
            self.block.extend(self.pending.drain(..at));
            self.pending.drain(..CLOSE_TOOL.len());
            self.end_buffered_block(out);
            return true;
        }
        let cut = self.pending.len() - suffix_prefix_len(&self.pending, CLOSE_TOOL);
        self.block.extend(self.pending.drain(..cut));
        false
    }

    /// A whole block is in `block`: a tool call if it parses, content otherwise.
    fn end_buffered_block(&mut self, out: &mut Vec<Piece>) {
        self.state = State::Text;
        let block = std::mem::take(&mut self.block);
        match parse_whole(&block) {
            Some((name, arguments)) => self.push_whole_call(name, arguments, out),
            None => out.push(Piece::Content(format!("{OPEN_TOOL}{block}{CLOSE_TOOL}"))),
        }
    }

    /// A call decided whole: its start and all of its arguments at once.
    fn push_whole_call(&mut self, name: String, arguments: String, out: &mut Vec<Piece>) {
        let index = self.calls.len();
        let id = new_call_id();
        out.push(Piece::ToolCallStart {
            index,
            id: id.clone(),
            name: name.clone(),
        });
        out.push(Piece::ToolCallArgs {
            index,
            fragment: arguments.clone(),
        });
        self.calls.push(ToolCall {
            id,
            kind: "function".into(),
            function: FunctionCall {
                name,
                arguments: Value::String(arguments),
            },
        });
        self.bare_allowed = true;
    }

    fn finish_call(&mut self) {
        if let Some(call) = self.current.take() {
            self.calls.push(call);
            self.bare_allowed = true;
        }
    }

    /// End of output: whatever is held is decided now.
    fn flush(&mut self, out: &mut Vec<Piece>) {
        loop {
            while self.step(out) {}
            if self.state != State::Bare {
                break;
            }
            // At the end every held text is decided, so this always makes progress.
            self.step_bare(out, true);
        }
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Text => {
                if !(self.has_tool_calls() && rest.trim().is_empty()) {
                    self.emit_content(&rest, out);
                }
            }
            State::Think => {
                if !rest.is_empty() {
                    out.push(Piece::Reasoning(rest));
                }
            }
            State::Header | State::Buffered => {
                self.block.push_str(&rest);
                let block = std::mem::take(&mut self.block);
                match parse_whole(&block) {
                    Some(_) => {
                        self.block = block;
                        self.end_buffered_block(out);
                    }
                    None => out.push(Piece::Content(format!("{OPEN_TOOL}{block}"))),
                }
            }
            State::Args if !self.scan.announced => {
                self.current = None;
                let block = std::mem::take(&mut self.block);
                out.push(Piece::Content(format!("{OPEN_TOOL}{block}{rest}")));
            }
            State::Args => {
                if !rest.is_empty() {
                    self.push_args(&rest, out);
                }
                self.finish_call();
            }
            State::Tail | State::Dropped => self.finish_call(),
            State::Bare => unreachable!("decided above"),
        }
        self.state = State::Text;
    }
}

/// Joins adjacent pieces of the same kind (fewer, larger SSE chunks).
fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        match (out.last_mut(), p) {
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
            (
                Some(Piece::ToolCallArgs {
                    index: i,
                    fragment: a,
                }),
                Piece::ToolCallArgs {
                    index: j,
                    fragment: b,
                },
            ) if *i == j => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// `call_` and 24 random letters and digits.
pub fn new_call_id() -> String {
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `tag`.
/// Where a line of `text` (after a newline) starts with what may be an untagged call: `{` or a
/// fence, after spaces. The line's leading spaces are part of the call's text.
fn line_call_start(text: &str) -> Option<usize> {
    text.match_indices('\n').find_map(|(i, _)| {
        let line = &text[i + 1..];
        line.trim_start_matches([' ', '\t'])
            .starts_with(['{', '`'])
            .then_some(i + 1)
    })
}

/// Bytes at the end of `text` held back because the next fragment may open a call on a line
/// of their own: a newline and the spaces after it.
fn open_line_len(text: &str) -> usize {
    let spaces = text.len() - text.trim_end_matches([' ', '\t']).len();
    if text[..text.len() - spaces].ends_with('\n') {
        spaces + 1
    } else {
        0
    }
}

fn suffix_prefix_len(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .filter(|&n| n <= text.len() && text.is_char_boundary(text.len() - n))
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

enum Header {
    Incomplete,
    Invalid,
    /// The name, and where the arguments value begins in the block.
    Complete {
        name: String,
        args_start: usize,
    },
}

/// Recognises `{"name": "<name>", "arguments":` (any whitespace) at the start of a block.
fn parse_header(block: &str) -> Header {
    let mut i = 0;
    for expected in ["{", "\"name\"", ":"] {
        match expect(block, &mut i, expected) {
            Some(true) => {}
            Some(false) => return Header::Invalid,
            None => return Header::Incomplete,
        }
    }
    skip_ws(block, &mut i);
    if i >= block.len() {
        return Header::Incomplete;
    }
    if !block[i..].starts_with('"') {
        return Header::Invalid;
    }
    let Some(end) = string_end(&block[i..]) else {
        return Header::Incomplete;
    };
    let Ok(name) = serde_json::from_str::<String>(&block[i..i + end]) else {
        return Header::Invalid;
    };
    i += end;
    for expected in [",", "\"arguments\"", ":"] {
        match expect(block, &mut i, expected) {
            Some(true) => {}
            Some(false) => return Header::Invalid,
            None => return Header::Incomplete,
        }
    }
    Header::Complete {
        name,
        args_start: i,
    }
}

/// After whitespace, `Some(true)` if `lit` follows (and moves past it), `Some(false)` if
/// something else does, `None` if the text ends first.
fn expect(s: &str, i: &mut usize, lit: &str) -> Option<bool> {
    skip_ws(s, i);
    let rest = &s[*i..];
    if rest.starts_with(lit) {
        *i += lit.len();
        Some(true)
    } else if lit.starts_with(rest) {
        None
    } else {
        Some(false)
    }
}

fn skip_ws(s: &str, i: &mut usize) {
    *i += s[*i..].len() - s[*i..].trim_start().len();
}

/// Byte length of the JSON string literal at the start of `s` (quotes included).
fn string_end(s: &str) -> Option<usize> {
    let mut escape = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escape => escape = false,
            '\\' => escape = true,
            '"' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// A whole block as `{"name": string, "arguments": object | string}`.
fn parse_whole(block: &str) -> Option<(String, String)> {
    let value: Value = serde_json::from_str(block.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(v @ Value::Object(_)) => v.to_string(),
        None | Some(Value::Null) => "{}".to_string(),
        Some(_) => return None,
    };
    Some((name, arguments))
}

/// Tracks the structure of a JSON object as it is written, to know where it ends.
#[derive(Debug, Clone, Default)]
struct ArgScan {
    started: bool,
    /// The call's start was emitted.
    announced: bool,
    depth: usize,
    in_string: bool,
    escape: bool,
}

enum Scan {
    /// Whitespace before the value.
    Skip,
    /// The value is not an object.
    NotObject,
    Continue,
    /// The object closed with this character.
    Done,
}

impl ArgScan {
    fn feed(&mut self, c: char) -> Scan {
        if !self.started {
            if c.is_whitespace() {
                return Scan::Skip;
            }
            if c != '{' {
                return Scan::NotObject;
            }
            self.started = true;
            self.depth = 1;
            return Scan::Continue;
        }
        if self.in_string {
            match c {
                _ if self.escape => self.escape = false,
                '\\' => self.escape = true,
                '"' => self.in_string = false,
                _ => {}
            }
            return Scan::Continue;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    return Scan::Done;
                }
            }
            _ => {}
        }
        Scan::Continue
    }
}

#[cfg(test)]
#[path = "tool_calls_tests.rs"]
mod tests;
