//! GBNF — llama.cpp's grammar format, which llama.cpp's `grammar` field and vLLM's
//! `guided_grammar` take — translated into llguidance's Lark dialect, which the constraint
//! engine compiles (see [`super::constraint`]).
//!
//! GBNF is a character-level context-free grammar: `name ::= alternatives`, literals `"..."`,
//! character classes `[a-z]` / `[^"\\]`, `.` (any character), groups, `*` `+` `?` and `{m,n}`
//! repetitions, `#` comments; a rule ends at a newline unless it is inside parentheses or
//! after a `|`; `root` is the start. Rule names become lowercase Lark rules prefixed `g_`
//! (Lark reserves capitalised names for lexer tokens), literals become sequences of
//! one-character JSON-quoted Lark strings, and classes one-character regular expressions.
//!
//! Every lexeme is one character on purpose: llguidance's lexer takes the longest lexeme and
//! backs up at most one byte, so a multi-character literal competing with a class
//! (`[a-z ]* "end"` against `a tent end`) would wrongly refuse text that GBNF, a
//! character-level grammar, accepts. With one-character lexemes the Earley parser decides
//! everything and the language is exactly llama.cpp's. Token-level syntax (`<[id]>`,
//! `<think>`, `!<...>`) is refused.

use std::collections::HashMap;
use std::fmt::Write;

/// The Lark text of a GBNF grammar, or why it is not valid GBNF (with the line it is on).
pub fn to_lark(source: &str) -> Result<String, String> {
    let rules = Parser::new(source).grammar()?;
    let mut names: HashMap<&str, String> = HashMap::new();
    let mut taken: Vec<String> = Vec::new();
    for (i, (name, _)) in rules.iter().enumerate() {
        if names.contains_key(name.as_str()) {
            continue;
        }
        let base = format!("g_{}", name.to_ascii_lowercase().replace('-', "_"));
        let mut lark = base.clone();
        let mut n = i;
        while taken.contains(&lark) {
            lark = format!("{base}_{n}");
            n += 1;
        }
        taken.push(lark.clone());
        names.insert(name, lark);
    }
    let Some(root) = names.get("root") else {
        return Err("the grammar has no `root` rule (the one its output must match)".into());
    };
    let mut out = format!("start: {root}\n");
    // A name defined twice keeps its last definition, as in llama.cpp.
    let mut last: HashMap<&str, &Vec<Vec<Node>>> = HashMap::new();
    for (name, alternatives) in &rules {
        last.insert(name, alternatives);
    }
    let mut written: Vec<&str> = Vec::new();
    for (name, _) in &rules {
        if written.contains(&name.as_str()) {
            continue;
        }
        written.push(name);
        let body = alternatives_text(last[name.as_str()], &names)?;
        let body = if body.is_empty() { "\"\"".into() } else { body };
        writeln!(out, "{}: {body}", names[name.as_str()]).expect("writing to a String");
    }
    Ok(out)
}

/// Whether a `guided_grammar` is GBNF rather than Lark: vLLM's rule, a `::=` on some line
/// outside a comment.
pub fn looks_like_gbnf(source: &str) -> bool {
    source
        .lines()
        .any(|line| line.split('#').next().unwrap_or("").contains("::="))
}

#[derive(Debug, Clone)]
enum Node {
    Literal(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Rule(String),
    Group(Vec<Vec<Node>>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

/// The Lark text of `a | b | ...`; empty when every alternative is empty. An empty
/// alternative makes the rest optional.
fn alternatives_text(alts: &[Vec<Node>], names: &HashMap<&str, String>) -> Result<String, String> {
    let mut texts = Vec::new();
    let mut has_empty = false;
    for seq in alts {
        let mut items = Vec::new();
        for node in seq {
            let t = node_text(node, names)?;
            if !t.is_empty() {
                items.push(t);
            }
        }
        if items.is_empty() {
            has_empty = true;
        } else {
            texts.push(items.join(" "));
        }
    }
    Ok(match (texts.len(), has_empty) {
        (0, _) => String::new(),
        (_, true) => format!("[{}]", texts.join(" | ")),
        (1, false) => texts.remove(0),
        (_, false) => texts.join(" | "),
    })
}

fn node_text(node: &Node, names: &HashMap<&str, String>) -> Result<String, String> {
    Ok(match node {
        Node::Literal(s) if s.is_empty() => String::new(),
        Node::Literal(s) => {
            let chars: Vec<String> = s.chars().map(|c| lark_string(&c.to_string())).collect();
            chars.join(" ")
        }
        Node::Any => r"/(?s:.)/".into(),
        Node::Class { negated, ranges } => {
            let mut rx = String::from(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                write!(rx, r"\x{{{:x}}}", lo as u32).expect("writing to a String");
                if hi != lo {
                    write!(rx, r"-\x{{{:x}}}", hi as u32).expect("writing to a String");
                }
            }
            rx.push_str("]/");
            rx
        }
        Node::Rule(name) => names
            .get(name.as_str())
            .cloned()
            .ok_or_else(|| format!("the rule `{name}` is used but never defined"))?,
        Node::Group(alts) => {
            let inner = alternatives_text(alts, names)?;
            if inner.is_empty() {
                inner
            } else {
                format!("({inner})")
            }
        }
        Node::Repeat { node, min, max } => {
            let inner = node_text(node, names)?;
            if inner.is_empty() || *max == Some(0) {
                return Ok(String::new());
            }
            let op = match (min, max) {
                (0, None) => "*".to_string(),
                (1, None) => "+".to_string(),
                (0, Some(1)) => "?".to_string(),
                (m, None) => format!("{{{m},}}"),
                (m, Some(n)) if m == n => format!("{{{m}}}"),
                (m, Some(n)) => format!("{{{m},{n}}}"),
            };
            format!("({inner}){op}")
        }
    })
}

/// A Lark string literal (JSON syntax; the lexer refuses raw control characters and DEL).
fn lark_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                write!(out, "\\u{:04x}", c as u32).expect("writing to a String")
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

type Rules = Vec<(String, Vec<Vec<Node>>)>;

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Self { src, pos: 0 }
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn error(&self, what: impl std::fmt::Display) -> String {
        let line = self.src[..self.pos].matches('\n').count() + 1;
        format!("GBNF grammar, line {line}: {what}")
    }

    /// Skips blanks and comments, and newlines too when `newlines` (inside parentheses,
    /// after `::=` or `|`, between rules).
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n' && c != '\r') {
                        self.bump();
                    }
                }
                '\n' | '\r' if newlines => self.pos += 1,
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.src[start..self.pos].to_string())
    }

    fn grammar(&mut self) -> Result<Rules, String> {
        let mut rules = Vec::new();
        self.skip_space(true);
        while self.peek().is_some() {
            let name = self
                .name()
                .ok_or_else(|| self.error("expected a rule name"))?;
            self.skip_space(false);
            if !self.src[self.pos..].starts_with("::=") {
                return Err(self.error(format!("expected `::=` after `{name}`")));
            }
            self.pos += 3;
            self.skip_space(true);
            let alternatives = self.alternatives(false)?;
            match self.peek() {
                None | Some('\n') | Some('\r') => {}
                Some(c) => return Err(self.error(format!("unexpected `{c}`"))),
            }
            rules.push((name, alternatives));
            self.skip_space(true);
        }
        if rules.is_empty() {
            return Err(self.error("the grammar is empty"));
        }
        Ok(rules)
    }

    fn alternatives(&mut self, nested: bool) -> Result<Vec<Vec<Node>>, String> {
        let mut alternatives = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.skip_space(true);
            alternatives.push(self.sequence(nested)?);
        }
        Ok(alternatives)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Node>, String> {
        let mut seq: Vec<Node> = Vec::new();
        while let Some(c) = self.peek() {
            let node = match c {
                '"' => {
                    self.pos += 1;
                    let mut text = String::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.error("unterminated string")),
                            Some('"') => break,
                            Some(_) => text.push(self.char()?),
                        }
                    }
                    self.pos += 1;
                    Node::Literal(text)
                }
                '[' => self.class()?,
                '.' => {
                    self.pos += 1;
                    Node::Any
                }
                '(' => {
                    self.pos += 1;
                    self.skip_space(true);
                    let alts = self.alternatives(true)?;
                    if self.bump() != Some(')') {
                        return Err(self.error("expected `)`"));
                    }
                    Node::Group(alts)
                }
                '*' | '+' | '?' | '{' => {
                    let Some(last) = seq.pop() else {
                        return Err(self.error(format!("`{c}` follows nothing")));
                    };
                    let (min, max) = self.repetition()?;
                    Node::Repeat {
                        node: Box::new(last),
                        min,
                        max,
                    }
                }
                '<' | '!' => {
                    return Err(self.error(
                        "token-level syntax (`<[id]>`, `<token>`, `!`) is not supported; \
                         write the text the tokens spell",
                    ))
                }
                c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    let name = self.name().expect("a name character was seen");
                    Node::Rule(name)
                }
                _ => break,
            };
            seq.push(node);
            self.skip_space(nested);
        }
        Ok(seq)
    }

    /// `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` or `{,n}`.
    fn repetition(&mut self) -> Result<(u32, Option<u32>), String> {
        match self.bump() {
            Some('*') => return Ok((0, None)),
            Some('+') => return Ok((1, None)),
            Some('?') => return Ok((0, Some(1))),
            _ => {}
        }
        let close = self.src[self.pos..]
            .find('}')
            .ok_or_else(|| self.error("expected `}` after a `{` repetition"))?;
        let inner = self.src[self.pos..self.pos + close].replace([' ', '\t'], "");
        let number = |s: &str| -> Result<u32, String> {
            s.parse::<u32>()
                .map_err(|_| self.error(format!("`{{{inner}}}` is not a repetition count")))
        };
        let counts = match inner.split_once(',') {
            None => {
                let n = number(&inner)?;
                (n, Some(n))
            }
            Some((lo, "")) => (number(lo)?, None),
            Some(("", hi)) => (0, Some(number(hi)?)),
            Some((lo, hi)) => (number(lo)?, Some(number(hi)?)),
        };
        if counts.1.is_some_and(|max| max < counts.0) {
            return Err(self.error(format!("`{{{inner}}}`: the maximum is below the minimum")));
        }
        self.pos += close + 1;
        Ok(counts)
    }

    fn class(&mut self) -> Result<Node, String> {
        self.pos += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return Err(self.error("unterminated character class")),
                Some(']') => break,
                Some(_) => {
                    let lo = self.char()?;
                    let rest = &self.src[self.pos..];
                    let hi = if rest.len() > 1 && rest.starts_with('-') && !rest.starts_with("-]") {
                        self.pos += 1;
                        self.char()?
                    } else {
                        lo
                    };
                    if hi < lo {
                        return Err(self.error(format!("the range `{lo}-{hi}` is reversed")));
                    }
                    ranges.push((lo, hi));
                }
            }
        }
        self.pos += 1;
        if ranges.is_empty() {
            return Err(self.error("an empty character class matches nothing"));
        }
        Ok(Node::Class { negated, ranges })
    }

    /// One character of a literal or a class, escapes decoded.
    fn char(&mut self) -> Result<char, String> {
        let c = self.bump().ok_or_else(|| self.error("unexpected end"))?;
        if c != '\\' {
            return Ok(c);
        }
        let escape = self.bump().ok_or_else(|| self.error("unexpected end"))?;
        let digits = match escape {
            'n' => return Ok('\n'),
            't' => return Ok('\t'),
            'r' => return Ok('\r'),
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => return Ok(escape),
            'x' => 2,
            'u' => 4,
            'U' => 8,
            other => return Err(self.error(format!("unknown escape `\\{other}`"))),
        };
        let hex = self
            .src
            .get(self.pos..self.pos + digits)
            .filter(|h| h.chars().all(|c| c.is_ascii_hexdigit()))
            .ok_or_else(|| self.error(format!("`\\{escape}` needs {digits} hex digits")))?;
        self.pos += digits;
        let code = u32::from_str_radix(hex, 16).expect("hex digits");
        char::from_u32(code).ok_or_else(|| self.error(format!("`{code:#x}` is not a character")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
    use llguidance::{Matcher, ParserFactory};
    use std::sync::Arc;

    /// A tokenizer of single bytes (ids 0..256) plus an end token: each text is fed to the
    /// matcher byte by byte, so acceptance is exactly the grammar's language.
    fn factory() -> ParserFactory {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(Vec::new());
        let info = TokRxInfo::new(257, 256);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut f = ParserFactory::new_simple(&env).unwrap();
        f.quiet();
        f
    }

    fn accepts(gbnf: &str, text: &str) -> bool {
        let lark = to_lark(gbnf).unwrap();
        let parser = factory()
            .create_parser(TopLevelGrammar::from_lark(lark.clone()))
            .unwrap_or_else(|e| panic!("{lark}: {e}"));
        let mut m = Matcher::new(Ok(parser));
        for b in text.bytes() {
            if m.consume_token(b as u32).is_err() {
                return false;
            }
        }
        m.is_accepting().unwrap()
    }

    /// llama.cpp's `grammars/json.gbnf`, as people paste it.
    const JSON: &str = r#"
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

    #[test]
    fn llama_cpp_json_grammar_matches_json_and_nothing_else() {
        for ok in [
            r#"{"a": [1, -2.5e3, "x\"y"], "b": {"c": null}}"#,
            "{}",
            "{\n\t\"k\": true}",
            r#"{"u": "\u00e9 é"}"#,
        ] {
            assert!(accepts(JSON, ok), "{ok}");
        }
        for bad in [
            r#"{"a": }"#,
            "[1]x",
            r#"{"a" 1}"#,
            "{'a': 1}",
            "{\"a\": 01}",
        ] {
            assert!(!accepts(JSON, bad), "{bad}");
        }
    }

    #[test]
    fn repetitions_classes_and_escapes() {
        let g = "root ::= [a-c]{2,3} \"-\" [^x\\n]+ \"\\x41\" d{,2} e{2}\nd ::= \"d\"\ne ::= \".\"";
        assert!(accepts(g, "ab-zzA.."));
        assert!(accepts(g, "abc-q Add.."));
        assert!(!accepts(g, "a-zzA.."), "at least 2 of [a-c]");
        assert!(!accepts(g, "ab-xA.."), "x is excluded");
        assert!(!accepts(g, "ab-zAddd.."), "at most 2 d");
        assert!(accepts("root ::= . . \"!\"", "é\n!"));
        assert!(accepts("root ::= \"a\" ( | \"b\" )", "a"));
        assert!(accepts("root ::= \"a\" ( | \"b\" )", "ab"));
        // Character-level, as in llama.cpp: no reading of a literal is lost to greedy lexing.
        assert!(accepts("root ::= (\"a\" | \"ab\") \"bc\"", "abc"));
        assert!(accepts("root ::= (\"a\" | \"ab\") \"bc\"", "abbc"));
        assert!(accepts("root ::= [a-z ]* \"end\"", "a tent end"));
        assert!(!accepts("root ::= [a-z ]* \"end\"", "a tent"));
        // A group whose first alternative starts optional keeps its parentheses.
        let g = "root ::= \"x\" (( | \"-\") \"1\" | \"y\")";
        assert!(accepts(g, "x-1") && accepts(g, "x1") && accepts(g, "xy"));
        assert!(!accepts(g, "y"));
        // Names that collide once lowercased stay distinct.
        assert!(accepts(
            "root ::= x-2 x X\nx-2 ::= \"a\"\nx ::= \"b\"\nX ::= \"c\"",
            "abc"
        ));
        assert!(accepts(
            "Root-1 ::= \"x\"\nroot ::= Root-1 root-1\nroot-1 ::= \"y\"",
            "xy"
        ));
    }

    #[test]
    fn rules_span_lines_only_inside_parentheses_or_after_a_bar() {
        let g = "root ::= \"a\" |\n  \"b\"\nother ::= (\n \"c\"\n \"d\")";
        assert!(accepts(g, "b"));
        let err = to_lark("root ::= \"a\"\n  \"b\"").unwrap_err();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn errors_name_the_problem_and_the_line() {
        let cases = [
            ("value ::= \"a\"", "no `root` rule"),
            ("root ::= value", "`value` is used but never defined"),
            ("root ::= \"a", "unterminated string"),
            ("root ::= [a-", "unterminated character class"),
            ("root ::= \"\\q\"", "unknown escape `\\q`"),
            ("root ::= * \"a\"", "follows nothing"),
            ("root ::= \"a\"{3,1}", "maximum is below the minimum"),
            ("root ::= <[1234]>", "token-level syntax"),
            ("root = \"a\"", "expected `::=`"),
            ("\n\nroot ::= ( \"a\" ", "line 3: expected `)`"),
        ];
        for (g, want) in cases {
            let err = to_lark(g).unwrap_err();
            assert!(err.contains(want), "{g:?}: {err}");
        }
    }

    #[test]
    fn gbnf_is_told_from_lark_by_its_rule_arrows() {
        assert!(looks_like_gbnf("# a comment\nroot ::= \"a\""));
        assert!(!looks_like_gbnf("start: \"a\" # not ::= here"));
    }
}
