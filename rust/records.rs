//! Route records of the fast path, appended by the scanners inside `feed`.
//!
//! Appending a record from Python cost about 230 ns a message (a tuple, a clock read, an
//! `array.extend`), half of what forwarding the message costs. The scanner already holds the
//! source, the destination and the size of every message it routes, so it appends them here
//! (four integers, a few ns) and Python takes the whole buffer once per flush as one `bytes`
//! that numpy views without a loop over records.
//!
//! A record is appended when the scan alone says the message will be delivered to a local
//! connection; the dialect retracts it (by the index the routing carries) on the rare paths
//! where it decides otherwise (the rate limiter, a connection gone since the scan). A retracted
//! record stays in place with size -1, so indexes stay valid until the next `take`, which
//! leaves it out.
//!
//! Sans-I/O: the time of a record is the caller's clock reading passed into `feed`.
//! Addresses are integers: RMB twin ids as they are, SBD keys interned here (`key_id`), the
//! new keys handed over with the rows.

use std::collections::HashMap;

/// Fields per record: time (ns), source, destination, size.
pub const FIELDS: usize = 4;

/// The records appended since the last `take`, and the SBD keys interned so far.
#[derive(Debug, Default)]
pub struct Records {
    rows: Vec<i64>,
    /// records taken before `rows` started: a record's index is `base + position`
    base: u64,
    ids: HashMap<[u8; 32], i64>,
    keys: Vec<[u8; 32]>,
    /// keys already handed over by `take`
    keys_taken: usize,
    /// records in `rows` marked retracted (dropped by `take`)
    retracted: usize,
    /// added to the caller's clock reading: the scanners' clock may be monotonic, records are
    /// in wall time (the caller sets it from its two clocks)
    pub offset: i64,
}

impl Records {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append one record; its index (for `retract`).
    #[inline]
    pub fn push(&mut self, time: u64, src: i64, dst: i64, size: usize) -> i64 {
        let index = self.base + (self.rows.len() / FIELDS) as u64;
        let time = i64::try_from(time)
            .unwrap_or(i64::MAX)
            .saturating_add(self.offset);
        self.rows
            .extend_from_slice(&[time, src, dst, i64::try_from(size).unwrap_or(i64::MAX)]);
        index as i64
    }

    /// Mark a record of the current buffer as not delivered; false if `index` is not in it.
    pub fn retract(&mut self, index: i64) -> bool {
        let Ok(index) = u64::try_from(index) else {
            return false;
        };
        let Some(position) = index.checked_sub(self.base) else {
            return false;
        };
        let slot = position as usize * FIELDS + 3;
        match self.rows.get_mut(slot) {
            Some(size) if *size >= 0 => {
                *size = -1;
                self.retracted += 1;
                true
            }
            _ => false,
        }
    }

    /// The integer an SBD key is recorded as (stable for the life of the buffer).
    #[inline]
    pub fn key_id(&mut self, key: &[u8; 32]) -> i64 {
        if let Some(&id) = self.ids.get(key) {
            return id;
        }
        let id = self.keys.len() as i64;
        self.keys.push(*key);
        self.ids.insert(*key, id);
        id
    }

    /// Records appended (retracted ones included) since the last `take`.
    pub fn len(&self) -> usize {
        self.rows.len() / FIELDS
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows so far without the retracted ones, and the keys interned since the last
    /// take; the buffer starts over.
    pub fn take(&mut self) -> (Vec<i64>, &[[u8; 32]]) {
        let mut rows = std::mem::take(&mut self.rows);
        self.base += (rows.len() / FIELDS) as u64;
        if self.retracted > 0 {
            let mut kept = 0;
            for i in (0..rows.len()).step_by(FIELDS) {
                if rows[i + 3] >= 0 {
                    rows.copy_within(i..i + FIELDS, kept);
                    kept += FIELDS;
                }
            }
            rows.truncate(kept);
            self.retracted = 0;
        }
        let new = &self.keys[self.keys_taken..];
        self.keys_taken = self.keys.len();
        (rows, new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_four_integers_in_order() {
        let mut r = Records::new();
        assert_eq!(r.push(10, 1, 2, 3), 0);
        assert_eq!(r.push(11, 4, 5, 6), 1);
        assert_eq!(r.len(), 2);
        let (rows, keys) = r.take();
        assert_eq!(rows, vec![10, 1, 2, 3, 11, 4, 5, 6]);
        assert!(keys.is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn indexes_continue_across_takes_and_retract_only_the_current_buffer() {
        let mut r = Records::new();
        r.push(1, 1, 1, 1);
        r.take();
        let index = r.push(2, 2, 2, 20);
        assert_eq!(index, 1);
        assert!(!r.retract(0)); // taken already
        assert!(!r.retract(-1));
        assert!(!r.retract(5));
        assert!(r.retract(index));
        assert!(!r.retract(index)); // once
        r.push(3, 3, 3, 30);
        assert_eq!(r.take().0, vec![3, 3, 3, 30]);
    }

    #[test]
    fn the_offset_moves_the_callers_clock_to_wall_time() {
        let mut r = Records::new();
        r.offset = 1_000;
        r.push(5, 0, 0, 0);
        r.offset = -10;
        r.push(5, 0, 0, 0);
        assert_eq!(r.take().0, vec![1_005, 0, 0, 0, -5, 0, 0, 0]);
    }

    #[test]
    fn keys_are_interned_and_handed_over_once() {
        let mut r = Records::new();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(r.key_id(&a), 0);
        assert_eq!(r.key_id(&b), 1);
        assert_eq!(r.key_id(&a), 0);
        assert_eq!(r.take().1, &[a, b]);
        assert!(r.take().1.is_empty());
        assert_eq!(r.key_id(&[3u8; 32]), 2);
        assert_eq!(r.take().1, &[[3u8; 32]]);
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    /// Route records appended by the scanners that hold this buffer (see the module docs).
    #[pyclass(module = "rmb_relay._core")]
    pub struct RecordBuffer {
        pub inner: super::Records,
    }

    #[pymethods]
    impl RecordBuffer {
        #[new]
        fn new() -> Self {
            RecordBuffer {
                inner: super::Records::new(),
            }
        }

        /// Nanoseconds added to the time passed into `feed` (wall clock minus the scan clock).
        #[getter]
        fn offset(&self) -> i64 {
            self.inner.offset
        }

        #[setter]
        fn set_offset(&mut self, offset: i64) {
            self.inner.offset = offset;
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }

        /// Mark the record at `index` as not delivered (size -1); False if it is not buffered.
        fn retract(&mut self, index: i64) -> bool {
            self.inner.retract(index)
        }

        /// (rows, keys): the records (retracted ones left out) as native-endian int64
        /// quadruples (time_ns, src, dst, size) in one `bytes`, and the SBD keys interned
        /// since the last take, in id order.
        fn take<'py>(
            &mut self,
            py: Python<'py>,
        ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
            let (rows, keys) = self.inner.take();
            let bytes = PyBytes::new_with(py, rows.len() * 8, |out| {
                for (chunk, value) in out.chunks_exact_mut(8).zip(&rows) {
                    chunk.copy_from_slice(&value.to_ne_bytes());
                }
                Ok(())
            })?;
            let keys = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?;
            Ok((bytes, keys))
        }

        fn __repr__(&self) -> String {
            format!("RecordBuffer(len={})", self.inner.len())
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<RecordBuffer>()
    }
}
