//! Buffers Rust lends to Python without a copy, and the pool they come back to.
//!
//! Two kinds of buffer leave the core this way: the record columns (`records.rs`, int64
//! values viewed by numpy and pyarrow) and the outboxes' bytes (`forward.rs`, handed to the
//! transport). Both are `Vec`s moved into a frozen Python object that exposes them through the
//! buffer protocol (`py::fill_read_only_view`), and both come back to a `Spares` pool when
//! Python drops that object, so the next batch appends into memory that is already mapped
//! and big enough (fresh memory cost the scanners ~20 ns a record in page faults).

use std::sync::{Arc, Mutex};

/// Emptied buffers of `T` kept for reuse: at most `KEEP` of them, none whose capacity grew
/// past `MAX_CAPACITY` elements (a burst's buffer is let go). Shared with the Python objects
/// that lend the buffers out, which may be dropped on any thread holding the GIL.
#[derive(Debug)]
pub struct Spares<T, const KEEP: usize, const MAX_CAPACITY: usize>(Arc<Mutex<Vec<Vec<T>>>>);

impl<T, const KEEP: usize, const MAX_CAPACITY: usize> Default for Spares<T, KEEP, MAX_CAPACITY> {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Vec::new())))
    }
}

impl<T, const KEEP: usize, const MAX_CAPACITY: usize> Clone for Spares<T, KEEP, MAX_CAPACITY> {
    /// Another handle on the same pool.
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T, const KEEP: usize, const MAX_CAPACITY: usize> Spares<T, KEEP, MAX_CAPACITY> {
    /// Buffers kept at most.
    pub const KEEP: usize = KEEP;

    fn pool(&self) -> std::sync::MutexGuard<'_, Vec<Vec<T>>> {
        // a panic while holding the lock leaves a list of empty buffers: still usable
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keep `buffer` (emptied) for a later `get`, unless it is too big or enough are kept.
    pub fn give(&self, mut buffer: Vec<T>) {
        if buffer.capacity() > MAX_CAPACITY {
            return;
        }
        buffer.clear();
        let mut pool = self.pool();
        if pool.len() < KEEP {
            pool.push(buffer);
        }
    }

    /// A buffer to append into: a kept one, else a new one of `capacity`.
    pub fn get(&self, capacity: usize) -> Vec<T> {
        let spare = self.pool().pop();
        spare.unwrap_or_else(|| Vec::with_capacity(capacity))
    }

    /// Buffers kept.
    pub fn len(&self) -> usize {
        self.pool().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::Spares;

    #[test]
    fn keeps_at_most_keep_buffers_and_none_that_grew_too_big() {
        let spares: Spares<u8, 2, 64> = Spares::default();
        spares.give(Vec::with_capacity(128)); // a burst's buffer: let go
        assert!(spares.is_empty());
        for _ in 0..3 {
            spares.give(vec![1, 2, 3]);
        }
        assert_eq!(spares.len(), 2);
        let reused = spares.clone().get(1000);
        assert!(reused.is_empty() && reused.capacity() >= 3 && reused.capacity() <= 64);
        assert_eq!(spares.len(), 1);
        spares.get(0);
        assert_eq!(spares.get(1000).capacity(), 1000); // none kept: a new one
    }
}

pub mod py {
    use std::ffi::{c_char, c_int, c_void};

    use pyo3::exceptions::PyBufferError;
    use pyo3::ffi;
    use pyo3::prelude::*;

    /// The buffer's format: unsigned bytes (the reader says what the bytes hold)
    static FORMAT: &std::ffi::CStr = c"B";

    /// Fill `view` with a read-only, one-dimensional byte view of `len` bytes at `data`, owned
    /// by `owner` (the `__getbuffer__` of a frozen pyclass lending a buffer). `what` names the
    /// buffer in the error a writable request gets.
    ///
    /// # Safety
    /// `view` is the Py_buffer the caller was asked to fill (checked for null here), and
    /// `data..data+len` stays valid and unchanged for as long as `owner` lives: `owner` must be
    /// frozen and own the memory (the view keeps a reference to it until it is released).
    pub unsafe fn fill_read_only_view(
        owner: Bound<'_, PyAny>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
        data: *const u8,
        len: usize,
        what: &str,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no view to fill"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(format!("{what} is read-only")));
        }
        // SAFETY: `view` is non-null and the caller's to fill; `shape` and `strides` point
        // into the view itself, `format` to a static string, `buf` to memory `owner` keeps
        // alive and unchanged (the caller's contract), and the view holds `owner`.
        unsafe {
            (*view).obj = owner.into_ptr();
            (*view).buf = data as *mut c_void;
            (*view).len = len as ffi::Py_ssize_t;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                FORMAT.as_ptr() as *mut c_char
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &mut (*view).len
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }
}
