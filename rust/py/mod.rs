//! PyO3 binding `mlxgate._native`: thin wrappers over the core; the only place Python types appear.

mod events;
mod markup;
mod router;
mod sse;
mod vocab;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::error::CoreError;

create_exception!(
    mlxgate._native,
    NativeError,
    PyValueError,
    "Invalid input to the mlxgate stream core."
);

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        NativeError::new_err(err.to_string())
    }
}

/// What a parked reader stored: an object to hand back, and the callable that wakes it together
/// with every other reader parked with the same callable.
pub(crate) struct Waker {
    waiter: Py<PyAny>,
    wake_all: Py<PyAny>,
}

/// Wakes parked readers: groups their waiters by `wake_all` (identity) and calls each `wake_all`
/// once with the list, so a step wakes all readers of one event loop with one call. Runs with no
/// Rust lock held; a failing `wake_all` (e.g. its event loop is closed) is reported as
/// unraisable so the engine's step never fails for one client.
fn wake(py: Python<'_>, wakers: impl IntoIterator<Item = Waker>) {
    // Usually one group per event loop, so a linear search is enough.
    let mut groups: Vec<(Py<PyAny>, Vec<Py<PyAny>>)> = Vec::new();
    for Waker { waiter, wake_all } in wakers {
        match groups.iter_mut().find(|(group, _)| group.is(&wake_all)) {
            Some((_, waiters)) => waiters.push(waiter),
            None => groups.push((wake_all, vec![waiter])),
        }
    }
    for (wake_all, waiters) in groups {
        let called = PyList::new(py, waiters).and_then(|list| wake_all.call1(py, (list,)));
        if let Err(err) = called {
            err.write_unraisable(py, Some(wake_all.bind(py)));
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    m.add_class::<vocab::PyVocab>()?;
    m.add_class::<markup::PyMarkup>()?;
    m.add_class::<events::PyStreamSpec>()?;
    m.add_class::<events::PyReply>()?;
    m.add_class::<events::PyFinishReason>()?;
    m.add_class::<events::PyErrorKind>()?;
    m.add_class::<events::PyDialect>()?;
    m.add_class::<router::PyReader>()?;
    m.add_class::<router::PyRouter>()?;
    m.add_function(wrap_pyfunction!(events::reasoning_from_encrypted, m)?)?;
    m.add_function(wrap_pyfunction!(events::compaction_from_encrypted, m)?)?;
    m.add_function(wrap_pyfunction!(sse::events_after, m)?)?;
    m.add_function(wrap_pyfunction!(sse::event_data, m)?)?;
    m.add_function(wrap_pyfunction!(events::websocket_error, m)?)?;
    Ok(())
}
