//! PyO3 binding `mlxgate._native`: thin wrappers over the core; the only place Python types appear.

mod markup;
mod router;
mod vocab;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

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

/// Calls reader wakers. Runs with no Rust lock held; a failing waker (e.g. its event loop is
/// closed) is reported as unraisable so the engine's step never fails for one client.
fn call_wakers(py: Python<'_>, wakers: impl IntoIterator<Item = Py<PyAny>>) {
    for waker in wakers {
        if let Err(err) = waker.call0(py) {
            err.write_unraisable(py, Some(waker.bind(py)));
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    m.add_class::<vocab::PyVocab>()?;
    m.add_class::<markup::PyMarkup>()?;
    m.add_class::<router::PyReader>()?;
    m.add_class::<router::PyRouter>()?;
    Ok(())
}
