//! Running the model: the ragged batch description and, later, the model worker thread that
//! owns the weights and the KV storage.

pub mod batch;

pub use batch::{ForwardOutput, OutputRow, OutputRows, SeqStep};
