//! The background scrub: a thread that reads every live chunk of the pool back and checks it
//! (`Pool::scrub_step`), at a bounded rate, one pass every `--scrub-every` and whenever asked
//! (`POST /api/v1/pool/scrub`). Its progress and findings — each damaged chunk with the volume
//! and snapshot blocks that read it — are in `GET /api/v1/pool/scrub` and the metrics.

use ibid_engine::Pool;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Chunks checked per step (between two looks at the rate and the stop flag).
const STEP_CHUNKS: usize = 256;

/// A damaged chunk as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct DamageView {
    /// Chunk id.
    pub chunk: u64,
    /// Why its check failed.
    pub why: String,
    /// The blocks that read it.
    pub places: Vec<PlaceView>,
}

/// One block that reads a damaged chunk.
#[derive(Debug, Clone, Serialize)]
pub struct PlaceView {
    /// Volume, or `VOLUME@SNAPSHOT`.
    pub volume: String,
    /// Block number (4 KiB blocks).
    pub block: u64,
    /// Byte offset of the block.
    pub offset: u64,
}

/// What the scrub is doing and has found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScrubStatus {
    /// A pass is running.
    pub running: bool,
    /// Bytes per second a pass reads at most.
    pub rate_bytes_per_s: u64,
    /// Seconds between the starts of passes (none: passes run only on request).
    pub every_s: Option<u64>,
    /// Passes completed since the server started.
    pub passes: u64,
    /// When the current (or last) pass started, Unix seconds.
    pub pass_started_unix_s: Option<u64>,
    /// When the last complete pass ended, Unix seconds.
    pub last_pass_finished_unix_s: Option<u64>,
    /// Chunks checked by the current (or last) pass.
    pub checked_chunks: u64,
    /// Bytes read by the current (or last) pass.
    pub checked_bytes: u64,
    /// Live chunks when the pass started.
    pub total_chunks: u64,
    /// Damaged chunks the current (or last) pass found.
    pub damaged: Vec<DamageView>,
    /// Chunks checked since the server started.
    pub checked_chunks_total: u64,
    /// Bytes read since the server started.
    pub checked_bytes_total: u64,
    /// Damaged chunks found since the server started.
    pub damaged_total: u64,
    /// The error that ended the last pass early, if one did.
    pub error: Option<String>,
}

#[derive(Default)]
struct Shared {
    status: ScrubStatus,
    requested: bool,
    stop: bool,
}

/// The scrub thread and its status.
pub struct Scrubber {
    shared: Mutex<Shared>,
    wake: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Scrubber {
    /// Starts the scrub thread on `pool`: passes at most `rate` bytes per second, one every
    /// `every` (the first one `every` after the start; `None`: only on request).
    pub fn start(pool: Pool, rate: u64, every: Option<Duration>) -> Arc<Scrubber> {
        let s = Arc::new(Scrubber {
            shared: Mutex::new(Shared {
                status: ScrubStatus {
                    rate_bytes_per_s: rate,
                    every_s: every.map(|d| d.as_secs()),
                    ..ScrubStatus::default()
                },
                ..Shared::default()
            }),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        });
        let me = s.clone();
        let thread = std::thread::Builder::new()
            .name("ibid-scrub".into())
            .spawn(move || me.run(pool, rate.max(1), every))
            .expect("spawn scrub thread");
        *s.thread.lock() = Some(thread);
        s
    }

    /// Asks for a pass now; returns false if one is already running.
    pub fn request(&self) -> bool {
        let mut sh = self.shared.lock();
        if sh.status.running {
            return false;
        }
        sh.requested = true;
        self.wake.notify_all();
        true
    }

    /// A copy of the status.
    pub fn status(&self) -> ScrubStatus {
        self.shared.lock().status.clone()
    }

    /// Stops the thread (at the end of its current step) and waits for it.
    pub fn stop(&self) {
        self.shared.lock().stop = true;
        self.wake.notify_all();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    fn run(&self, pool: Pool, rate: u64, every: Option<Duration>) {
        let mut next_due = every.map(|d| Instant::now() + d);
        loop {
            {
                let mut sh = self.shared.lock();
                loop {
                    if sh.stop {
                        return;
                    }
                    if sh.requested || next_due.is_some_and(|t| Instant::now() >= t) {
                        break;
                    }
                    match next_due {
                        Some(t) => {
                            let _ = self.wake.wait_until(&mut sh, t);
                        }
                        None => self.wake.wait(&mut sh),
                    }
                }
                sh.requested = false;
                let st = &mut sh.status;
                st.running = true;
                st.pass_started_unix_s = Some(unix_now());
                st.checked_chunks = 0;
                st.checked_bytes = 0;
                st.total_chunks = pool.stats().unique_chunks;
                st.damaged.clear();
                st.error = None;
            }
            next_due = every.map(|d| Instant::now() + d);
            let finished = self.pass(&pool, rate);
            let mut sh = self.shared.lock();
            let st = &mut sh.status;
            st.running = false;
            match finished {
                Ok(true) => {
                    st.passes += 1;
                    st.last_pass_finished_unix_s = Some(unix_now());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!("scrub: {e}");
                    st.error = Some(e.to_string());
                }
            }
        }
    }

    /// One pass; `Ok(false)` if stopped before its end.
    fn pass(&self, pool: &Pool, rate: u64) -> ibid_engine::Result<bool> {
        let started = Instant::now();
        let mut read = 0u64;
        let mut from = 0u64;
        loop {
            if self.shared.lock().stop {
                return Ok(false);
            }
            let step = pool.scrub_step(from, STEP_CHUNKS)?;
            read += step.bytes;
            {
                let mut sh = self.shared.lock();
                let st = &mut sh.status;
                st.checked_chunks += step.checked;
                st.checked_bytes += step.bytes;
                st.checked_chunks_total += step.checked;
                st.checked_bytes_total += step.bytes;
                st.damaged_total += step.damaged.len() as u64;
                for d in step.damaged {
                    tracing::error!(
                        "scrub: chunk {:#x} is damaged ({}); it is read by {} block(s)",
                        d.chunk,
                        d.why,
                        d.places.len()
                    );
                    st.damaged.push(DamageView {
                        chunk: d.chunk,
                        why: d.why,
                        places: (d.places.into_iter())
                            .map(|(volume, block)| PlaceView {
                                volume,
                                block,
                                offset: block * 4096,
                            })
                            .collect(),
                    });
                }
            }
            match step.next {
                Some(next) => from = next,
                None => return Ok(true),
            }
            // At most `rate` bytes per second over the pass: sleep until the bytes read so
            // far are due (in slices, so a stop is not kept waiting).
            let due = Duration::from_secs_f64(read as f64 / rate as f64);
            while started.elapsed() < due {
                if self.shared.lock().stop {
                    return Ok(false);
                }
                std::thread::sleep((due - started.elapsed()).min(Duration::from_millis(100)));
            }
        }
    }
}
