//! Write pacing: writers slow down smoothly to the pace the commits keep, instead of running
//! free until the backlog hits a wall and then all waiting for a whole commit.
//!
//! The commits turn the uncommitted backlog into store changes at some rate: blocks per second
//! of commit time, measured here from every commit ([`Pacer::note_commit`]). When writers dirty
//! blocks faster than that, the backlog grows; without pacing it grew to the throttle and
//! every writer then waited for the commit in progress (seconds on a large volume overwritten
//! at random, where each commit takes that long), so clients saw bursts and stalls. With
//! pacing, once the backlog passes `dirty_blocks_commit` (the background commit has been
//! woken), each write takes a slot in a schedule ([`Pacer::pace`]): a token bucket whose rate
//! is the commit rate scaled by how full the backlog is, from twice that rate at
//! `dirty_blocks_commit` to the commit rate at `dirty_blocks_throttle` and down to nothing at
//! `dirty_blocks_max` (where a writer commits itself, as before). A writer sleeps until its
//! slot; a late wake-up is made up by the next writers (the schedule is absolute), and a
//! backlog back under `dirty_blocks_commit` lets writers go unpaced again. A paced write may
//! sleep, so it is never one a caller runs on a thread that must not block
//! ([`Pacer::paces`], `Volume::write_is_quick`).

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// The longest one write is paced: the backlog keeps growing towards the hard limit if the
/// commits fall further behind, and the writes after this one are paced harder.
pub(crate) const DELAY_MAX: Duration = Duration::from_millis(50);

/// The shortest wait a writer sleeps for: a sleep overshoots by tens of microseconds (timer
/// slack), so a shorter slot is not slept; the schedule moves on all the same, and the writers
/// after it wait for the sum once it has run that far ahead.
pub(crate) const SLEEP_MIN: Duration = Duration::from_micros(200);

/// Weight the commit rate keeps of its past at each commit (a decaying sum of commit sizes
/// over a decaying sum of commit times: small commits weigh little).
const DECAY: f64 = 0.5;

/// The backlog's thresholds, in blocks (from [`crate::PoolConfig`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Pacing starts here.
    pub commit: u64,
    /// Writes are admitted at the commit rate here.
    pub throttle: u64,
    /// Nothing is admitted by pacing here (writers commit themselves).
    pub max: u64,
}

/// The pacing schedule and the commit rate it follows.
#[derive(Debug)]
pub(crate) struct Pacer {
    limits: Limits,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Decaying sums of blocks committed and seconds spent committing them.
    blocks: f64,
    seconds: f64,
    /// When the next write may go, if the schedule is running.
    next: Option<Instant>,
}

impl Pacer {
    /// A pacer with no commit measured yet (it paces nothing until one is). Limits out of
    /// order are raised into order (a throttle at or under the commit threshold is one past
    /// it, and so on).
    pub(crate) fn new(limits: Limits) -> Pacer {
        let commit = limits.commit;
        let throttle = limits.throttle.max(commit + 1);
        let limits = Limits {
            commit,
            throttle,
            max: limits.max.max(throttle + 1),
        };
        Pacer {
            limits,
            state: Mutex::new(State {
                blocks: 0.0,
                seconds: 0.0,
                next: None,
            }),
        }
    }

    /// Records a commit of `blocks` map entries that took `took`.
    pub(crate) fn note_commit(&self, blocks: u64, took: Duration) {
        let mut s = self.state.lock();
        s.blocks = s.blocks * DECAY + blocks as f64;
        s.seconds = s.seconds * DECAY + took.as_secs_f64();
    }

    /// Blocks per second the commits have kept lately, if measured.
    pub(crate) fn commit_rate(&self) -> Option<f64> {
        let s = self.state.lock();
        rate(&s)
    }

    /// [`Pacer::pace`], with no commit measured taken as no wait.
    #[cfg(test)]
    pub(crate) fn delay(&self, blocks: u64, dirty: u64, now: Instant) -> Duration {
        self.pace(blocks, dirty, now).unwrap_or(Duration::ZERO)
    }

    /// Takes the next slot for a write of `blocks` blocks with `dirty` blocks uncommitted, and
    /// returns how long its writer should wait for it: zero when the backlog is small, at most
    /// [`DELAY_MAX`], `None` when no commit was measured yet (the caller then falls back to
    /// waiting for the commit in progress).
    pub(crate) fn pace(&self, blocks: u64, dirty: u64, now: Instant) -> Option<Duration> {
        let mut s = self.state.lock();
        let commits = rate(&s)?;
        let Limits {
            commit,
            throttle,
            max,
        } = self.limits;
        if dirty < commit {
            s.next = None;
            return Some(Duration::ZERO);
        }
        let scale = if dirty < throttle {
            1.0 + (throttle - dirty) as f64 / (throttle - commit) as f64
        } else {
            max.saturating_sub(dirty) as f64 / (max - throttle) as f64
        };
        Some(take_slot(&mut s.next, commits * scale, blocks, now))
    }

    /// Whether a write that comes with `dirty` blocks uncommitted is paced (it may wait for a
    /// slot: not a write to run where a thread must not sleep).
    pub(crate) fn paces(&self, dirty: u64) -> bool {
        dirty >= self.limits.commit && self.commit_rate().is_some()
    }
}

/// Takes the slot after `next` (or at `now`, if the schedule has not run ahead of it) for
/// `units` at `admit` units per second, moves `next` past it, and returns how long until the
/// slot: at most [`DELAY_MAX`], which is also the slot of a rate of zero.
pub(crate) fn take_slot(
    next: &mut Option<Instant>,
    admit: f64,
    units: u64,
    now: Instant,
) -> Duration {
    let start = next.map_or(now, |n| n.max(now));
    let slot = if admit > 0.0 {
        Duration::from_secs_f64((units.max(1) as f64 / admit).min(DELAY_MAX.as_secs_f64()))
    } else {
        DELAY_MAX
    };
    // The schedule never runs further ahead than one longest wait: writers past it would
    // otherwise queue behind a backlog of slots taken while the rate was low.
    let slot_at = (start + slot).min(now + DELAY_MAX);
    *next = Some(slot_at);
    slot_at.saturating_duration_since(now)
}

fn rate(s: &State) -> Option<f64> {
    // A few milliseconds of commits at least: a rate from one tiny commit says little.
    (s.seconds >= 0.005 && s.blocks >= 1.0).then(|| s.blocks / s.seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        commit: 100,
        throttle: 200,
        max: 600,
    };

    fn measured(blocks_per_s: u64) -> Pacer {
        let p = Pacer::new(LIMITS);
        p.note_commit(blocks_per_s, Duration::from_secs(1));
        p
    }

    #[test]
    fn nothing_is_paced_before_a_commit_is_measured_or_under_the_commit_threshold() {
        let p = Pacer::new(LIMITS);
        let now = Instant::now();
        assert_eq!(p.delay(1, 500, now), Duration::ZERO);
        let p = measured(1000);
        assert_eq!(p.delay(1, 99, now), Duration::ZERO);
        assert!(!p.paces(99));
        assert!(p.paces(100));
        assert!(!Pacer::new(LIMITS).paces(100), "no commit measured");
    }

    #[test]
    fn slots_follow_the_commit_rate_scaled_by_the_backlog() {
        let now = Instant::now();
        // At the throttle: the commit rate, 1,000 blocks/s, so 1 ms a block.
        let p = measured(1000);
        assert_eq!(p.delay(1, 200, now), Duration::from_millis(1));
        assert_eq!(p.delay(1, 200, now), Duration::from_millis(2));
        // At the commit threshold: twice the rate.
        let p = measured(1000);
        assert_eq!(p.delay(2, 100, now), Duration::from_millis(1));
        // Half way from the throttle to the hard limit: half the rate.
        let p = measured(1000);
        assert_eq!(p.delay(1, 400, now), Duration::from_millis(2));
        // At the hard limit: the longest wait.
        let p = measured(1000);
        assert_eq!(p.delay(1, 600, now), DELAY_MAX);
    }

    #[test]
    fn a_late_writer_takes_the_slot_at_its_arrival_and_the_schedule_is_bounded() {
        let p = measured(1000);
        let now = Instant::now();
        for _ in 0..1000 {
            assert!(p.delay(1, 300, now) <= DELAY_MAX);
        }
        assert_eq!(p.delay(1, 300, now), DELAY_MAX);
        // Much later: the schedule restarts from then.
        let later = now + Duration::from_secs(10);
        assert!(p.delay(1, 300, later) <= Duration::from_millis(2));
        // A backlog back under the threshold resets it.
        assert_eq!(p.delay(1, 50, later), Duration::ZERO);
        assert!(p.delay(1, 150, later) <= Duration::from_millis(1));
    }

    #[test]
    fn the_rate_follows_the_recent_commits_weighted_by_their_size() {
        let p = Pacer::new(LIMITS);
        assert_eq!(p.commit_rate(), None);
        p.note_commit(1000, Duration::from_secs(1));
        assert_eq!(p.commit_rate(), Some(1000.0));
        p.note_commit(3000, Duration::from_secs(1));
        // (500 + 3000) / (0.5 + 1)
        assert!((p.commit_rate().expect("measured") - 3500.0 / 1.5).abs() < 1e-6);
        // A tiny commit hardly moves it.
        p.note_commit(1, Duration::from_micros(100));
        assert!((p.commit_rate().expect("measured") - 1751.0 / 0.7501).abs() < 1e-6);
    }
}
