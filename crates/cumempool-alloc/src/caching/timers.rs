//! When the slow paths that only make the cache use its bound and slots better may run again.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// After a scan for unused streams found no slot to free, streams without a slot skip the scan
/// for this long: a scan locks every slot, and with more than `SLOTS` live streams it would run
/// on every free of the streams beyond them.
pub(super) const SLOT_SCAN_INTERVAL: Duration = Duration::from_micros(100);
/// The least time between two sweeps of threads' lanes that only make the cache better use its
/// bound: taking back their unfilled budget (per cache), and gathering a stream's blocks for a
/// thread that misses once the bound is spent (per stream; a gather also holds the budget
/// sweeps back). A sweep claims lanes, and a claim costs a `membarrier` that interrupts every
/// running thread of the process (15-50 us with 16-32 threads busy on the H200 node): without
/// this limit, a bound spent by many threads on one stream made every miss a sweep (1.5 M
/// pairs/s for 32 threads, measured). Sweeps that correctness needs (a slot given up, release,
/// stats) and the budget sweep before an eviction are never skipped.
pub(super) const LANE_SWEEP_INTERVAL: Duration = Duration::from_millis(1);

/// A duration in nanoseconds, saturating (the cache's clocks count nanoseconds in a `u64`).
pub(super) fn nanos_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// A cache's timers, in nanoseconds after it was made.
pub(super) struct Timers {
    made: Instant,
    /// Before this, streams that find no slot skip the scan for unused streams.
    next_slot_scan: AtomicU64,
    /// Before this, no lane sweep for the bound's sake runs.
    next_lane_sweep: AtomicU64,
}

impl Timers {
    pub(super) fn new() -> Self {
        Self { made: Instant::now(), next_slot_scan: AtomicU64::new(0), next_lane_sweep: AtomicU64::new(0) }
    }

    /// Nanoseconds since the cache was made.
    pub(super) fn nanos(&self) -> u64 {
        nanos_of(self.made.elapsed())
    }

    /// Whether a lane sweep for the bound's sake may run now; if so, the next one waits
    /// [`LANE_SWEEP_INTERVAL`].
    pub(super) fn lane_sweep_due(&self) -> bool {
        let now = self.nanos();
        let next = self.next_lane_sweep.load(Relaxed);
        let interval = nanos_of(LANE_SWEEP_INTERVAL);
        now >= next
            && self.next_lane_sweep.compare_exchange(next, now.saturating_add(interval), Relaxed, Relaxed).is_ok()
    }

    /// Holds lane sweeps back until at least `nanos`.
    pub(super) fn hold_lane_sweeps_until(&self, nanos: u64) {
        self.next_lane_sweep.fetch_max(nanos, Relaxed);
    }

    /// Whether a scan for unused streams found nothing less than [`SLOT_SCAN_INTERVAL`] ago.
    pub(super) fn slot_scan_resting(&self) -> bool {
        self.nanos() < self.next_slot_scan.load(Relaxed)
    }

    /// A scan for unused streams found nothing: the next waits [`SLOT_SCAN_INTERVAL`].
    pub(super) fn rest_slot_scans(&self) {
        let interval = nanos_of(SLOT_SCAN_INTERVAL);
        self.next_slot_scan.store(self.nanos().saturating_add(interval), Relaxed);
    }
}
