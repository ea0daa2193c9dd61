//! The scheduler: the only place where batches are decided. The decision itself is the pure
//! function [`plan::plan_step`]; the actor around it executes plans.

pub mod actor;
pub mod events;
pub mod plan;
pub mod sequence;

pub use actor::{
    Enqueue, GetSchedulerStats, SchedulerActor, SchedulerParts, SchedulerStats, Settle, Submission,
};
pub use events::{DepthCounts, DraftTally, FinishReason, MaxTokensCut, SeqEvent, Usage};
pub use plan::{plan_step, Grant, SchedulerConfig, StepPlan};
pub use sequence::{SeqId, Sequence};
