//! (placeholder: filled in by the ws work)

pub mod py {
    use pyo3::prelude::*;

    pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
        Ok(())
    }
}
