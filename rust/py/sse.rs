//! SSE framing's Python names: `events_after`, for resumed streams, and `event_data`, for a
//! WebSocket's messages.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::sse;

/// The frames of numbered `frames` after the event with id `last_id`.
#[pyfunction]
pub fn events_after<'py>(py: Python<'py>, frames: &[u8], last_id: u64) -> Bound<'py, PyBytes> {
    PyBytes::new(py, sse::events_after(frames, last_id))
}

/// The data of each event in `frames`, in order (comments have none): one WebSocket text message
/// each.
#[pyfunction]
pub fn event_data<'py>(py: Python<'py>, frames: &[u8]) -> Vec<Bound<'py, PyString>> {
    sse::event_data(frames)
        .map(|data| PyString::new(py, &String::from_utf8_lossy(data)))
        .collect()
}
