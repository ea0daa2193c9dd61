//! A team of threads for the forward pass's parallel loops (matmuls, attention): `for_each(n,
//! task)` runs `task(0..n)` on the calling thread and the team's helpers, which claim tasks one
//! at a time from a shared counter.
//!
//! Why not rayon's pool, which the rest of mtpx uses: a forward makes ~200 parallel calls a
//! token with a few to a few hundred microseconds of serial work between them (norms, rope,
//! attention set-up). Between two calls rayon's idle workers yield and then sleep, and the next
//! call waits for them to be woken and to steal: on a 2-vCPU VM a Q5_0 4864×896 matmul of 9
//! rows took 114 µs back to back but 141 µs after 5 µs of serial work and 211 µs after 1 ms, a
//! 1-row one 30 → 70 µs after 20 µs (`examples`-style scratch timing, BENCHMARKS.md). The team's
//! helpers instead spin for a while after each call (as llama.cpp's threads do during a
//! decode), and only then park; claiming tasks from one counter also balances the threads to a
//! task at the end of a call, where rayon's halving split could leave one thread a quarter of
//! the work.
//!
//! One caller at a time owns the team; a second caller meanwhile (another forward on another
//! thread, or a task that itself calls `for_each`) runs its loop on rayon's pool instead. Results
//! never depend on which threads run which tasks.

use rayon::prelude::*;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a helper spins (`pause`) on the task counter after its last task.
const SPIN: Duration = Duration::from_micros(200);
/// How long it then keeps polling between `yield`s (giving the core to anything runnable)
/// before it parks: longer than the gaps between the steps of a busy engine, so a decode loop
/// wakes nobody.
const POLL: Duration = Duration::from_millis(3);

/// `for_each`'s tasks at most (the ticket's task fields are 24 bits).
const MAX_TASKS: usize = (1 << 24) - 1;

/// `task(i)` for every `i < num_tasks`, on this thread and the team's helpers; returns when
/// all have run. A panic in a task is resumed here once every task has ended.
pub fn for_each(num_tasks: usize, task: impl Fn(usize) + Sync) {
    let threads = rayon::current_num_threads().min(team().helpers.len() + 1);
    if num_tasks <= 1 || threads <= 1 {
        (0..num_tasks).for_each(task);
        return;
    }
    assert!(num_tasks <= MAX_TASKS, "{num_tasks} tasks in one for_each");
    let team = team();
    if team.busy.swap(true, Acquire) {
        (0..num_tasks).into_par_iter().for_each(&task);
        return;
    }
    let job: &(dyn Fn(usize) + Sync) = &task;
    // SAFETY: the reference is only dereferenced by a thread holding an unfinished task of this
    // call's generation, and `Call::drop` waits for every task to finish before `task` dies.
    let job: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(job) };
    let call = Call::publish(team, job, num_tasks);
    while let Some(i) = team.claim(call.generation) {
        team.run(job, i);
    }
    drop(call);
}

/// `task(i, chunk)` for the `i`-th `chunk_len`-long chunk of `data` (the last may be shorter),
/// as [`for_each`] runs tasks.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    task: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk_len > 0);
    let (ptr, len) = (SendPtr(data.as_mut_ptr()), data.len());
    for_each(len.div_ceil(chunk_len), |i| {
        let start = i * chunk_len;
        let n = chunk_len.min(len - start);
        // SAFETY: chunk `i` is `start..start + n` of `data`, disjoint from every other chunk,
        // and each task index runs once while `data` is borrowed mutably by this call.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), n) };
        task(i, chunk)
    });
}

/// A pointer tasks share to write disjoint parts of one buffer.
struct SendPtr<T>(*mut T);
// SAFETY: only used by `for_each_chunk_mut`, whose tasks touch disjoint elements.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

/// The team: `helpers.len()` threads (one fewer than rayon's pool), started on first use.
struct Team {
    /// `generation << 48 | num_tasks << 24 | next_task`: the current call's state, claimed by
    /// compare-and-swap, so a claim succeeds only for a task of the call it was read from.
    ticket: AtomicU64,
    /// Tasks of the current call that have finished (or were dropped after a panic).
    done: AtomicUsize,
    /// The current call's task function; written by the owner before it publishes the ticket.
    job: UnsafeCell<Option<&'static (dyn Fn(usize) + Sync)>>,
    panicked: AtomicBool,
    busy: AtomicBool,
    helpers: Vec<Helper>,
}

// SAFETY: `job` is written only by the owner of `busy`, before a Release store of `ticket`,
// and read only by threads that then claimed a task of that ticket (Acquire), i.e. while the
// owner is waiting for that task.
unsafe impl Sync for Team {}

struct Helper {
    thread: OnceLock<Thread>,
    parked: AtomicBool,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let n = pool_threads().saturating_sub(1);
        let team: &'static Team = Box::leak(Box::new(Team {
            ticket: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            helpers: (0..n)
                .map(|_| Helper {
                    thread: OnceLock::new(),
                    parked: AtomicBool::new(false),
                })
                .collect(),
        }));
        for (i, helper) in team.helpers.iter().enumerate() {
            let handle = thread::Builder::new()
                .name(format!("mtpx-team-{}", i + 1))
                .spawn(move || team.help(helper))
                .expect("spawning a forward-pass thread");
            helper.thread.set(handle.thread().clone()).ok();
        }
        team
    })
}

/// The size of rayon's global pool, which the team matches: `RAYON_NUM_THREADS` or the CPUs.
fn pool_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
}

const TASK_BITS: u32 = 24;
const TASK_MASK: u64 = (1 << TASK_BITS) - 1;

fn ticket(generation: u64, num_tasks: usize, next: usize) -> u64 {
    (generation << (2 * TASK_BITS)) | ((num_tasks as u64) << TASK_BITS) | next as u64
}

impl Team {
    /// The next unclaimed task of call `generation`, if any.
    fn claim(&self, generation: u64) -> Option<usize> {
        let mut t = self.ticket.load(Acquire);
        loop {
            let (g, n, next) = (
                t >> (2 * TASK_BITS),
                (t >> TASK_BITS) & TASK_MASK,
                t & TASK_MASK,
            );
            if g != generation || next >= n {
                return None;
            }
            match self.ticket.compare_exchange_weak(t, t + 1, AcqRel, Acquire) {
                Ok(_) => return Some(next as usize),
                Err(now) => t = now,
            }
        }
    }

    /// Runs task `i` of the current call and counts it done, even if it panics.
    fn run(&self, job: &(dyn Fn(usize) + Sync), i: usize) {
        if catch_unwind(AssertUnwindSafe(|| job(i))).is_err() {
            self.panicked.store(true, Relaxed);
        }
        self.done.fetch_add(1, Release);
    }

    /// A helper's loop: wait for a call, take its tasks, wait again.
    fn help(&self, me: &Helper) {
        let mut seen = self.ticket.load(Acquire) >> (2 * TASK_BITS);
        loop {
            let generation = self.wait_for_call(me, seen);
            seen = generation;
            while let Some(i) = self.claim(generation) {
                // SAFETY: see `Sync for Team`: this thread holds task `i` of the current call.
                let job = unsafe { (*self.job.get()).expect("a published call has a job") };
                self.run(job, i);
            }
        }
    }

    /// Spins, then polls, then parks until a call after `seen` is published; returns its
    /// generation.
    fn wait_for_call(&self, me: &Helper, seen: u64) -> u64 {
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            let generation = self.ticket.load(Acquire) >> (2 * TASK_BITS);
            if generation != seen {
                return generation;
            }
            polls = polls.wrapping_add(1);
            // Reading the clock every 64 polls keeps it off the path that sees a new call.
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = started.elapsed();
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < POLL {
                thread::yield_now();
            } else {
                me.parked.store(true, SeqCst);
                if self.ticket.load(SeqCst) >> (2 * TASK_BITS) == seen {
                    thread::park();
                }
                me.parked.store(false, SeqCst);
            }
        }
    }
}

/// An owned call: published on creation; on drop (also when a task panics on the calling
/// thread) it takes back the unclaimed tasks, waits for the claimed ones, releases the team and
/// resumes a helper's panic.
struct Call {
    team: &'static Team,
    generation: u64,
    num_tasks: usize,
}

impl Call {
    fn publish(
        team: &'static Team,
        job: &'static (dyn Fn(usize) + Sync),
        num_tasks: usize,
    ) -> Call {
        let generation = ((team.ticket.load(Relaxed) >> (2 * TASK_BITS)) + 1) & 0xFFFF;
        team.done.store(0, Relaxed);
        team.panicked.store(false, Relaxed);
        // SAFETY: this thread owns the team (`busy`) and no task of an earlier call is running
        // (each call waited for all of its own).
        unsafe { *team.job.get() = Some(job) };
        team.ticket.store(ticket(generation, num_tasks, 0), SeqCst);
        for helper in &team.helpers {
            if helper.parked.load(SeqCst) {
                if let Some(thread) = helper.thread.get() {
                    thread.unpark();
                }
            }
        }
        Call {
            team,
            generation,
            num_tasks,
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let team = self.team;
        let mut skipped = 0;
        while team.claim(self.generation).is_some() {
            skipped += 1;
        }
        team.done.fetch_add(skipped, Release);
        while team.done.load(Acquire) < self.num_tasks {
            std::hint::spin_loop();
        }
        let panicked = team.panicked.load(Relaxed);
        team.busy.store(false, Release);
        if panicked && !thread::panicking() {
            resume_unwind(Box::new("a forward-pass task panicked on a team thread"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_across_many_calls() {
        for n in [0usize, 1, 2, 3, 17, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                for_each(n, |i| {
                    hits[i].fetch_add(1, Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{n} tasks");
            }
        }
    }

    #[test]
    fn chunks_cover_the_slice_once() {
        let mut v = vec![0u32; 1003];
        for_each_chunk_mut(&mut v, 100, |i, chunk| {
            assert_eq!(chunk.len(), if i == 10 { 3 } else { 100 });
            for x in chunk {
                *x += 1 + i as u32;
            }
        });
        assert!(v
            .iter()
            .enumerate()
            .all(|(k, &x)| x == 1 + (k / 100) as u32));
    }

    #[test]
    fn concurrent_and_nested_calls_fall_back_and_still_run_everything() {
        let total = AtomicUsize::new(0);
        rayon::scope(|s| {
            for _ in 0..4 {
                s.spawn(|_| {
                    for _ in 0..20 {
                        for_each(8, |_| {
                            for_each(3, |_| {
                                total.fetch_add(1, Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Relaxed), 4 * 20 * 8 * 3);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_team_keeps_working() {
        let caught = std::panic::catch_unwind(|| {
            for_each(64, |i| {
                if i == 40 {
                    panic!("task 40");
                }
            })
        });
        assert!(caught.is_err());
        let count = AtomicUsize::new(0);
        for_each(64, |_| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 64);
    }
}
