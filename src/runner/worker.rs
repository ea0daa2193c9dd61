//! The model worker: a dedicated thread that owns the weights and the KV storage and runs one
//! forward per message. Only the scheduler talks to it; the batch it receives already names
//! every page each sequence may touch.

use super::batch::{ForwardOutput, OutputRows, SeqStep};
use crate::error::EngineError;
use crate::kv::{KvDtype, KvStorage, PageCopy, PageId};
use crate::model::Transformer;
use actix::prelude::*;
use std::sync::Arc;

pub struct ModelWorker {
    model: Arc<Transformer>,
    kv: KvStorage,
}

impl ModelWorker {
    /// Starts the worker thread. `num_pages` bounds the KV storage, which grows lazily.
    pub fn start(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Addr<Self> {
        SyncArbiter::start(1, move || ModelWorker {
            kv: KvStorage::new(model.kv_shape(page_size), dtype, num_pages),
            model: model.clone(),
        })
    }
}

impl Actor for ModelWorker {
    type Context = SyncContext<Self>;
}

/// One sequence's share of a step, owned so it can cross threads.
#[derive(Debug, Clone)]
pub struct OwnedSeqStep {
    pub tokens: Vec<u32>,
    pub start_position: usize,
    pub page_ids: Vec<PageId>,
    pub outputs: OutputRows,
}

#[derive(Message)]
#[rtype(result = "Result<ForwardOutput, EngineError>")]
pub struct Forward {
    pub steps: Vec<OwnedSeqStep>,
    pub want_hidden: bool,
    /// Copy-on-write page copies, run before the forward reads or writes any page.
    pub copies: Vec<PageCopy>,
}

impl Handler<Forward> for ModelWorker {
    type Result = Result<ForwardOutput, EngineError>;

    fn handle(&mut self, msg: Forward, _: &mut SyncContext<Self>) -> Self::Result {
        let steps: Vec<SeqStep> = msg
            .steps
            .iter()
            .map(|s| SeqStep {
                tokens: &s.tokens,
                start_position: s.start_position,
                page_ids: &s.page_ids,
                outputs: s.outputs,
            })
            .collect();
        // A bug in a kernel must fail this step's requests, not take the worker thread down.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for &copy in &msg.copies {
                self.kv.copy_slots(copy);
            }
            self.model.forward(&steps, &mut self.kv, msg.want_hidden)
        }));
        match result {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => match e.downcast::<crate::error::KvError>() {
                Ok(kv) => Err(EngineError::Kv(kv)),
                Err(e) => Err(EngineError::Internal(format!("{e:#}"))),
            },
            Err(_) => Err(EngineError::Internal("the forward pass panicked".into())),
        }
    }
}

/// Bytes of KV storage allocated so far.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct KvBytes;

impl Handler<KvBytes> for ModelWorker {
    type Result = usize;
    fn handle(&mut self, _: KvBytes, _: &mut SyncContext<Self>) -> usize {
        self.kv.bytes_allocated()
    }
}
