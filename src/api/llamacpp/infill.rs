//! `/infill`'s prompt, token by token as llama.cpp's server builds it (`format_infill`), so that
//! editor plugins written against it (llama.vim, llama.vscode) get the completions they were
//! tuned for:
//!
//! ```text
//! <|repo_name|>myproject\n  (<|file_sep|>{filename}\n{text})*  <|file_sep|>filename\n
//! <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>
//! ```
//!
//! `prompt` (the text left of the cursor on its line, as the plugins send it) ends the prefix.
//! The user's code is encoded with its special-token text left as text. The prefix keeps its
//! last 3/4 of a batch of tokens, the suffix its first 1/4 (less the prompt), and the other
//! files what is left of the window after a batch and twice `n_predict`, as in llama.cpp: the
//! plugins send whole files and rely on this.

use super::super::errors::ApiError;
use crate::engine::{Engine, Prompt};
use crate::model::FimTokens;

/// What a `/infill` request gives.
pub struct InfillInput {
    pub prefix: String,
    pub suffix: String,
    /// `prompt`: the start of the middle, appended to the prefix.
    pub started: String,
    /// `input_extra`: other files of the repository, `(filename, text)`.
    pub files: Vec<(String, String)>,
    /// `n_predict` (-1: until the model stops).
    pub n_predict: i64,
}

/// The prompt's token ids.
pub async fn infill_tokens(
    engine: &Engine,
    fim: &FimTokens,
    input: &InfillInput,
) -> Result<Vec<u32>, ApiError> {
    let info = engine.info();
    let n_ctx = info.context_window as i64;
    let n_batch = (info.max_batch_tokens as i64).min(n_ctx);
    // What generation keeps free: `n_predict`, or a quarter batch when it is unbounded.
    let n_predict = match input.n_predict {
        n if n > 0 => n.min(n_ctx),
        _ => -1,
    };
    let reserve = if n_predict > 0 {
        n_predict
    } else {
        n_batch / 4
    };
    let literal =
        |text: String| async move { engine.tokenize_literal(&text).await.map_err(ApiError::from) };
    let special = |text: Option<String>| async move {
        let Some(text) = text else { return Ok(None) };
        let ids = engine
            .tokenize(&Prompt::Text(text.clone()))
            .await
            .map_err(ApiError::from)?;
        match ids[..] {
            [id] => Ok(Some(id)),
            _ => Err(ApiError::internal(format!(
                "the model's fill-in-the-middle token `{text}` is not one token"
            ))),
        }
    };
    let (pre, suf, mid) = (
        special(Some(fim.prefix.clone())).await?,
        special(Some(fim.suffix.clone())).await?,
        special(Some(fim.middle.clone())).await?,
    );
    let (repo, file_sep) = (
        special(fim.repo_name.clone()).await?,
        special(fim.file_sep.clone()).await?,
    );

    let mut extra = Vec::new();
    if let Some(repo) = repo {
        extra.push(repo);
        extra.extend(literal("myproject\n".into()).await?);
    }
    if !input.files.is_empty() && file_sep.is_none() {
        return Err(ApiError::invalid(
            Some("input_extra"),
            "this model has no repository-context tokens (a file separator), so `input_extra` cannot be used",
        ));
    }
    if let Some(sep) = file_sep {
        for (name, text) in &input.files {
            extra.push(sep);
            extra.extend(literal(format!("{name}\n")).await?);
            extra.extend(literal(text.clone()).await?);
        }
        extra.push(sep);
        extra.extend(literal("filename\n".into()).await?);
    }
    let prefix = literal(input.prefix.clone()).await?;
    let suffix = literal(input.suffix.clone()).await?;
    let started = literal(input.started.clone()).await?;

    let take = |len: usize, room: i64| len.min(room.max(0) as usize);
    let prefix_take = take(prefix.len(), 3 * (n_batch / 4));
    let suffix_take = take(suffix.len(), n_batch / 4 - (2 + started.len() as i64));
    // llama.cpp's share for the other files, kept within the window with what surrounds them
    // and room to generate (llama.cpp's arithmetic alone can leave none).
    let around = (prefix_take + suffix_take + started.len() + 3) as i64;
    let extra_room = (n_ctx - n_batch - 2 * n_predict).min(n_ctx - around - reserve);
    let extra_take = take(extra.len(), extra_room);

    let mut ids = Vec::with_capacity(extra_take + prefix_take + suffix_take + started.len() + 3);
    ids.extend_from_slice(&extra[extra.len() - extra_take..]);
    ids.extend(pre);
    ids.extend_from_slice(&prefix[prefix.len() - prefix_take..]);
    ids.extend(started);
    ids.extend(suf);
    ids.extend_from_slice(&suffix[..suffix_take]);
    ids.extend(mid);
    Ok(ids)
}
