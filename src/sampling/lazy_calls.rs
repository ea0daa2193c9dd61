//! A lazy tool-call grammar: sampling is free until the model opens a tool call, and from
//! there the call is held to its grammar (a declared tool's name, arguments valid against its
//! schema, the call closed), as llama.cpp's lazy grammars do for `tool_choice: "auto"`.
//!
//! Two grammars wait, compiled with the request (so a schema that cannot be enforced is
//! refused before inference): one from a `<tool_call>` tag, one from the start of a line that
//! opens a bare or fenced JSON call (`{"name": "`: small models write calls that way, at the
//! start of the reply or after a line of their own). While free, the constraint only watches the
//! text the tokens spell: nothing is masked, no logits are copied. When an opening is complete
//! at a token boundary, the matching grammar is fed the tokens from that boundary on; if it
//! accepts them, it constrains every later token (a rejected draft is one its mask removes,
//! as for any output grammar). If it does not (the model wrote something the grammar cannot
//! continue), the reply stays free and the tool-call parser decides what it was.

use llguidance::toktrie::TokEnv;
use llguidance::Matcher;

/// The tag that opens a Hermes/Qwen call.
const TAG: &[u8] = b"<tool_call>";

pub(super) struct LazyCalls {
    /// The grammar from the tag on (taken when it starts constraining).
    tagged: Option<Matcher>,
    /// The grammar from the start of a line (bare or fenced JSON call).
    bare: Option<Matcher>,
    /// The first token of the current line: where a bare call would start.
    line_start: usize,
    tok_env: TokEnv,
    /// The reply's bytes so far, and where each of its tokens starts.
    text: Vec<u8>,
    token_starts: Vec<usize>,
    tokens: Vec<u32>,
    /// The grammar constraining the reply, once a call is open.
    active: Option<Matcher>,
}

impl LazyCalls {
    pub(super) fn new(tagged: Matcher, bare: Matcher, tok_env: TokEnv) -> Self {
        Self {
            tagged: Some(tagged),
            bare: Some(bare),
            line_start: 0,
            tok_env,
            text: Vec::new(),
            token_starts: Vec::new(),
            tokens: Vec::new(),
            active: None,
        }
    }

    /// The grammar in force, once the model has opened a call.
    pub(super) fn active(&mut self) -> Option<&mut Matcher> {
        self.active.as_mut()
    }

    pub(super) fn is_active(&self) -> bool {
        self.active.is_some()
    }

    /// Records a token of the free reply and starts constraining when it completes the opening
    /// of a call. (Once active, the caller feeds the active matcher itself.)
    pub(super) fn observe(&mut self, token: u32) {
        if self.tagged.is_none() && self.bare.is_none() {
            return; // nothing left to wait for
        }
        let start = self.text.len();
        let bytes = self.tok_env.tok_trie().token(token);
        // A token that begins a line (or begins with its whitespace) may begin a bare call,
        // unless the line before it still may (an opening spans lines: a fence, `{` alone).
        let new_line = self.text.ends_with(b"\n") || bytes.first() == Some(&b'\n');
        if new_line && bare_opening(self.line_text()) == Opening::Impossible {
            self.line_start = self.tokens.len();
        }
        self.token_starts.push(start);
        self.tokens.push(token);
        self.text.extend_from_slice(bytes);
        if self.bare.is_some()
            && bare_opening(self.line_text()) == Opening::Complete
            && self.activate(Grammar::Bare, self.line_start)
        {
            return;
        }
        if self.tagged.is_some() {
            // Only the bytes this token added can complete a tag.
            let from = start.saturating_sub(TAG.len() - 1);
            if let Some(at) = find(&self.text[from..], TAG).map(|i| from + i) {
                // A tag that starts inside a token: the grammar cannot take that token.
                if let Ok(first) = self.token_starts.binary_search(&at) {
                    self.activate(Grammar::Tagged, first);
                }
            }
        }
    }

    /// The text from the first token of the line a bare call may start on.
    fn line_text(&self) -> &[u8] {
        match self.token_starts.get(self.line_start) {
            Some(&at) => &self.text[at..],
            None => &[],
        }
    }

    /// Feeds a copy of the grammar the tokens from index `first` on; it constrains the reply
    /// if it takes them all (else the grammar waits, unchanged, for another opening).
    fn activate(&mut self, which: Grammar, first: usize) -> bool {
        let waiting = match which {
            Grammar::Tagged => &self.tagged,
            Grammar::Bare => &self.bare,
        };
        let Some(mut matcher) = waiting.as_ref().map(Matcher::deep_clone) else {
            return false;
        };
        let tokens = &self.tokens[first..];
        let taken = matcher.try_consume_tokens(tokens);
        tracing::debug!(
            grammar = ?which,
            opening = %String::from_utf8_lossy(&self.text[self.token_starts[first]..]),
            tokens = tokens.len(),
            taken = ?taken,
            "the model opened a tool call"
        );
        match taken {
            Ok(n) if n == tokens.len() => {
                self.active = Some(matcher);
                self.tagged = None;
                self.bare = None;
                // Nothing reads the text again.
                self.text = Vec::new();
                self.token_starts = Vec::new();
                self.tokens = Vec::new();
                true
            }
            _ => false,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Grammar {
    Tagged,
    Bare,
}

/// How far a line is from opening a bare (or fenced) JSON call.
#[derive(Debug, PartialEq)]
enum Opening {
    /// `{"name":` is complete (after whitespace, or a ```` ```json ```` fence line).
    Complete,
    /// What there is could still become one.
    Pending,
    Impossible,
}

/// Reads a line as `bare_tool_calls` reads a call's: optional whitespace, an
/// optional fence line (```` ``` ````, ```` ```json ````), whitespace, `{`, `"name"`, `:`.
fn bare_opening(text: &[u8]) -> Opening {
    let mut rest = skip_ws(text);
    if rest.first() == Some(&b'`') {
        let Some(line_end) = rest.iter().position(|&b| b == b'\n') else {
            let line = rest;
            let fence_prefix = [&b"```json"[..], b"```JSON"]
                .iter()
                .any(|f| f.starts_with(line) || line.starts_with(f));
            return if fence_prefix && line.len() <= 16 {
                Opening::Pending
            } else {
                Opening::Impossible
            };
        };
        let line = trim_end(&rest[..line_end]);
        if !matches!(line, b"```" | b"```json" | b"```JSON") {
            return Opening::Impossible;
        }
        rest = skip_ws(&rest[line_end + 1..]);
    }
    // Complete at the colon: the name's quote is the grammar's (a token that opens the string
    // may hold the name's first letters, which the grammar must be in time to choose).
    let mut need: &[&[u8]] = &[b"{", b"\"name\"", b":"];
    while let Some((part, more)) = need.split_first() {
        if rest.len() < part.len() {
            return if part.starts_with(rest) {
                Opening::Pending
            } else {
                Opening::Impossible
            };
        }
        if !rest.starts_with(part) {
            return Opening::Impossible;
        }
        rest = &rest[part.len()..];
        if *part == b"{" {
            // `{{"name": …}}`, as a template's example call spells it.
            rest = rest.strip_prefix(b"{").unwrap_or(rest);
        }
        if !more.is_empty() {
            rest = skip_ws(rest);
        }
        need = more;
    }
    Opening::Complete
}

fn skip_ws(s: &[u8]) -> &[u8] {
    let n = s
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    &s[n..]
}

fn trim_end(s: &[u8]) -> &[u8] {
    let n = s
        .iter()
        .rev()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\r'))
        .count();
    &s[..s.len() - n]
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_openings_are_read_as_the_parser_reads_calls() {
        for done in [
            &b"{\"name\": \""[..],
            b"  {\n  \"name\":\"",
            b"```json\n{\"name\": \"",
            b"```\n  { \"name\" : \"",
            b"{{\"name\": \"",
            b"{\"name\":",
        ] {
            assert_eq!(bare_opening(done), Opening::Complete, "{:?}", done);
        }
        for pending in [
            &b""[..],
            b"\n",
            b"`",
            b"```js",
            b"```json",
            b"{",
            b"{ \"na",
            b"{\"name\" ",
        ] {
            assert_eq!(bare_opening(pending), Opening::Pending, "{:?}", pending);
        }
        for never in [&b"Sure"[..], b"{\"result\"", b"```python\n", b"[{\"name\""] {
            assert_eq!(bare_opening(never), Opening::Impossible, "{:?}", never);
        }
    }
}
