//! The stream contract's Python names: `StreamSpec`, `FinishReason`, `ErrorKind`, `Dialect`, error replies.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::markup::PyMarkup;
use crate::error::CoreError;
use crate::events::anthropic::AnthropicParams;
use crate::events::openai::{CompletionKind, OpenAiParams};
use crate::events::responses::{self, Compaction, NamespacedTool, ResponsesParams};
use crate::events::tool_search::{Deferred, SearchKind, ToolSearch};
use crate::events::{Dialect, DialectParams, ErrorKind, ErrorReply, FinishReason};
use crate::markup::ToolSchemas;
use crate::router::StreamSpec;
use crate::sse::number_events;

/// Why a stream ended: the router's answer to the engine for every row that ended in a step.
#[pyclass(
    module = "mlxgate._native",
    name = "FinishReason",
    eq,
    eq_int,
    frozen,
    hash
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyFinishReason {
    END_TURN,
    MAX_TOKENS,
    STOP_SEQUENCE,
    TOOL_USE,
    CANCELLED,
    REPETITION,
}

impl From<FinishReason> for PyFinishReason {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::EndTurn => Self::END_TURN,
            FinishReason::MaxTokens => Self::MAX_TOKENS,
            FinishReason::StopSequence => Self::STOP_SEQUENCE,
            FinishReason::ToolUse => Self::TOOL_USE,
            FinishReason::Cancelled => Self::CANCELLED,
            FinishReason::Repetition => Self::REPETITION,
        }
    }
}

/// What went wrong, in no dialect's words.
#[pyclass(
    module = "mlxgate._native",
    name = "ErrorKind",
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyErrorKind {
    INVALID_REQUEST,
    AUTHENTICATION,
    PERMISSION,
    NOT_FOUND,
    REQUEST_TOO_LARGE,
    RATE_LIMITED,
    OVERLOADED,
    UNAVAILABLE,
    INTERNAL,
}

impl From<PyErrorKind> for ErrorKind {
    fn from(kind: PyErrorKind) -> Self {
        match kind {
            PyErrorKind::INVALID_REQUEST => Self::InvalidRequest,
            PyErrorKind::AUTHENTICATION => Self::Authentication,
            PyErrorKind::PERMISSION => Self::Permission,
            PyErrorKind::NOT_FOUND => Self::NotFound,
            PyErrorKind::REQUEST_TOO_LARGE => Self::RequestTooLarge,
            PyErrorKind::RATE_LIMITED => Self::RateLimited,
            PyErrorKind::OVERLOADED => Self::Overloaded,
            PyErrorKind::UNAVAILABLE => Self::Unavailable,
            PyErrorKind::INTERNAL => Self::Internal,
        }
    }
}

/// An API dialect; it words errors and picks their status.
#[pyclass(module = "mlxgate._native", name = "Dialect", eq, eq_int, frozen, hash)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyDialect {
    ANTHROPIC,
    OPENAI,
    RESPONSES,
}

impl From<PyDialect> for Dialect {
    fn from(dialect: PyDialect) -> Self {
        match dialect {
            PyDialect::ANTHROPIC => Self::Anthropic,
            PyDialect::OPENAI => Self::OpenAi,
            PyDialect::RESPONSES => Self::Responses,
        }
    }
}

impl From<Dialect> for PyDialect {
    fn from(dialect: Dialect) -> Self {
        match dialect {
            Dialect::Anthropic => Self::ANTHROPIC,
            Dialect::OpenAi => Self::OPENAI,
            Dialect::Responses => Self::RESPONSES,
        }
    }
}

#[pymethods]
impl PyDialect {
    /// The HTTP status this dialect answers `kind` with.
    fn error_status(&self, kind: PyErrorKind) -> u16 {
        Dialect::from(*self).error_status(kind.into())
    }

    /// The error envelope as a whole body, or (`stream`) as the last frames of a stream.
    #[pyo3(signature = (kind, message, *, param = None, code = None, stream = false))]
    fn error_reply<'py>(
        &self,
        py: Python<'py>,
        kind: PyErrorKind,
        message: &str,
        param: Option<&str>,
        code: Option<&str>,
        stream: bool,
    ) -> Bound<'py, PyBytes> {
        let error = ErrorReply {
            kind: kind.into(),
            message,
            param,
            code,
        };
        let mut out = Vec::new();
        Dialect::from(*self).write_error(&error, stream, &mut out);
        PyBytes::new(py, &out)
    }

    /// A stream's last frames for an error, its events numbered from `first_id`, and the id of
    /// the last one: for a stream that fails outside the engine after its headers went out.
    fn error_events<'py>(
        &self,
        py: Python<'py>,
        kind: PyErrorKind,
        message: &str,
        first_id: u64,
    ) -> (Bound<'py, PyBytes>, u64) {
        let error = ErrorReply {
            kind: kind.into(),
            message,
            param: None,
            code: None,
        };
        let mut frames = Vec::new();
        Dialect::from(*self).write_error(&error, true, &mut frames);
        let mut out = Vec::with_capacity(frames.len() + 16);
        let next_id = number_events(&frames, first_id, &mut out);
        (PyBytes::new(py, &out), next_id - 1)
    }
}

/// A declared tool search as Python gives it: its name, "regex" or "bm25", and each deferred
/// tool's name and the text it is found by.
type DeclaredSearch = (String, String, Vec<(String, String)>);

/// How one request's stream reads and when it ends; see `Router.open`.
#[pyclass(module = "mlxgate._native", name = "StreamSpec", frozen)]
pub struct PyStreamSpec {
    pub(crate) inner: StreamSpec,
}

/// What a stream needs from the model's side, built once per rendered prompt: the markup to
/// parse, what of it the prompt already holds, the tokens that end the turn, the tools' schemas.
#[pyclass(module = "mlxgate._native", name = "Reply", frozen)]
pub struct PyReply {
    markup: Option<Py<PyMarkup>>,
    prefill: String,
    eos_ids: Vec<u32>,
    tools: Vec<(String, String)>,
    schemas: Arc<ToolSchemas>,
}

#[pymethods]
impl PyReply {
    #[new]
    #[pyo3(signature = (*, markup = None, prefill = "", eos_ids = Vec::new(), tools = Vec::new()))]
    fn new(
        markup: Option<Py<PyMarkup>>,
        prefill: &str,
        eos_ids: Vec<u32>,
        tools: Vec<(String, String)>,
    ) -> Self {
        let schemas = Arc::new(ToolSchemas::new(&tools));
        Self {
            markup,
            prefill: prefill.to_owned(),
            eos_ids,
            tools,
            schemas,
        }
    }

    #[getter]
    fn markup(&self, py: Python<'_>) -> Option<Py<PyMarkup>> {
        self.markup.as_ref().map(|m| m.clone_ref(py))
    }

    #[getter]
    fn prefill(&self) -> &str {
        &self.prefill
    }

    #[getter]
    fn eos_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    #[getter]
    fn tools(&self) -> Vec<(String, String)> {
        self.tools.clone()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        let Ok(other) = other.cast::<PyReply>() else {
            return false;
        };
        let other = other.get();
        let same_markup = match (&self.markup, &other.markup) {
            (Some(a), Some(b)) => a.is(b),
            (None, None) => true,
            _ => false,
        };
        same_markup
            && self.prefill == other.prefill
            && self.eos_ids == other.eos_ids
            && self.tools == other.tools
    }
}

fn spec(
    dialect: DialectParams,
    stop_sequences: Vec<String>,
    reply: Option<&Bound<'_, PyReply>>,
) -> PyStreamSpec {
    let reply = reply.map(Bound::get);
    PyStreamSpec {
        inner: StreamSpec {
            dialect,
            stop_sequences,
            markup: reply.and_then(|r| r.markup.as_ref().map(|m| m.get().inner.clone())),
            prefill: reply.map(|r| r.prefill.clone()).unwrap_or_default(),
            eos_ids: reply.map(|r| r.eos_ids.clone()).unwrap_or_default(),
            tools: reply.map(|r| r.schemas.clone()).unwrap_or_default(),
        },
    }
}

#[pymethods]
impl PyStreamSpec {
    #[staticmethod]
    #[pyo3(signature = (
        *, model, message_id, stream = true, compaction = false, compacted = None,
        applied_edits = None, stop_sequences = Vec::new(), reply = None, tool_search = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn anthropic(
        model: String,
        message_id: String,
        stream: bool,
        compaction: bool,
        compacted: Option<String>,
        applied_edits: Option<String>,
        stop_sequences: Vec<String>,
        reply: Option<&Bound<'_, PyReply>>,
        tool_search: Option<DeclaredSearch>,
    ) -> PyResult<PyStreamSpec> {
        let tool_search = match tool_search {
            Some((name, kind, deferred)) => Some(Arc::new(ToolSearch {
                name,
                kind: kind.parse::<SearchKind>()?,
                deferred: deferred
                    .into_iter()
                    .map(|(name, document)| Deferred { name, document })
                    .collect(),
            })),
            None => None,
        };
        let params = AnthropicParams {
            model,
            message_id,
            stream,
            compaction,
            compacted,
            applied_edits,
            tool_search,
        };
        Ok(spec(
            DialectParams::Anthropic(params),
            stop_sequences,
            reply,
        ))
    }

    #[staticmethod]
    #[pyo3(signature = (
        *, model, completion_id, created, stream = true, include_usage = false, kind = "chat",
        custom_tools = Vec::new(), stop_sequences = Vec::new(), reply = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn openai(
        model: String,
        completion_id: String,
        created: u64,
        stream: bool,
        include_usage: bool,
        kind: &str,
        custom_tools: Vec<String>,
        stop_sequences: Vec<String>,
        reply: Option<&Bound<'_, PyReply>>,
    ) -> PyResult<PyStreamSpec> {
        let params = OpenAiParams {
            model,
            completion_id,
            created,
            stream,
            include_usage,
            kind: kind.parse::<CompletionKind>()?,
            custom_tools,
        };
        Ok(spec(DialectParams::OpenAi(params), stop_sequences, reply))
    }

    #[staticmethod]
    #[pyo3(signature = (
        *, model, response_id, created_at, echo, stream = true, reasoning_summary = false,
        encrypted_reasoning = false, namespaced = Vec::new(), custom_tools = Vec::new(),
        compaction = None, kept_items = None, stop_sequences = Vec::new(), reply = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn responses(
        model: String,
        response_id: String,
        created_at: u64,
        echo: String,
        stream: bool,
        reasoning_summary: bool,
        encrypted_reasoning: bool,
        namespaced: Vec<(String, String, String)>,
        custom_tools: Vec<String>,
        compaction: Option<&str>,
        kept_items: Option<String>,
        stop_sequences: Vec<String>,
        reply: Option<&Bound<'_, PyReply>>,
    ) -> PyResult<PyStreamSpec> {
        let compaction = match (compaction, kept_items) {
            (None, _) => None,
            (Some("item"), _) => Some(Compaction::Item),
            (Some("endpoint"), kept) => Some(Compaction::Endpoint {
                kept: kept.unwrap_or_else(|| "[]".to_owned()),
            }),
            (Some(other), _) => return Err(CoreError::UnknownCompaction(other.to_owned()).into()),
        };
        let params = ResponsesParams {
            model,
            response_id,
            created_at,
            stream,
            echo,
            reasoning_summary,
            encrypted_reasoning,
            namespaced: namespaced
                .into_iter()
                .map(|(flat_name, namespace, name)| NamespacedTool {
                    flat_name,
                    namespace,
                    name,
                })
                .collect(),
            custom_tools,
            compaction,
        };
        Ok(spec(
            DialectParams::Responses(params),
            stop_sequences,
            reply,
        ))
    }

    /// A response that generates nothing (the Responses API's `generate: false`): its frames from
    /// opening to end, with no output and no usage, and the response object it ends with (None
    /// where the dialect keeps none).
    fn empty_response<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>) {
        let mut frames = Vec::new();
        let result = self.inner.dialect.empty_response(&mut frames);
        (
            PyBytes::new(py, &frames),
            result.map(|result| PyBytes::new(py, &result)),
        )
    }

    #[getter]
    fn dialect(&self) -> PyDialect {
        self.inner.dialect.dialect().into()
    }

    #[getter]
    fn stream(&self) -> bool {
        self.inner.dialect.stream()
    }

    #[getter]
    fn model(&self) -> &str {
        self.inner.dialect.model()
    }

    #[getter]
    fn stop_sequences(&self) -> Vec<String> {
        self.inner.stop_sequences.clone()
    }

    #[getter]
    fn eos_ids(&self) -> Vec<u32> {
        self.inner.eos_ids.clone()
    }
}

/// An error answering a Responses `response.create` sent over a WebSocket, as the one text
/// message that carries it: `{"type":"error","status":…,"error":{…}}`.
#[pyfunction]
#[pyo3(signature = (kind, message, *, param = None, code = None))]
pub fn websocket_error(
    kind: PyErrorKind,
    message: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> String {
    let error = ErrorReply {
        kind: kind.into(),
        message,
        param,
        code,
    };
    let mut out = Vec::new();
    responses::write_websocket_error(&error, &mut out);
    // serde_json writes UTF-8.
    String::from_utf8(out).expect("JSON from serde_json is UTF-8")
}

/// The reasoning text inside an `encrypted_content` this server handed out; None for another's.
#[pyfunction]
pub fn reasoning_from_encrypted(encrypted: &str) -> Option<String> {
    responses::reasoning_from_encrypted(encrypted)
}

/// The summary inside a compaction item's `encrypted_content` this server handed out; None for
/// another's.
#[pyfunction]
pub fn compaction_from_encrypted(encrypted: &str) -> Option<String> {
    responses::compaction_from_encrypted(encrypted)
}
