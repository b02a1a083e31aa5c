//! A fixed set of threads that run backend calls for every connection of one server.
//!
//! Backend calls block (disk reads, fsync, waits for a commit), so they cannot run on the
//! async runtime. A per-request `tokio::spawn` + `spawn_blocking` costs several thread
//! handoffs per request and lets hundreds of threads contend for the backend's locks on a
//! small machine; a bounded pool fed by one queue keeps each worker busy while requests keep
//! coming (no wake-up per request) and bounds the contention. The queue is unbounded: each
//! connection already bounds what it has in flight.

use crossbeam_channel::{Receiver, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tracing::warn;

/// Default number of worker threads: one per request of a client at queue depth 32, so such a
/// client's requests all run at once (measured best of 4, 8, 16 and 32 on 2 cores:
/// docs/BENCHMARKS.md, "NBD worker threads").
pub const WORKERS_DEFAULT: usize = 32;

/// Largest request that runs on its connection's task (when the backend calls it quick or
/// cached) while another connection of the server has a request in flight too: one block. A
/// larger one (tens of microseconds of fingerprinting, compressing or decompressing) holds up
/// the other connections' requests queued behind it on the async runtime's thread: in a
/// database mix, 32 KiB reads and writes run inline made a log writer's 4 KiB write wait
/// ~0.5 ms for that thread, 8 KiB ones ~0.25 ms (docs/BENCHMARKS.md, "Where a log writer's
/// flush waits beside database I/O").
pub const INLINE_SHARED_BYTES_MAX: u64 = 4 << 10;

/// One unit of work: a backend call and the queuing of its reply.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// The pool. Threads end once the pool and every clone of its sender are dropped and the
/// queue is empty.
pub(crate) struct Workers {
    queue: Sender<Job>,
    /// Writes the backend calls quick run on the connection's task, not here.
    pub(crate) quick_writes_inline: bool,
    /// Reads the backend answers from memory run on the connection's task, not here.
    pub(crate) cached_reads_inline: bool,
    /// Connections with a request in flight.
    busy: Arc<AtomicUsize>,
}

/// The requests in flight of one connection, counted so that the server knows how many
/// connections are busy.
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    busy: Arc<AtomicUsize>,
}

impl Activity {
    /// Counts a request in flight until the returned guard is dropped (with its reply).
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.busy.fetch_add(1, Ordering::AcqRel);
        }
        InFlight(self.clone())
    }
}

/// One request of a connection in flight (see [`Activity::start`]).
pub(crate) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Workers {
    /// Starts `count` (at least one) worker threads.
    pub(crate) fn start(
        count: usize,
        quick_writes_inline: bool,
        cached_reads_inline: bool,
    ) -> std::io::Result<Workers> {
        let (queue, jobs) = crossbeam_channel::unbounded::<Job>();
        for i in 0..count.max(1) {
            let jobs: Receiver<Job> = jobs.clone();
            std::thread::Builder::new()
                .name(format!("ibid-nbd-{i}"))
                .spawn(move || run(&jobs))?;
        }
        Ok(Workers {
            queue,
            quick_writes_inline,
            cached_reads_inline,
            busy: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Starts counting a new connection's requests in flight.
    pub(crate) fn connection(&self) -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            busy: self.busy.clone(),
        })
    }

    /// Whether a request of `len` bytes may run on its connection's task as far as the other
    /// connections are concerned: a small one always, a larger one only while its connection
    /// (counted in flight already) is the only busy one ([`INLINE_SHARED_BYTES_MAX`]).
    pub(crate) fn inline_is_fair(&self, len: u64) -> bool {
        len <= INLINE_SHARED_BYTES_MAX || self.busy.load(Ordering::Acquire) <= 1
    }

    /// Queues `job` for the next free worker.
    pub(crate) fn submit(&self, job: Job) {
        // The receivers live as long as their threads, which only end once every sender is
        // gone; a send can only fail if every thread panicked outside a job, which `run` rules
        // out.
        if self.queue.send(job).is_err() {
            warn!("NBD workers are gone: request dropped");
        }
    }
}

fn run(jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        // A job answers its own backend call's panic (EIO); this only keeps the worker alive
        // for other connections should anything else in a job panic.
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            warn!("NBD worker job panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A job that panics does not take its worker down: the one worker runs the next job.
    #[test]
    fn a_panicking_job_leaves_the_worker_alive() {
        let workers = Workers::start(1, false, false).expect("start");
        let (tx, rx) = mpsc::channel();
        workers.submit(Box::new(|| panic!("injected")));
        workers.submit(Box::new(move || tx.send(7).expect("send")));
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(7));
    }

    /// Jobs run concurrently up to the number of workers: two jobs that each wait for the
    /// other finish on two workers.
    #[test]
    fn jobs_run_in_parallel_on_separate_workers() {
        let workers = Workers::start(2, false, false).expect("start");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let (tx, rx) = mpsc::channel();
        for i in 0..2 {
            let (barrier, tx) = (barrier.clone(), tx.clone());
            workers.submit(Box::new(move || {
                barrier.wait();
                tx.send(i).expect("send");
            }));
        }
        let mut got: Vec<i32> = (0..2)
            .map(|_| {
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("both finish")
            })
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1]);
    }
}
