//! The ragged-batch forward pass on the generated test model: chunked prefill equals one-shot
//! prefill, a sequence in a batch equals the sequence alone, and capacity is enforced.

use mtpx::kv::{KvDtype, KvStorage, PagePool, PageTable};
use mtpx::model::test_model::{write_test_model, TestModelSpec};
use mtpx::model::Transformer;
use mtpx::runner::{argmax, OutputRows, SeqStep, SingleSequence};

fn test_model() -> Transformer {
    let dir = tempfile::tempdir().unwrap();
    let path = write_test_model(dir.path(), &TestModelSpec::default()).unwrap();
    Transformer::load(&path).unwrap().0
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 13) % 500).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Greedy continuation of `n` tokens after a prefill in chunks of `chunk`.
fn greedy(model: &Transformer, tokens: &[u32], chunk: usize, n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut seq = SingleSequence::new(model, tokens.len() + n + 1, 16, KvDtype::F32);
    let first = seq.append(tokens, chunk, false).unwrap();
    let mut out = vec![argmax(&first)];
    for _ in 1..n {
        let logits = seq.append(&[*out.last().unwrap()], 1, false).unwrap();
        out.push(argmax(&logits));
    }
    (first, out)
}

#[test]
fn chunked_prefill_equals_one_shot_prefill() {
    let model = test_model();
    let tokens = prompt(300);
    let (reference_logits, reference_tokens) = greedy(&model, &tokens, tokens.len(), 32);
    for chunk in [1, 7, 64] {
        let (logits, generated) = greedy(&model, &tokens, chunk, 32);
        let diff = max_abs_diff(&logits, &reference_logits);
        assert!(diff < 1e-3, "chunk {chunk}: logits differ by {diff}");
        assert_eq!(generated, reference_tokens, "chunk {chunk}");
    }
}

/// A step of 1,100 rows runs its MLP in three blocks of rows (`MLP_ROW_BLOCK`); every row's
/// logits equal those of the same prompt prefilled in steps of 200.
#[test]
fn a_step_wider_than_the_mlp_row_block_equals_narrower_steps() {
    let model = test_model();
    let tokens = prompt(1100);
    let mut whole = SingleSequence::new(&model, 1101, 16, KvDtype::F32);
    let at_once = whole.append(&tokens, tokens.len(), true).unwrap();
    let mut chunked = SingleSequence::new(&model, 1101, 16, KvDtype::F32);
    let in_steps = chunked.append(&tokens, 200, true).unwrap();
    let diff = max_abs_diff(&at_once, &in_steps);
    assert!(diff < 1e-3, "logits differ by {diff}");
    let vocab = at_once.len() / tokens.len();
    for (a, b) in at_once.chunks(vocab).zip(in_steps.chunks(vocab)) {
        assert_eq!(argmax(a), argmax(b));
    }
}

#[test]
fn all_rows_logits_equal_step_by_step_logits() {
    // What speculative verification relies on: logits for k rows at once equal k decode steps.
    let model = test_model();
    let tokens = prompt(40);
    let mut one_by_one = SingleSequence::new(&model, 64, 16, KvDtype::F32);
    one_by_one.append(&tokens[..30], 30, false).unwrap();
    let stepwise = one_by_one.append(&tokens[30..], 1, true).unwrap();
    let mut verify = SingleSequence::new(&model, 64, 16, KvDtype::F32);
    verify.append(&tokens[..30], 30, false).unwrap();
    let at_once = verify.append(&tokens[30..], 10, true).unwrap();
    assert!(max_abs_diff(&stepwise, &at_once) < 1e-3);
}

#[test]
fn a_step_into_the_reused_buffer_equals_append() {
    // `step` hands the last step's logits buffer back to the model (as the engine's worker
    // does): shrinking from 10 rows to 1 and growing again must not leave stale logits.
    let model = test_model();
    let tokens = prompt(40);
    let mut appended = SingleSequence::new(&model, 64, 16, KvDtype::F32);
    let first = appended.append(&tokens[..30], 30, false).unwrap();
    let at_once = appended.append(&tokens[30..], 10, true).unwrap();
    let mut stepped = SingleSequence::new(&model, 64, 16, KvDtype::F32);
    assert_eq!(stepped.step(&tokens[..30], false).unwrap(), &first[..]);
    assert_eq!(stepped.step(&tokens[30..], true).unwrap(), &at_once[..]);
    stepped.truncate(30).unwrap();
    let vocab = first.len();
    let one = stepped.step(&tokens[30..31], false).unwrap().to_vec();
    assert_eq!(one.len(), vocab);
    assert!(max_abs_diff(&one, &at_once[..vocab]) < 1e-3);
    let rest = stepped.step(&tokens[31..], true).unwrap();
    assert!(max_abs_diff(rest, &at_once[vocab..]) < 1e-3);
    assert_eq!(stepped.len(), 40);
}

#[test]
fn a_sequence_in_a_ragged_batch_equals_the_sequence_alone() {
    let model = test_model();
    let page_size = 16;
    let mut pool = PagePool::new(64, page_size);
    let mut kv = KvStorage::new(model.kv_shape(page_size), KvDtype::F32, 64);
    let prompts = [prompt(45), prompt(3), prompt(17)];
    let mut tables: Vec<PageTable> = prompts.iter().map(|_| PageTable::new()).collect();
    for (t, p) in tables.iter_mut().zip(&prompts) {
        t.try_grow(p.len(), &mut pool).unwrap();
    }
    let steps: Vec<SeqStep> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqStep {
            tokens: p,
            start_position: 0,
            page_ids: t.page_ids(),
            outputs: OutputRows::Last,
        })
        .collect();
    let batched = model.forward(&steps, &mut kv, false).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let mut alone = SingleSequence::new(&model, 64, page_size, KvDtype::F32);
        let logits = alone.append(p, p.len(), false).unwrap();
        let diff = max_abs_diff(batched.logits_row(i), &logits);
        assert!(diff < 1e-3, "sequence {i}: {diff}");
    }
}

#[test]
fn a_step_past_the_page_tables_capacity_is_a_typed_error() {
    let model = test_model();
    let mut pool = PagePool::new(4, 16);
    let mut kv = KvStorage::new(model.kv_shape(16), KvDtype::F16, 4);
    let mut table = PageTable::new();
    table.try_grow(16, &mut pool).unwrap();
    let tokens = prompt(17);
    let err = model
        .forward(
            &[SeqStep {
                tokens: &tokens,
                start_position: 0,
                page_ids: table.page_ids(),
                outputs: OutputRows::Last,
            }],
            &mut kv,
            false,
        )
        .unwrap_err();
    let kv_err = err.downcast_ref::<mtpx::error::KvError>().unwrap();
    assert_eq!(
        *kv_err,
        mtpx::error::KvError::PastCapacity {
            position: 16,
            capacity: 16
        }
    );
}

#[test]
fn the_test_model_is_small_enough_for_long_session_tests() {
    // Sizes, not timings: `mtpx bench` measures its speed.
    let model = test_model();
    assert!(model.config.hidden_size <= 64 && model.config.num_layers <= 2);
    assert_eq!(model.config.num_mtp_layers, 1);
    assert_eq!(model.config.vocab_size, 512);
}

/// Rewrites the test model with `edit` applied to its metadata and tensor list.
fn edited_model(
    dir: &std::path::Path,
    edit: impl FnOnce(
        &mut Vec<(String, candle_core::quantized::gguf_file::Value)>,
        &mut Vec<(String, candle_core::quantized::QTensor)>,
    ),
) -> std::path::PathBuf {
    use candle_core::quantized::gguf_file;
    let src = write_test_model(dir, &TestModelSpec::default()).unwrap();
    let mut file = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut metadata: Vec<_> = content.metadata.clone().into_iter().collect();
    let mut tensors: Vec<_> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let t = content
                .tensor(&mut file, name, &candle_core::Device::Cpu)
                .unwrap();
            (name.clone(), t)
        })
        .collect();
    edit(&mut metadata, &mut tensors);
    let out = dir.join("edited.gguf");
    let mut w = std::fs::File::create(&out).unwrap();
    let m: Vec<_> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<_> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &m, &t).unwrap();
    out
}

#[test]
fn an_unknown_architecture_is_an_error_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = edited_model(dir.path(), |metadata, _| {
        for (k, v) in metadata.iter_mut() {
            if k == "general.architecture" {
                *v = candle_core::quantized::gguf_file::Value::String("mamba".into());
            }
        }
    });
    let err = Transformer::load(&path).err().unwrap().to_string();
    assert!(err.contains("`mamba`"), "{err}");
}

#[test]
fn a_missing_tensor_is_an_error_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = edited_model(dir.path(), |_, tensors| {
        tensors.retain(|(name, _)| name != "blk.1.ffn_up.weight");
    });
    let err = Transformer::load(&path).err().unwrap().to_string();
    assert!(err.contains("blk.1.ffn_up.weight"), "{err}");
}
