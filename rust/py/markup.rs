//! `Markup`: a model's thinking and tool-call markup, configured once and shared by its streams.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::markup::MarkupSpec;

#[pyclass(module = "mlxgate._native", name = "Markup", frozen)]
pub struct PyMarkup {
    pub(crate) inner: Arc<MarkupSpec>,
}

#[pymethods]
impl PyMarkup {
    #[new]
    #[pyo3(signature = (*, think = None, tool_call = None))]
    fn new(think: Option<(String, String)>, tool_call: Option<&str>) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(MarkupSpec::new(think, tool_call)?),
        })
    }

    /// The tool-call formats, in the order chat templates are matched against them.
    #[staticmethod]
    fn tool_formats() -> Vec<&'static str> {
        crate::markup::format_names().collect()
    }

    #[getter]
    fn think(&self) -> Option<(&str, &str)> {
        self.inner.think()
    }

    #[getter]
    fn tool_call(&self) -> Option<&'static str> {
        self.inner.tool_call()
    }

    fn __repr__(&self) -> String {
        let think = match self.inner.think() {
            Some((open, close)) => format!("({open:?}, {close:?})"),
            None => "None".to_owned(),
        };
        let tool_call = match self.inner.tool_call() {
            Some(format) => format!("{format:?}"),
            None => "None".to_owned(),
        };
        format!("Markup(think={think}, tool_call={tool_call})")
    }
}
