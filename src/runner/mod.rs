//! Running the model: the ragged batch description, and a direct single-sequence runner for
//! the CLI, benchmarks and reference tests. (The model worker thread that owns the weights and
//! KV storage for the serving engine lives here too once the scheduler exists.)

pub mod batch;
pub mod calibrate;
pub mod embed;
pub mod single;
pub mod worker;

pub use batch::{ForwardOutput, OutputRow, OutputRows, SeqStep};
pub use single::{argmax, SingleSequence};
