//! Pacing writers to the segment cleaner, so that garbage never fills the filesystem.
//!
//! An overwrite stores its new data in a new record and leaves the old one dead in its segment
//! until the cleaner moves the segment's live records out and deletes the file. Garbage is not
//! counted as used (it is not the volumes' data), but it occupies the filesystem: when writers
//! make it faster than the cleaner frees it, it grows into the room the pool promises and then
//! into the filesystem's reserve, where new data gets ENOSPC although the volumes hold no more
//! than before (a 16 GiB volume overwritten at random for four minutes at 170 MB/s took a 43 GiB
//! pool's filesystem down to its last gigabyte, BENCHMARKS.md "The cleaner's pace").
//!
//! The **pressure** is the garbage over the room it may take ([`pressure`]): the pool's free
//! space, or what the filesystem has available beyond its reserve plus the garbage itself if
//! that is less. From [`CLEAN_ALWAYS_FROM`] on the cleaner runs whatever the load; from
//! [`PACE_FROM`] on it cleans any segment with dead bytes (emptiest first), and writers are
//! paced ([`CleanerPace::pace`]): each write of new data takes a slot in a schedule whose rate
//! is the rate the cleaner has freed space at lately, scaled from twice it at [`PACE_FROM`] to
//! nothing at a pressure of 1 (garbage as large as its room). Writes then settle where they
//! make garbage as fast as the cleaner frees it, at a pressure of about 0.75, with a quarter of
//! the room still free. Writers are paced only while the cleaner is working (a pass within
//! [`ACTIVE_WITHIN`]): when it finds nothing to clean, pacing would slow writes and free
//! nothing.
//!
//! The background thread sets the pressure after each commit and cleaning pass; writers only
//! read an atomic unless they are paced.

use crate::pacer::take_slot;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Pressure from which the cleaner runs whatever the foreground load.
pub(crate) const CLEAN_ALWAYS_FROM: f64 = 0.25;
/// Pressure from which writers are paced to the cleaner and it cleans any dead bytes.
pub(crate) const PACE_FROM: f64 = 0.5;
/// Pressure under which pacing counts as over, for telling (a little under [`PACE_FROM`]).
const CALM_UNDER: f64 = 0.45;
/// Writers are paced only while a cleaning pass ended this recently.
const ACTIVE_WITHIN: Duration = Duration::from_secs(2);
/// Longest gap between two passes still counted as cleaning time (a longer one was idle
/// time, and the pass after it counts its own duration).
const GAP_MAX: Duration = Duration::from_secs(2);
/// Weight the freeing rate keeps of its past at each pass.
const DECAY: f64 = 0.8;

/// Garbage's pressure on the pool's room: `garbage` over the smaller of the pool's `free`
/// bytes and `garbage + fs_room` (what the filesystem has beyond its reserve, plus what
/// cleaning would give back). 0 without garbage; 1 or more when garbage fills its room.
pub(crate) fn pressure(garbage: u64, free: u64, fs_room: u64) -> f64 {
    if garbage == 0 {
        return 0.0;
    }
    let room = free.min(garbage.saturating_add(fs_room));
    if room == 0 {
        return f64::INFINITY;
    }
    garbage as f64 / room as f64
}

/// The cleaner's pressure, its freeing rate and the writers' schedule.
#[derive(Debug, Default)]
pub(crate) struct CleanerPace {
    /// The pressure as last set, as `f64` bits.
    pressure: AtomicU64,
    /// Whether the pressure was at or past [`PACE_FROM`] when last set.
    over: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Decaying sums of bytes freed by passes and of the seconds they took.
    freed: f64,
    seconds: f64,
    /// When the last pass ended.
    last_pass: Option<Instant>,
    /// When the next paced write may go, if the schedule is running.
    next: Option<Instant>,
}

impl CleanerPace {
    /// Sets the pressure (see [`pressure`]); returns `Some(true)` when it reached
    /// [`PACE_FROM`] and `Some(false)` when it fell back under [`CALM_UNDER`] (worth telling),
    /// `None` otherwise (pacing works near [`PACE_FROM`] too: it would be told every second).
    pub(crate) fn set_pressure(&self, p: f64) -> Option<bool> {
        self.pressure.store(p.to_bits(), Ordering::Relaxed);
        let was = self.over.load(Ordering::Relaxed);
        let over = if was { p >= CALM_UNDER } else { p >= PACE_FROM };
        self.over.store(over, Ordering::Relaxed);
        (was != over).then_some(over)
    }

    /// The pressure as last set.
    pub(crate) fn pressure(&self) -> f64 {
        f64::from_bits(self.pressure.load(Ordering::Relaxed))
    }

    /// Records a cleaning pass that freed `freed` bytes, took `took` and ended at `now`. The
    /// time it counts is the gap since the previous pass ended (commits run between passes
    /// on the same thread: the rate is what the cleaner keeps up while they do), or its own
    /// duration after an idle time.
    pub(crate) fn note_pass(&self, freed: u64, took: Duration, now: Instant) {
        let mut s = self.state.lock();
        let gap = s
            .last_pass
            .map(|l| now.saturating_duration_since(l))
            .filter(|&g| g <= took + GAP_MAX)
            .unwrap_or(took);
        s.freed = s.freed * DECAY + freed as f64;
        s.seconds = s.seconds * DECAY + gap.as_secs_f64();
        s.last_pass = Some(now);
    }

    /// Bytes per second the cleaner has freed lately, if measured.
    pub(crate) fn freeing_rate(&self) -> Option<f64> {
        let s = self.state.lock();
        (s.seconds > 0.0 && s.freed > 0.0).then(|| s.freed / s.seconds)
    }

    /// Whether writes are paced now (a write may then sleep: not one to run where a thread
    /// must not block).
    pub(crate) fn paces(&self, now: Instant) -> bool {
        self.pressure() >= PACE_FROM && self.active(&self.state.lock(), now)
    }

    fn active(&self, s: &State, now: Instant) -> bool {
        s.last_pass
            .is_some_and(|l| now.saturating_duration_since(l) <= ACTIVE_WITHIN)
    }

    /// Takes the next slot for a write of `bytes` new bytes and returns how long its writer
    /// should wait for it: zero under [`PACE_FROM`] or while the cleaner is not working, at
    /// most [`crate::pacer::DELAY_MAX`].
    pub(crate) fn pace(&self, bytes: u64, now: Instant) -> Duration {
        let p = self.pressure();
        if p < PACE_FROM {
            // No lock for the writes of a pool whose cleaner keeps up. A schedule left
            // behind restarts from `now` (or at most one longest wait ahead) when pacing does.
            return Duration::ZERO;
        }
        let mut s = self.state.lock();
        if !self.active(&s, now) {
            s.next = None;
            return Duration::ZERO;
        }
        let rate = if s.seconds > 0.0 {
            s.freed / s.seconds
        } else {
            0.0
        };
        let scale = (2.0 * (1.0 - p) / (1.0 - PACE_FROM)).max(0.0);
        take_slot(&mut s.next, rate * scale, bytes, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacer::DELAY_MAX;

    #[test]
    fn pressure_is_garbage_over_the_smaller_room() {
        assert_eq!(pressure(0, 0, 0), 0.0);
        assert_eq!(pressure(25, 100, 1000), 0.25);
        // The filesystem has less: 50 garbage + 50 beyond its reserve.
        assert_eq!(pressure(50, 1000, 50), 0.5);
        assert_eq!(pressure(10, 0, 0), f64::INFINITY);
        assert!(pressure(u64::MAX, u64::MAX, u64::MAX) <= 1.0);
    }

    #[test]
    fn crossing_the_pacing_pressure_is_told_once_each_way() {
        let c = CleanerPace::default();
        assert_eq!(c.set_pressure(0.3), None);
        assert_eq!(c.set_pressure(0.5), Some(true));
        assert_eq!(c.set_pressure(0.9), None);
        // Around the threshold: nothing to tell.
        assert_eq!(c.set_pressure(0.49), None);
        assert_eq!(c.set_pressure(0.5), None);
        assert_eq!(c.set_pressure(0.1), Some(false));
        assert_eq!(c.pressure(), 0.1);
    }

    fn working(freed_per_s: u64, p: f64, now: Instant) -> CleanerPace {
        let c = CleanerPace::default();
        c.note_pass(freed_per_s, Duration::from_secs(1), now);
        c.set_pressure(p);
        c
    }

    #[test]
    fn writers_go_free_under_the_pacing_pressure_or_while_the_cleaner_is_idle() {
        let now = Instant::now();
        let c = working(1 << 20, 0.49, now);
        assert_eq!(c.pace(1 << 20, now), Duration::ZERO);
        assert!(!c.paces(now));
        c.set_pressure(0.6);
        assert!(c.paces(now));
        // No pass for longer than ACTIVE_WITHIN: nothing to clean, nothing paced.
        let later = now + ACTIVE_WITHIN + Duration::from_millis(1);
        assert!(!c.paces(later));
        assert_eq!(c.pace(1 << 20, later), Duration::ZERO);
        // Never measured.
        let c = CleanerPace::default();
        c.set_pressure(0.9);
        assert_eq!(c.pace(4096, now), Duration::ZERO);
    }

    #[test]
    fn slots_follow_the_freeing_rate_scaled_by_the_pressure() {
        let now = Instant::now();
        // 1 MB/s freed; at 0.75 writers get that rate: 1 ms per 1,000 bytes.
        let c = working(1_000_000, 0.75, now);
        assert_eq!(c.pace(1000, now), Duration::from_millis(1));
        assert_eq!(c.pace(1000, now), Duration::from_millis(2));
        // At PACE_FROM, twice the rate.
        let c = working(1_000_000, PACE_FROM, now);
        assert_eq!(c.pace(2000, now), Duration::from_millis(1));
        // Garbage as large as its room (or more): the longest wait.
        let c = working(1_000_000, 1.0, now);
        assert_eq!(c.pace(1, now), DELAY_MAX);
        let c = working(1_000_000, f64::INFINITY, now);
        assert_eq!(c.pace(1, now), DELAY_MAX);
    }

    /// The rate after two passes of 1,000 bytes and 100 ms, the second ending `apart` after
    /// the first.
    fn rate_after_two_passes(apart: Duration) -> f64 {
        let t0 = Instant::now();
        let c = CleanerPace::default();
        c.note_pass(1000, Duration::from_millis(100), t0);
        c.note_pass(1000, Duration::from_millis(100), t0 + apart);
        c.freeing_rate().expect("measured")
    }

    #[test]
    fn the_rate_counts_the_gaps_between_passes_and_not_idle_time() {
        let c = CleanerPace::default();
        assert_eq!(c.freeing_rate(), None);
        c.note_pass(1000, Duration::from_millis(100), Instant::now());
        assert!((c.freeing_rate().expect("measured") - 10_000.0).abs() < 1e-6);
        // The next pass ends 1 s later: the gap (commits in between) is the time.
        let r = (1000.0 * DECAY + 1000.0) / (0.1 * DECAY + 1.0);
        assert!((rate_after_two_passes(Duration::from_secs(1)) - r).abs() < 1e-6);
        // After a minute idle, the pass counts its own duration.
        let r = (1000.0 * DECAY + 1000.0) / (0.1 * DECAY + 0.1);
        assert!((rate_after_two_passes(Duration::from_secs(60)) - r).abs() < 1e-6);
    }
}
