//! Rate limiters. Both are pure state machines: the caller passes the time.
//!
//! - [`FixedWindow`]: RMB's per-twin limit (spec/rmb.md §3.5): a count and a byte budget per
//!   key per window (window index = now / window). Every frame counts, including refused ones,
//!   except a single frame larger than the byte budget: that one is refused before counting.
//! - [`ByteNanos`]: a byte rate per key as one "next allowed nanosecond" per key; each message
//!   pushes it forward by `bytes * nanos_per_byte`. SBD's per-IP limit (spec/sbd.md §1.10) asks
//!   `check`: the message is allowed if the debt stays within the burst, and the state moves even
//!   when the check fails, so a flood keeps digging its own hole. The tunnel's upload rate asks
//!   `delay`: the bytes were read already, so they are charged, and the answer is how long the
//!   reader must wait until the debt is back within the burst (it pauses, nothing is refused).

use std::collections::HashMap;
use std::hash::Hash;

#[derive(Debug, Clone, Copy)]
struct Window {
    index: u64,
    count: u64,
    bytes: u64,
}

/// Count and byte budget per key per fixed window.
#[derive(Debug)]
pub struct FixedWindow<K> {
    count: u64,
    size: u64,
    window_secs: u64,
    state: HashMap<K, Window>,
}

impl<K: Hash + Eq> FixedWindow<K> {
    pub fn new(count: u64, size: u64, window_secs: u64) -> Self {
        Self {
            count,
            size,
            window_secs: window_secs.max(1),
            state: HashMap::new(),
        }
    }

    /// Count one message of `size` bytes for `key` at `now_secs`; true if it is allowed.
    pub fn check(&mut self, key: K, size: u64, now_secs: u64) -> bool {
        if size > self.size {
            return false; // as rmb-rs: refused outright, before it is counted
        }
        let index = now_secs / self.window_secs;
        let entry = self.state.entry(key).or_insert(Window {
            index,
            count: 0,
            bytes: 0,
        });
        if entry.index != index {
            *entry = Window {
                index,
                count: 0,
                bytes: 0,
            };
        }
        entry.count = entry.count.saturating_add(1);
        entry.bytes = entry.bytes.saturating_add(size);
        entry.count <= self.count && entry.bytes <= self.size
    }

    /// Forget keys whose window is over (their next message starts a fresh window anyway).
    pub fn prune(&mut self, now_secs: u64) -> usize {
        let index = now_secs / self.window_secs;
        let before = self.state.len();
        self.state.retain(|_, w| w.index == index);
        before - self.state.len()
    }

    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }
}

/// One byte-nanos charge: the debt after it (nanoseconds past `now_nanos`); the state moves
/// whatever the caller makes of the answer.
fn charge(next: &mut u64, size: u64, now_nanos: u64, nanos_per_byte: u64) -> u64 {
    let cur = (*next)
        .max(now_nanos)
        .saturating_add(size.saturating_mul(nanos_per_byte));
    *next = cur;
    cur - now_nanos
}

/// SBD's byte-nanos limiter with burst.
#[derive(Debug)]
pub struct ByteNanos<K> {
    nanos_per_byte: u64,
    burst_nanos: u64,
    next: HashMap<K, u64>,
}

impl<K: Hash + Eq> ByteNanos<K> {
    pub fn new(nanos_per_byte: u64, burst_bytes: u64) -> Self {
        Self {
            nanos_per_byte,
            burst_nanos: burst_bytes.saturating_mul(nanos_per_byte),
            next: HashMap::new(),
        }
    }

    /// `cur = max(next, now) + n * rate; next = cur; ok = cur - now <= burst`.
    pub fn check(&mut self, key: K, size: u64, now_nanos: u64) -> bool {
        self.delay(key, size, now_nanos) == 0
    }

    /// Charge `size` bytes and answer how many nanoseconds from `now_nanos` the debt is back
    /// within the burst (0: it is now): `cur - now - burst`, at least 0.
    pub fn delay(&mut self, key: K, size: u64, now_nanos: u64) -> u64 {
        let rate = self.nanos_per_byte;
        let debt = charge(self.next.entry(key).or_insert(0), size, now_nanos, rate);
        debt.saturating_sub(self.burst_nanos)
    }

    /// Remove keys idle for at least `idle_nanos` (their debt is long paid).
    pub fn prune(&mut self, now_nanos: u64, idle_nanos: u64) -> usize {
        let before = self.next.len();
        self.next
            .retain(|_, next| now_nanos < next.saturating_add(idle_nanos));
        before - self.next.len()
    }

    pub fn len(&self) -> usize {
        self.next.len()
    }

    pub fn is_empty(&self) -> bool {
        self.next.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_window_allows_exactly_count_messages() {
        let mut l = FixedWindow::new(3, 1000, 60);
        assert!(l.check(7, 10, 120));
        assert!(l.check(7, 10, 130));
        assert!(l.check(7, 10, 179));
        assert!(!l.check(7, 10, 179));
        assert!(l.check(8, 10, 179), "keys are independent");
        assert!(l.check(7, 10, 180), "a new window starts afresh");
    }

    #[test]
    fn fixed_window_counts_bytes_and_refused_frames() {
        let mut l = FixedWindow::new(100, 100, 60);
        assert!(l.check(1, 60, 0));
        assert!(!l.check(1, 60, 0), "120 bytes > 100");
        assert!(!l.check(1, 1, 0), "the refused frame still counted");
        let mut l = FixedWindow::new(100, 100, 60);
        assert!(
            !l.check(1, 101, 0),
            "a single oversize frame is refused outright"
        );
    }

    #[test]
    fn fixed_window_prune_keeps_current_windows() {
        let mut l = FixedWindow::new(10, 10, 60);
        l.check(1, 1, 0);
        l.check(2, 1, 61);
        assert_eq!(l.prune(62), 1);
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn byte_nanos_burst_math_matches_sbd() {
        // defaults: 1000 kbps -> 8000 ns/byte, burst 262144 bytes
        let mut l = ByteNanos::new(8000, 262_144);
        assert!(l.check("ip", 262_144, 1_000));
        assert!(!l.check("ip", 1, 1_000), "one byte over the burst");
        // the failed check still moved the state: debt = 262145 bytes
        let later = 1_000 + 8000 * 2;
        assert!(
            l.check("ip", 1, later),
            "two bytes' time paid back one byte plus the failure"
        );
    }

    #[test]
    fn byte_nanos_refills_over_time() {
        let mut l = ByteNanos::new(10, 100);
        assert!(l.check("a", 100, 0));
        assert!(!l.check("a", 50, 0));
        // debt is 150 bytes = 1500 ns; after 1000 ns it is 50 bytes: 50 more fit
        assert!(l.check("a", 50, 1_000));
    }

    #[test]
    fn byte_nanos_delay_is_the_wait_until_the_debt_is_within_the_burst() {
        let mut l = ByteNanos::new(10, 100);
        assert_eq!(l.delay("a", 100, 0), 0, "the burst passes at once");
        assert_eq!(l.delay("a", 50, 0), 500, "50 bytes over: 500 ns");
        assert_eq!(l.delay("a", 0, 500), 0, "paid back by then");
        assert_eq!(
            l.delay("a", 10, 400),
            200,
            "an early reader finds the debt it left"
        );
        assert!(!l.check("a", 0, 400), "check and delay are one state");
    }

    #[test]
    fn byte_nanos_prune_only_idle_keys() {
        let mut l = ByteNanos::new(10, 100);
        l.check("old", 1, 0);
        l.check("busy", 100, 10_000_000_000);
        assert_eq!(l.prune(10_000_000_010, 10_000_000_000), 1);
        assert_eq!(l.len(), 1);
    }
}

pub mod py {
    use pyo3::prelude::*;

    fn unsigned(value: i64, what: &str) -> PyResult<u64> {
        u64::try_from(value).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!("{what} must not be negative"))
        })
    }

    /// Count and byte budget per twin per window (RMB).
    #[pyclass(module = "rmb_relay._core")]
    pub struct FixedWindowLimiter {
        pub(crate) inner: super::FixedWindow<u32>,
    }

    #[pymethods]
    impl FixedWindowLimiter {
        #[new]
        #[pyo3(signature = (count, size, window_secs = 60))]
        fn new(count: i64, size: i64, window_secs: i64) -> PyResult<Self> {
            let window = unsigned(window_secs, "window_secs")?;
            if window == 0 {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "window_secs must be > 0",
                ));
            }
            Ok(Self {
                inner: super::FixedWindow::new(
                    unsigned(count, "count")?,
                    unsigned(size, "size")?,
                    window,
                ),
            })
        }

        fn check(&mut self, key: u32, size: u64, now_secs: u64) -> bool {
            self.inner.check(key, size, now_secs)
        }

        fn prune(&mut self, now_secs: u64) -> usize {
            self.inner.prune(now_secs)
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }
    }

    /// A byte rate per key (SBD per IP: `check`; tunnel uploads: `delay`).
    #[pyclass(module = "rmb_relay._core")]
    pub struct ByteNanosLimiter {
        pub(crate) inner: super::ByteNanos<String>,
    }

    #[pymethods]
    impl ByteNanosLimiter {
        #[new]
        fn new(nanos_per_byte: i64, burst_bytes: i64) -> PyResult<Self> {
            Ok(Self {
                inner: super::ByteNanos::new(
                    unsigned(nanos_per_byte, "nanos_per_byte")?,
                    unsigned(burst_bytes, "burst_bytes")?,
                ),
            })
        }

        fn check(&mut self, key: &str, size: u64, now_nanos: u64) -> bool {
            // look up by &str first so the common case allocates nothing
            self.inner.delay_str(key, size, now_nanos) == 0
        }

        fn delay(&mut self, key: &str, size: u64, now_nanos: u64) -> u64 {
            self.inner.delay_str(key, size, now_nanos)
        }

        #[pyo3(signature = (now_nanos, idle_nanos = 10_000_000_000))]
        fn prune(&mut self, now_nanos: u64, idle_nanos: u64) -> usize {
            self.inner.prune(now_nanos, idle_nanos)
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<FixedWindowLimiter>()?;
        m.add_class::<ByteNanosLimiter>()?;
        Ok(())
    }
}

impl ByteNanos<String> {
    /// [`ByteNanos::delay`] for string keys without allocating when the key is known.
    pub fn delay_str(&mut self, key: &str, size: u64, now_nanos: u64) -> u64 {
        if let Some(next) = self.next.get_mut(key) {
            let debt = charge(next, size, now_nanos, self.nanos_per_byte);
            return debt.saturating_sub(self.burst_nanos);
        }
        self.delay(key.to_owned(), size, now_nanos)
    }

    /// [`ByteNanos::check`] for string keys without allocating when the key is known.
    pub fn check_str(&mut self, key: &str, size: u64, now_nanos: u64) -> bool {
        self.delay_str(key, size, now_nanos) == 0
    }
}
