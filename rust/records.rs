//! Route records of the fast path, appended by the scanners inside `feed`.
//!
//! Appending a record from Python cost about 230 ns a message (a tuple, a clock read, an
//! `array.extend`), half of what forwarding the message costs. The scanner already holds the
//! source, the destination and the size of every message it routes, so it appends them here
//! (four integers, a few ns).
//!
//! The record columns are kept apart (one `Vec` each: time, source, destination, size) and
//! handed to Python as they are: `take` moves each `Vec` into a `Column`, a read-only buffer
//! that numpy and pyarrow view without a copy. The writer turns them into Arrow arrays and
//! Parquet columns of the same layout, so no record is touched between the scanner and the
//! Parquet encoder (the row-major `bytes` this replaced was copied four times on the way).
//!
//! A record is appended when the scan alone says the message will be delivered to a local
//! connection; the dialect retracts it (by the index the routing carries) on the rare paths
//! where it decides otherwise (the rate limiter, a connection gone since the scan). A retracted
//! record stays in place with size -1, so indexes stay valid until the next `take`, which
//! leaves it out.
//!
//! Sans-I/O: the time of a record is the caller's clock reading (ns) passed into `feed`, kept
//! in microseconds, the unit of the record schema's `time`.
//! Addresses are integers: RMB twin ids as they are, SBD keys interned here (`key_id`), the
//! new keys handed over with the columns.

use std::collections::HashMap;

/// Column buffers Python has finished with, for the next `take` to append into.
///
/// A batch's columns are a few MB; appending into fresh ones cost the scanners ~20 ns a record
/// (measured): the `Vec`s regrow from empty, copying as they double, and every new page is a
/// page fault, all on the event loop. A `Column` hands its buffer back here when Python drops
/// it (after the writer thread wrote it), so the scanners append into memory already mapped
/// and already big enough. Shared with the `Column`s, which may be dropped on another thread.
pub type Spares = crate::lent::Spares<i64, 8, { usize::MAX }>;

/// The record columns taken at once: time (µs), source, destination, size (bytes).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Columns {
    pub time: Vec<i64>,
    pub src: Vec<i64>,
    pub dst: Vec<i64>,
    pub size: Vec<i64>,
}

impl Columns {
    pub fn len(&self) -> usize {
        self.time.len()
    }

    pub fn is_empty(&self) -> bool {
        self.time.is_empty()
    }

    fn push(&mut self, time: i64, src: i64, dst: i64, size: i64) {
        self.time.push(time);
        self.src.push(src);
        self.dst.push(dst);
        self.size.push(size);
    }

    /// Leave out the rows whose size is negative (retracted), in place.
    fn drop_retracted(&mut self) {
        let mut kept = 0;
        for i in 0..self.size.len() {
            if self.size[i] >= 0 {
                self.time[kept] = self.time[i];
                self.src[kept] = self.src[i];
                self.dst[kept] = self.dst[i];
                self.size[kept] = self.size[i];
                kept += 1;
            }
        }
        self.time.truncate(kept);
        self.src.truncate(kept);
        self.dst.truncate(kept);
        self.size.truncate(kept);
    }
}

/// The records appended since the last `take`, and the SBD keys interned so far.
#[derive(Debug, Default)]
pub struct Records {
    columns: Columns,
    /// records taken before `columns` started: a record's index is `base + position`
    base: u64,
    ids: HashMap<[u8; 32], i64>,
    keys: Vec<[u8; 32]>,
    /// keys already handed over by `take`
    keys_taken: usize,
    /// records in `columns` marked retracted (dropped by `take`)
    retracted: usize,
    /// added to the caller's clock reading (ns): the scanners' clock may be monotonic,
    /// records are in wall time (the caller sets it from its two clocks)
    pub offset: i64,
    /// buffers handed back for the next columns
    pub spares: Spares,
}

impl Records {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append one record at the caller's clock reading `time` (ns); its index (for `retract`).
    #[inline]
    pub fn push(&mut self, time: u64, src: i64, dst: i64, size: usize) -> i64 {
        let index = self.base + self.columns.len() as u64;
        let micros = i64::try_from(time)
            .unwrap_or(i64::MAX)
            .saturating_add(self.offset)
            / 1000;
        self.columns
            .push(micros, src, dst, i64::try_from(size).unwrap_or(i64::MAX));
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
        match self.columns.size.get_mut(position as usize) {
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
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The columns so far without the retracted rows, and the keys interned since the last
    /// take; the buffer starts over.
    pub fn take(&mut self) -> (Columns, &[[u8; 32]]) {
        // the next batch is likely the size of this one
        let expected = self.columns.len();
        let spares = &self.spares;
        let next = Columns {
            time: spares.get(expected),
            src: spares.get(expected),
            dst: spares.get(expected),
            size: spares.get(expected),
        };
        let mut columns = std::mem::replace(&mut self.columns, next);
        self.base += columns.len() as u64;
        if self.retracted > 0 {
            columns.drop_retracted();
            self.retracted = 0;
        }
        let new = &self.keys[self.keys_taken..];
        self.keys_taken = self.keys.len();
        (columns, new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(c: &Columns) -> Vec<[i64; 4]> {
        (0..c.len())
            .map(|i| [c.time[i], c.src[i], c.dst[i], c.size[i]])
            .collect()
    }

    #[test]
    fn records_are_four_columns_in_order_with_time_in_microseconds() {
        let mut r = Records::new();
        assert_eq!(r.push(10_000, 1, 2, 3), 0);
        assert_eq!(r.push(11_999, 4, 5, 6), 1);
        assert_eq!(r.len(), 2);
        let (columns, keys) = r.take();
        assert_eq!(rows(&columns), vec![[10, 1, 2, 3], [11, 4, 5, 6]]);
        assert!(keys.is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn indexes_continue_across_takes_and_retract_only_the_current_buffer() {
        let mut r = Records::new();
        r.push(1000, 1, 1, 1);
        r.take();
        let index = r.push(2000, 2, 2, 20);
        assert_eq!(index, 1);
        assert!(!r.retract(0)); // taken already
        assert!(!r.retract(-1));
        assert!(!r.retract(5));
        assert!(r.retract(index));
        assert!(!r.retract(index)); // once
        r.push(3000, 3, 3, 30);
        r.push(4000, 4, 4, 40);
        assert_eq!(rows(&r.take().0), vec![[3, 3, 3, 30], [4, 4, 4, 40]]);
    }

    #[test]
    fn the_offset_moves_the_callers_clock_to_wall_time() {
        let mut r = Records::new();
        r.offset = 1_000_000;
        r.push(5_000, 0, 0, 0);
        r.offset = -10_000;
        r.push(15_000, 0, 0, 0);
        assert_eq!(r.take().0.time, vec![1_005, 5]);
    }

    #[test]
    fn taken_buffers_come_back_to_be_appended_into() {
        let mut r = Records::new();
        for i in 0..1000 {
            r.push(i * 1000, 1, 2, 3);
        }
        let (columns, _) = r.take();
        assert_eq!(r.columns.time.capacity(), 1000); // no spare yet: sized as the last batch
        let mut given: Vec<*const i64> = Vec::new();
        for buffer in [columns.time, columns.src, columns.dst, columns.size] {
            given.push(buffer.as_ptr());
            r.spares.give(buffer);
        }
        assert_eq!(r.spares.len(), 4);
        r.take(); // the next columns are the spares
        assert!(r.spares.is_empty());
        let c = &r.columns;
        let mut now: Vec<*const i64> = [&c.time, &c.src, &c.dst, &c.size]
            .iter()
            .map(|v| v.as_ptr())
            .collect();
        now.sort();
        given.sort();
        assert_eq!(now, given);
        assert!(c.time.is_empty() && c.time.capacity() >= 1000);
        for _ in 0..20 {
            r.spares.give(Vec::new());
        }
        assert_eq!(r.spares.len(), Spares::KEEP);
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
    use std::os::raw::c_int;

    use pyo3::ffi;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    use crate::lent::py::fill_read_only_view;

    /// One record column taken from a `RecordBuffer`: native-endian int64 values behind a
    /// read-only buffer (`numpy.frombuffer(column, numpy.int64)`, `pyarrow.py_buffer`), so
    /// the values the scanners appended reach Arrow without a copy.
    #[pyclass(module = "rmb_relay._core", frozen)]
    pub struct Column {
        values: Vec<i64>,
        /// where the buffer goes when Python drops the column (see `Spares`)
        spares: super::Spares,
    }

    impl Drop for Column {
        fn drop(&mut self) {
            self.spares.give(std::mem::take(&mut self.values));
        }
    }

    #[pymethods]
    impl Column {
        /// Values (not bytes) in the column.
        fn __len__(&self) -> usize {
            self.values.len()
        }

        /// The bytes of `len(self)` int64 values, read-only, for as long as a view holds it.
        unsafe fn __getbuffer__(
            slf: Bound<'_, Self>,
            view: *mut ffi::Py_buffer,
            flags: c_int,
        ) -> PyResult<()> {
            let values = &slf.get().values;
            let (data, len) = (
                values.as_ptr() as *const u8,
                std::mem::size_of_val(&values[..]),
            );
            // SAFETY: the object is frozen (no method changes `values`, so the Vec is never
            // reallocated) and owns the values until the view lets go of it.
            unsafe {
                fill_read_only_view(slf.into_any(), view, flags, data, len, "a record column")
            }
        }

        fn __repr__(&self) -> String {
            format!("Column(len={})", self.values.len())
        }
    }

    /// Route records appended by the scanners that hold this buffer (see the module docs).
    #[pyclass(module = "rmb_relay._core")]
    pub struct RecordBuffer {
        pub inner: super::Records,
    }

    /// What `take` hands over: the four columns and the SBD keys interned since the last take
    pub type Taken<'py> = (Column, Column, Column, Column, Bound<'py, PyList>);

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

        /// Append one record as a scanner does (`time` in ns of the scan clock); its index.
        /// For callers without a scanner, and tests.
        fn push(&mut self, time: u64, src: i64, dst: i64, size: usize) -> i64 {
            self.inner.push(time, src, dst, size)
        }

        /// The id an SBD key (32 bytes) is recorded as, as the scanner interns it.
        fn key_id(&mut self, key: [u8; 32]) -> i64 {
            self.inner.key_id(&key)
        }

        /// Mark the record at `index` as not delivered (size -1); False if it is not buffered.
        fn retract(&mut self, index: i64) -> bool {
            self.inner.retract(index)
        }

        /// (time_us, src, dst, size, keys): the records (retracted ones left out) as four
        /// `Column`s, and the SBD keys interned since the last take, in id order.
        fn take<'py>(&mut self, py: Python<'py>) -> PyResult<Taken<'py>> {
            let spares = self.inner.spares.clone();
            let (columns, keys) = self.inner.take();
            let keys = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?;
            let column = |values| Column {
                values,
                spares: spares.clone(),
            };
            Ok((
                column(columns.time),
                column(columns.src),
                column(columns.dst),
                column(columns.size),
                keys,
            ))
        }

        fn __repr__(&self) -> String {
            format!("RecordBuffer(len={})", self.inner.len())
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<Column>()?;
        m.add_class::<RecordBuffer>()
    }
}
