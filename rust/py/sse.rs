//! SSE framing's Python name: `events_after`, for resumed streams.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::sse;

/// The frames of numbered `frames` after the event with id `last_id`.
#[pyfunction]
pub fn events_after<'py>(py: Python<'py>, frames: &[u8], last_id: u64) -> Bound<'py, PyBytes> {
    PyBytes::new(py, sse::events_after(frames, last_id))
}
