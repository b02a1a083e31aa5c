//! A spinner for calls that may take more than a second (full clones, copies, deletes, describes
//! of huge volumes, conversions).
//!
//! The API is synchronous: a request answers when the work is done and reports nothing on the
//! way, so there is no fraction to show. An elapsed-time spinner is the honest indicator: it says
//! the command is alive and how long it has waited, not how far along it is. It appears only after
//! [`SHOW_AFTER`] (quick calls never flicker) and only when stderr is a terminal, so pipes, logs
//! and `--json` output never see it.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a call runs before the spinner appears.
pub const SHOW_AFTER: Duration = Duration::from_secs(1);
/// Spinner redraw interval.
const TICK: Duration = Duration::from_millis(100);

/// A spinner on stderr, shown while it lives if the call lasts long enough; cleared when dropped.
pub struct Spinner {
    /// Dropping the sender tells the drawing thread the call is over.
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Spinner {
    /// Starts timing `message` (e.g. "copying vm1 to vm2"); `wanted` is false for `--json`.
    pub fn start(message: String, wanted: bool) -> Spinner {
        if !wanted || !std::io::stderr().is_terminal() {
            return Spinner {
                done: None,
                thread: None,
            };
        }
        let started = Instant::now();
        let (done, rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            if rx.recv_timeout(SHOW_AFTER) != Err(RecvTimeoutError::Timeout) {
                return; // Finished (sender dropped) within SHOW_AFTER: draw nothing.
            }
            let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                .with_style(style)
                .with_message(message)
                .with_elapsed(started.elapsed());
            bar.enable_steady_tick(TICK);
            let _ = rx.recv(); // Returns when the sender is dropped.
            bar.finish_and_clear();
        });
        Spinner {
            done: Some(done),
            thread: Some(thread),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
