//! `Router` (engine thread) and `Reader` (asyncio thread) over the core router and channels.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::events::{PyErrorKind, PyFinishReason, PyStreamSpec};
use super::vocab::PyVocab;
use super::{wake, Waker};
use crate::channel::{Channel, Park};
use crate::events::PromptUsage;
use crate::router::{cache_tier, Router, SampledLogprobs, DEFAULT_MAX_UNREAD_BYTES};

/// `Router.logprobs`'s entries as Python passes them: (stream id, token id, logprob, top).
type SampledTuple = (u64, u32, f32, Vec<(u32, f32)>);

const _: () = assert!(DEFAULT_MAX_UNREAD_BYTES == 1048576);

/// Consumer side of one stream.
#[pyclass(module = "mlxgate._native", name = "Reader", frozen)]
pub struct PyReader {
    channel: Arc<Channel<Waker>>,
}

#[pymethods]
impl PyReader {
    /// All pending bytes as one object; `b""` if none yet; `None` at end of stream.
    fn take<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.channel.take_with(|bytes| PyBytes::new(py, bytes))
    }

    /// As `take`, with the id of the last event taken so far (a streamed response's events are
    /// numbered as they are queued; 0 before any, and for a body).
    fn take_events<'py>(&self, py: Python<'py>) -> Option<(Bound<'py, PyBytes>, u64)> {
        self.channel
            .take_numbered_with(|bytes, last_id| (PyBytes::new(py, bytes), last_id))
    }

    /// Stores `waiter` and `wake_all` unless data is pending or the stream is closed (then
    /// returns False). On the next append or close, `wake_all` is called with a list holding
    /// `waiter` and the waiters of every other reader woken at the same time with the same
    /// `wake_all`.
    fn park(&self, waiter: &Bound<'_, PyAny>, wake_all: &Bound<'_, PyAny>) -> PyResult<bool> {
        if !wake_all.is_callable() {
            return Err(PyTypeError::new_err("park() needs a callable wake_all"));
        }
        let waker = Waker {
            waiter: waiter.clone().unbind(),
            wake_all: wake_all.clone().unbind(),
        };
        // A replaced or refused waker is dropped here, after the channel lock is released.
        Ok(match self.channel.park(waker) {
            Park::Parked(_replaced) => true,
            Park::Ready(_) => false,
        })
    }

    /// The client went away. A parked waiter is woken so its task sees end of stream.
    fn cancel(&self, py: Python<'_>) {
        wake(py, self.channel.cancel());
    }

    #[getter]
    fn unread_bytes(&self) -> usize {
        self.channel.unread_bytes()
    }

    #[getter]
    fn stream_id(&self) -> u64 {
        self.channel.stream_id()
    }

    /// 200, or the HTTP status of the error the stream ended with.
    #[getter]
    fn status(&self) -> u16 {
        self.channel.status()
    }

    /// The response object the generation answered with, once it ended, where the dialect keeps
    /// one (Responses: the object to store); None otherwise.
    #[getter]
    fn result<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.channel.result().map(|bytes| PyBytes::new(py, &bytes))
    }

    /// (prompt tokens, of them from the prefix cache), as opened.
    #[getter]
    fn prompt_tokens(&self) -> (u64, u64) {
        let outcome = self.channel.outcome();
        (outcome.prompt_tokens, outcome.cached_tokens)
    }

    /// Where its cached prompt tokens came from: "memory", "disk", "in-flight", or "".
    #[getter]
    fn cached_from(&self) -> &'static str {
        self.channel.outcome().cached_from
    }

    /// (what guessed for it: "prompt-lookup", "draft-model" or "", tokens guessed, of them
    /// kept), over its verify passes.
    #[getter]
    fn guesses(&self) -> (&'static str, u64, u64) {
        let outcome = self.channel.outcome();
        (outcome.drafter, outcome.guessed, outcome.guesses_kept)
    }

    /// Tokens generated so far (all of them once the stream ended).
    #[getter]
    fn output_tokens(&self) -> u64 {
        self.channel.tokens()
    }

    /// Seconds from the stream's opening to its first token; None before it.
    #[getter]
    fn ttft_s(&self) -> Option<f64> {
        self.channel.outcome().first_token.map(|d| d.as_secs_f64())
    }

    /// `running`, `finished`, `cancelled`, or the error kind that ended the stream
    /// (`overloaded`, `unavailable`, `internal`, ...).
    #[getter]
    fn end(&self) -> &'static str {
        self.channel.outcome().end
    }

    fn __repr__(&self) -> String {
        format!(
            "Reader(stream_id={}, unread_bytes={}, closed={})",
            self.channel.stream_id(),
            self.channel.unread_bytes(),
            self.channel.is_closed()
        )
    }
}

/// Nobody can read this stream any more: stop generating it.
impl Drop for PyReader {
    fn drop(&mut self) {
        drop(self.channel.cancel());
    }
}

/// All open streams. Every method runs briefly with the GIL held and calls Python (`wake_all`)
/// only after releasing the router lock.
#[pyclass(module = "mlxgate._native", name = "Router", frozen)]
pub struct PyRouter {
    inner: Mutex<Router<Waker>>,
}

impl PyRouter {
    fn lock(&self) -> MutexGuard<'_, Router<Waker>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PyRouter {
    #[new]
    // A literal default so `inspect.signature` (and stubtest) show it.
    #[pyo3(signature = (vocab, *, max_unread_bytes = 1048576))]
    fn new(vocab: &Bound<'_, PyVocab>, max_unread_bytes: usize) -> Self {
        let vocab = vocab.get().inner.clone();
        Self {
            inner: Mutex::new(Router::new(vocab, max_unread_bytes)),
        }
    }

    /// Opens a response as `spec` says for an admitted prompt: one stream, or one per id for
    /// the choices of OpenAI's `n`, all read by the one reader. Raises if an id is open.
    #[pyo3(signature = (
        stream_ids, spec, *, prompt_tokens, cached_tokens = 0, cached_from = "", max_tokens,
        loop_span = 0
    ))]
    #[allow(clippy::too_many_arguments)] // the Python keyword arguments
    fn open(
        &self,
        stream_ids: &Bound<'_, PyAny>,
        spec: &Bound<'_, PyStreamSpec>,
        prompt_tokens: u64,
        cached_tokens: u64,
        cached_from: &str,
        max_tokens: u64,
        loop_span: u32,
    ) -> PyResult<PyReader> {
        let tier = if cached_from.is_empty() {
            ""
        } else {
            cache_tier(cached_from)?
        };
        let usage = PromptUsage {
            prompt_tokens,
            cached_tokens,
        };
        let stream_ids = match stream_ids.extract::<u64>() {
            Ok(stream_id) => vec![stream_id],
            Err(_) => extract_ints(stream_ids)?,
        };
        let channel = self.lock().open(
            &stream_ids,
            &spec.get().inner,
            usage,
            max_tokens,
            (loop_span > 0).then_some(loop_span),
        )?;
        if !tier.is_empty() {
            channel.cached(cached_tokens, tier);
        }
        Ok(PyReader { channel })
    }

    /// One engine step. Returns the streams that ended, and why.
    fn step(
        &self,
        py: Python<'_>,
        stream_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u64, PyFinishReason)>> {
        // Extraction may run Python code (`__index__`), so it happens before taking the lock.
        let stream_ids = extract_ints(stream_ids)?;
        let token_ids = narrow(extract_ints(token_ids)?);
        let mut ended = Vec::new();
        let mut woken = Vec::new();
        let result = self
            .lock()
            .step(&stream_ids, &token_ids, &mut ended, &mut woken);
        wake(py, woken);
        result?;
        Ok(ended
            .into_iter()
            .map(|(stream_id, reason)| (stream_id, reason.into()))
            .collect())
    }

    /// The log-probabilities of tokens the next `step` brings: `(stream id, token id, logprob,
    /// [(alternative id, logprob)])` for the streams whose requests asked for them.
    fn logprobs(&self, sampled: Vec<SampledTuple>) {
        let sampled: Vec<SampledLogprobs> = sampled
            .into_iter()
            .map(|(stream_id, token_id, logprob, top)| SampledLogprobs {
                stream_id,
                token_id,
                logprob,
                top,
            })
            .collect();
        self.lock().logprobs(&sampled);
    }

    fn cancelled(&self) -> Vec<u64> {
        let mut out = Vec::new();
        self.lock().cancelled(&mut out);
        out
    }

    fn fail(&self, py: Python<'_>, stream_id: u64, kind: PyErrorKind, message: &str) {
        let waker = self.lock().fail(stream_id, kind.into(), message);
        wake(py, waker);
    }

    fn close(&self, py: Python<'_>, stream_id: u64) {
        let waker = self.lock().close(stream_id);
        wake(py, waker);
    }

    /// Queues a keep-alive `ping` event on a streaming response (e.g. during a long prefill).
    fn ping(&self, py: Python<'_>, stream_id: u64) {
        let waker = self.lock().ping(stream_id);
        wake(py, waker);
    }

    /// The stream's prompt reused `cached_tokens` from the prefix cache's tier `cached_from`;
    /// the usage reported at its end says so, and the request log the tier.
    fn cached(&self, stream_id: u64, cached_tokens: u64, cached_from: &str) -> PyResult<()> {
        Ok(self.lock().cached(stream_id, cached_tokens, cached_from)?)
    }

    /// Verify passes checked `guessed[i]` tokens `drafter` guessed for stream `stream_ids[i]`,
    /// which kept `kept[i]` of them; the request log says so.
    fn guessed(
        &self,
        stream_ids: Vec<u64>,
        guessed: Vec<u64>,
        kept: Vec<u64>,
        drafter: &str,
    ) -> PyResult<()> {
        Ok(self.lock().guessed(&stream_ids, &guessed, &kept, drafter)?)
    }

    /// Ends with an `overloaded` error every response whose reader has held more than
    /// `max_unread_bytes` unread for longer than `timeout_s`; returns the ids of its streams.
    fn fail_stalled(&self, py: Python<'_>, timeout_s: f64) -> Vec<u64> {
        let timeout = std::time::Duration::from_secs_f64(timeout_s.max(0.0));
        let (mut out, mut woken) = (Vec::new(), Vec::new());
        self.lock().fail_stalled(timeout, &mut out, &mut woken);
        wake(py, woken);
        out
    }

    /// Ids of open streams whose readers have more unread bytes than `max_unread_bytes`.
    fn over_bound(&self) -> Vec<u64> {
        let mut out = Vec::new();
        self.lock().over_bound(&mut out);
        out
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }
}

/// Values past `u32` map to `u32::MAX`: an id past the vocab, which renders nothing.
fn narrow(values: Vec<u64>) -> Vec<u32> {
    values
        .into_iter()
        .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
        .collect()
}

/// Any sequence of ints, or a 1-d buffer of integers (numpy, array.array, memoryview).
fn extract_ints(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    // Indexing a list directly is about twice as fast as the generic sequence iteration.
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|item| item.extract::<u64>()).collect();
    }
    if obj.is_instance_of::<PyTuple>() {
        return obj.extract();
    }
    match PyUntypedBuffer::get(obj) {
        Ok(buffer) if buffer.dimensions() <= 1 => buffer_ints(obj.py(), &buffer),
        _ => obj.extract(),
    }
}

fn buffer_ints(py: Python<'_>, buffer: &PyUntypedBuffer) -> PyResult<Vec<u64>> {
    fn unsigned<T: Into<u64>>(values: Vec<T>) -> Vec<u64> {
        values.into_iter().map(Into::into).collect()
    }
    fn signed<T: Into<i64>>(values: Vec<T>) -> PyResult<Vec<u64>> {
        values
            .into_iter()
            .map(|v| {
                u64::try_from(v.into()).map_err(|_| {
                    PyOverflowError::new_err("negative value where an id was expected")
                })
            })
            .collect()
    }
    if let Ok(b) = buffer.as_typed::<u64>() {
        return b.to_vec(py);
    }
    if let Ok(b) = buffer.as_typed::<i64>() {
        return signed(b.to_vec(py)?);
    }
    if let Ok(b) = buffer.as_typed::<u32>() {
        return Ok(unsigned(b.to_vec(py)?));
    }
    if let Ok(b) = buffer.as_typed::<i32>() {
        return signed(b.to_vec(py)?);
    }
    if let Ok(b) = buffer.as_typed::<u16>() {
        return Ok(unsigned(b.to_vec(py)?));
    }
    if let Ok(b) = buffer.as_typed::<i16>() {
        return signed(b.to_vec(py)?);
    }
    if let Ok(b) = buffer.as_typed::<u8>() {
        return Ok(unsigned(b.to_vec(py)?));
    }
    if let Ok(b) = buffer.as_typed::<i8>() {
        return signed(b.to_vec(py)?);
    }
    Err(PyTypeError::new_err(format!(
        "expected a sequence or buffer of integers, got buffer format {:?}",
        buffer.format()
    )))
}
