//! SSE framing's Python name: `number_events`.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::sse;

/// Whole SSE frames with an `id:` line on each event, and the id the next event gets.
#[pyfunction]
pub fn number_events<'py>(
    py: Python<'py>,
    frames: &[u8],
    next_id: u64,
) -> (Bound<'py, PyBytes>, u64) {
    let mut out = Vec::with_capacity(frames.len() + 16);
    let next_id = sse::number_events(frames, next_id, &mut out);
    (PyBytes::new(py, &out), next_id)
}
