//! The pool's own threads — the committer's (`gc::background_loop`), the cleaner's
//! (`gc::cleaner_loop`) and the filter thread (`ibid-filters`) — and how the committer is
//! woken early ([`Threads`]); when foreground I/O last ran and whether the pool has failed
//! ([`Health`]).

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The committer's and the cleaner's threads (started and stopped by `Pool`).
pub(crate) struct Background {
    /// Set to make both threads return.
    pub stop: Arc<AtomicBool>,
    /// The committer's thread (`gc::background_loop`).
    pub thread: JoinHandle<()>,
    /// The segment cleaner's thread (`gc::cleaner_loop`).
    pub cleaner: JoinHandle<()>,
}

/// The pool's threads and the committer's wake-up flag.
#[derive(Default)]
pub(crate) struct Threads {
    background: Mutex<Option<Background>>,
    /// The filter thread: rebuilds the dedup filter after the pool opens and whenever the
    /// pool outgrows it, and builds the layer filters after the pool opens.
    filters: Mutex<Option<JoinHandle<()>>>,
    woken: Mutex<bool>,
    wake: Condvar,
    /// Set once the pool starts closing: work on the filter thread gives up (see
    /// [`Threads::closing`]).
    closing: AtomicBool,
}

impl Threads {
    /// Keeps the started background threads.
    pub(crate) fn started(&self, background: Background) {
        let old = self.background.lock().replace(background);
        debug_assert!(old.is_none(), "background threads started twice");
    }

    /// Tells the background threads to stop and waits for them (if they run).
    pub(crate) fn stop(&self) {
        self.closing.store(true, Ordering::Release);
        let Some(bg) = self.background.lock().take() else {
            return;
        };
        bg.stop.store(true, Ordering::Release);
        self.wake();
        bg.cleaner.thread().unpark();
        let _ = bg.thread.join();
        let _ = bg.cleaner.join();
    }

    /// Wakes the committer's thread before its interval ends.
    pub(crate) fn wake(&self) {
        *self.woken.lock() = true;
        self.wake.notify_one();
    }

    /// Whether the pool is closing: the filter thread's scans give up (a filter not finished
    /// keeps answering through the one it replaces, or probes; the next open builds them
    /// again), so that a close does not wait for a scan of the whole index.
    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Whether the committer has been woken since its last wait (work it does between waits
    /// that can be put off gives way to the commit asked for).
    pub(crate) fn wake_pending(&self) -> bool {
        *self.woken.lock()
    }

    /// Waits until woken or `interval` has passed, unless woken since the last wait or
    /// `stop` is set; clears the wake-up and answers whether there was one.
    pub(crate) fn wait(&self, interval: Duration, stop: &AtomicBool) -> bool {
        let mut woken = self.woken.lock();
        if !*woken && !stop.load(Ordering::Acquire) {
            self.wake.wait_for(&mut woken, interval);
        }
        std::mem::take(&mut *woken)
    }

    /// The filter thread's slot (to start the next one once the last has finished).
    pub(crate) fn filters(&self) -> MutexGuard<'_, Option<JoinHandle<()>>> {
        self.filters.lock()
    }

    /// Waits for the filter thread, if one runs.
    pub(crate) fn join_filters(&self) {
        let thread = self.filters.lock().take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Whether the pool has failed, and when foreground I/O last ran.
pub(crate) struct Health {
    /// Why the pool failed (the first error): it refuses further work until reopened.
    failed: Mutex<Option<String>>,
    opened: Instant,
    /// When a foreground request (read, write, zeroing, copy, flush) last ran, in
    /// milliseconds since `opened`.
    last_io_ms: AtomicU64,
}

impl Health {
    /// A pool opened now, not failed, with no I/O yet.
    pub(crate) fn new() -> Health {
        Health {
            failed: Mutex::new(None),
            opened: Instant::now(),
            last_io_ms: AtomicU64::new(0),
        }
    }

    /// Why the pool failed, if it has.
    pub(crate) fn failure(&self) -> Option<String> {
        self.failed.lock().clone()
    }

    /// Fails the pool with `why`, unless it has failed already (the first reason stays).
    pub(crate) fn fail(&self, why: impl FnOnce() -> String) {
        self.failed.lock().get_or_insert_with(why);
    }

    /// Notes that a foreground request runs now.
    pub(crate) fn note_io(&self) {
        self.last_io_ms
            .store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long ago the last foreground request ran (since the pool opened, if none has).
    pub(crate) fn since_last_io(&self) -> Duration {
        self.opened.elapsed().saturating_sub(Duration::from_millis(
            self.last_io_ms.load(Ordering::Relaxed),
        ))
    }
}
