//! The threads that run SCSI commands for every connection of the target.
//!
//! Backend calls block (disk reads, fsync, waits for a commit), so commands cannot run on
//! the async runtime. A `spawn_blocking` per command wakes a pooled thread for each one and
//! lets the pool grow to hundreds of threads contending for the backend's locks; a fixed pool
//! fed by one queue keeps each worker busy while commands keep coming (no wake-up per
//! command) and bounds the contention. The queue is unbounded: each session's CmdSN window
//! already bounds what it has in flight. (The NBD server runs its requests the same way.)

use crossbeam_channel::{Receiver, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tracing::warn;

/// One unit of work: a command and the queuing of its response.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// The pool. Threads end once the pool is dropped and the queue is empty.
pub(crate) struct Workers {
    queue: Sender<Job>,
}

impl Workers {
    /// Starts `count` (at least one) worker threads.
    pub(crate) fn start(count: usize) -> std::io::Result<Workers> {
        let (queue, jobs) = crossbeam_channel::unbounded::<Job>();
        for i in 0..count.max(1) {
            let jobs: Receiver<Job> = jobs.clone();
            std::thread::Builder::new()
                .name(format!("ibid-iscsi-{i}"))
                .spawn(move || run(&jobs))?;
        }
        Ok(Workers { queue })
    }

    /// Queues `job` for the next free worker.
    pub(crate) fn submit(&self, job: Job) {
        // The receivers live as long as their threads, which only end once the sender is
        // gone; `run` keeps them alive through panicking jobs.
        if self.queue.send(job).is_err() {
            warn!("iSCSI workers are gone: command dropped");
        }
    }
}

fn run(jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        // A job answers its own command's panic (HARDWARE ERROR); this only keeps the worker
        // alive for other connections should anything else in a job panic.
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            warn!("iSCSI worker job panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A job that panics does not take its worker down; jobs run in parallel up to the
    /// number of workers (two jobs that wait for each other both finish).
    #[test]
    fn survives_panics_and_runs_in_parallel() {
        let workers = Workers::start(2).expect("start");
        workers.submit(Box::new(|| panic!("injected")));
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
