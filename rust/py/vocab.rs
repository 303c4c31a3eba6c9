//! `Vocab`: the token table handed to routers.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::pybacked::{PyBackedBytes, PyBackedStr};

use crate::vocab::{Vocab, VocabKind};

#[pyclass(module = "mlxgate._native", name = "Vocab", frozen)]
pub struct PyVocab {
    pub(crate) inner: Arc<Vocab>,
}

#[pymethods]
impl PyVocab {
    #[staticmethod]
    #[pyo3(signature = (tokens, kind, special_ids, *, trim_leading_space = false))]
    fn from_token_strings(
        tokens: Vec<PyBackedStr>,
        kind: &str,
        special_ids: Vec<u32>,
        trim_leading_space: bool,
    ) -> PyResult<Self> {
        let kind: VocabKind = kind.parse()?;
        let vocab = Vocab::from_token_strings(&tokens, kind, &special_ids)?
            .with_trim_leading_space(trim_leading_space);
        Ok(Self {
            inner: Arc::new(vocab),
        })
    }

    #[staticmethod]
    #[pyo3(signature = (tokens, special_ids, *, trim_leading_space = false))]
    fn from_token_bytes(
        tokens: Vec<PyBackedBytes>,
        special_ids: Vec<u32>,
        trim_leading_space: bool,
    ) -> PyResult<Self> {
        let vocab = Vocab::from_token_bytes(&tokens, &special_ids)?
            .with_trim_leading_space(trim_leading_space);
        Ok(Self {
            inner: Arc::new(vocab),
        })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn decode(&self, token_ids: Vec<u32>) -> String {
        self.inner.decode(&token_ids)
    }

    fn __repr__(&self) -> String {
        format!("Vocab(len={})", self.inner.len())
    }
}
