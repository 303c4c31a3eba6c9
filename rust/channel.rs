//! One response's byte channel from the engine thread to its reader: never blocks the producer.
//! A streamed response's events are numbered (`id:`) as they are queued.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::sse::number_events;

/// Stream ids whose readers cancelled, shared by all channels of one router. Each entry carries
/// the channel serial so a late cancel never hits a newer stream that reuses the id.
pub type CancelInbox = Mutex<Vec<(u64, u64)>>;

/// Bytes queued for one reader, plus the waker the reader parked. One channel carries a whole
/// response: every choice of OpenAI's `n` writes into it.
///
/// `W` is whatever wakes the reader; the core never calls it. Every method that takes a waker out
/// returns it so the caller can call (or drop) it after the lock is released.
#[derive(Debug)]
pub struct Channel<W> {
    state: Mutex<State<W>>,
    opened: Instant,
    /// Tokens generated so far, by every choice: written by the producer without the lock.
    output_tokens: AtomicU64,
    bound: usize,
    /// The engine streams (one per choice) writing into this channel.
    stream_ids: Box<[u64]>,
    serial: u64,
    inbox: Arc<CancelInbox>,
}

#[derive(Debug)]
struct State<W> {
    buf: Vec<u8>,
    /// The consumer's last buffer, kept so the producer reuses its capacity.
    spare: Vec<u8>,
    /// Streamed responses only: the frames being queued, before they are numbered into `buf`.
    numbering: Option<Numbering>,
    /// The response object a finished generation answers with (Responses: what is stored).
    result: Option<Vec<u8>>,
    /// Since when the reader has held more than the bound unread (None while it keeps up).
    over_since: Option<Instant>,
    closed: bool,
    cancelled: bool,
    /// The HTTP status a non-streamed answer gets: 200 unless the stream ended with an error.
    status: u16,
    waker: Option<W>,
    outcome: Outcome,
}

/// What a stream came to, for the request log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Where the cached tokens came from: "memory", "disk", "in-flight" ("" for none).
    pub cached_from: &'static str,
    /// From the stream's opening to its first generated token.
    pub first_token: Option<Duration>,
    /// "running" until it ends: "finished", "cancelled", or the error kind that ended it.
    pub end: &'static str,
    /// Tokens guessed for it that verify passes checked, and of them those it kept.
    pub guessed: u64,
    pub guesses_kept: u64,
    /// What guessed them: "prompt-lookup" or "draft-model" ("" for nothing).
    pub drafter: &'static str,
}

/// The `id:` lines of a streamed response: every event gets the next number.
#[derive(Debug, Default)]
struct Numbering {
    scratch: Vec<u8>,
    /// Events queued so far (the id of the last one).
    queued: u64,
}

/// Result of [`Channel::park`].
#[derive(Debug)]
pub enum Park<W> {
    /// Stored; the previous waker (if any) comes back to be dropped outside the lock.
    Parked(Option<W>),
    /// Data is pending or the stream is closed: not stored, read instead.
    Ready(W),
}

impl<W> State<W> {
    /// Lets `f` write frames into the buffer, numbering each event of a streamed response.
    fn queue(&mut self, f: impl FnOnce(&mut Vec<u8>)) {
        let Some(numbering) = self.numbering.as_mut() else {
            f(&mut self.buf);
            return;
        };
        numbering.scratch.clear();
        f(&mut numbering.scratch);
        numbering.queued =
            number_events(&numbering.scratch, numbering.queued + 1, &mut self.buf) - 1;
    }
}

/// Capacity above which a drained buffer is released instead of kept for reuse.
const KEEP_CAPACITY: usize = 64 * 1024;

impl<W> Channel<W> {
    /// A channel for the streams `stream_ids` (the choices of one response); `numbered`: its
    /// frames are SSE events, each given an `id:` line as it is queued.
    pub fn new(
        stream_ids: Vec<u64>,
        serial: u64,
        bound: usize,
        inbox: Arc<CancelInbox>,
        numbered: bool,
    ) -> Self {
        let state = State {
            buf: Vec::new(),
            spare: Vec::new(),
            numbering: numbered.then(Numbering::default),
            result: None,
            over_since: None,
            closed: false,
            cancelled: false,
            status: 200,
            waker: None,
            outcome: Outcome {
                prompt_tokens: 0,
                cached_tokens: 0,
                cached_from: "",
                first_token: None,
                end: "running",
                guessed: 0,
                guesses_kept: 0,
                drafter: "",
            },
        };
        Self {
            opened: Instant::now(),
            output_tokens: AtomicU64::new(0),
            state: Mutex::new(state),
            bound,
            stream_ids: stream_ids.into_boxed_slice(),
            serial,
            inbox,
        }
    }

    /// The first choice's stream id (the only one, but for OpenAI's `n`).
    pub fn stream_id(&self) -> u64 {
        self.stream_ids[0]
    }

    pub fn stream_ids(&self) -> &[u64] {
        &self.stream_ids
    }

    pub fn serial(&self) -> u64 {
        self.serial
    }

    fn lock(&self) -> MutexGuard<'_, State<W>> {
        // A panic elsewhere cannot leave State inconsistent (plain field writes), so ignore poison.
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    // Producer side.

    /// Lets `f` append frames. Returns the parked waker if anything was appended.
    /// Nothing is written to a closed or cancelled channel.
    pub fn append_with(&self, f: impl FnOnce(&mut Vec<u8>)) -> Option<W> {
        let mut state = self.lock();
        if state.closed {
            return None;
        }
        let before = state.buf.len();
        state.queue(f);
        if state.buf.len() > before {
            state.waker.take()
        } else {
            None
        }
    }

    /// Lets `f` append the final frames, then marks end of stream. Returns the parked waker.
    pub fn close_with(&self, f: impl FnOnce(&mut Vec<u8>)) -> Option<W> {
        let mut state = self.lock();
        if state.closed {
            return None;
        }
        state.queue(f);
        state.closed = true;
        state.waker.take()
    }

    /// Lets `f` append an error's frames and say the HTTP status it implies, then marks end of
    /// stream. Returns the parked waker.
    pub fn fail_with(&self, f: impl FnOnce(&mut Vec<u8>) -> u16) -> Option<W> {
        let mut state = self.lock();
        if state.closed {
            return None;
        }
        let mut status = 200;
        state.queue(|buf| status = f(buf));
        state.status = status;
        state.closed = true;
        state.waker.take()
    }

    /// Keeps the response object the generation answers with (see [`Channel::result`]).
    pub fn set_result(&self, result: Vec<u8>) {
        self.lock().result = Some(result);
    }

    /// The response object the generation answered with, once it ended (Responses only).
    pub fn result(&self) -> Option<Vec<u8>> {
        self.lock().result.clone()
    }

    /// 200, or the status of the error the stream ended with.
    pub fn status(&self) -> u16 {
        self.lock().status
    }

    /// The response ended with an error.
    pub fn is_failed(&self) -> bool {
        self.lock().status != 200
    }

    /// The stream's prompt: `prompt_tokens`, `cached_tokens` of them from the prefix cache.
    pub fn prompt(&self, prompt_tokens: u64, cached_tokens: u64) {
        let outcome = &mut self.lock().outcome;
        outcome.prompt_tokens = prompt_tokens;
        outcome.cached_tokens = cached_tokens;
    }

    /// Of the prompt, `cached_tokens` came from the prefix cache's tier `cached_from` after all.
    pub fn cached(&self, cached_tokens: u64, cached_from: &'static str) {
        let outcome = &mut self.lock().outcome;
        outcome.cached_tokens = cached_tokens;
        outcome.cached_from = cached_from;
    }

    /// A verify pass checked `guessed` tokens `drafter` guessed for it, and it kept `kept`.
    pub fn guessed(&self, guessed: u64, kept: u64, drafter: &'static str) {
        let outcome = &mut self.lock().outcome;
        outcome.guessed += guessed;
        outcome.guesses_kept += kept;
        outcome.drafter = drafter;
    }

    /// One more token generated (by any choice); the first one's time is kept.
    pub fn count_token(&self) {
        if self.output_tokens.fetch_add(1, Ordering::Relaxed) == 0 {
            self.lock().outcome.first_token = Some(self.opened.elapsed());
        }
    }

    /// The stream ended (`end`: see [`Outcome::end`]).
    pub fn ended(&self, end: &'static str) {
        self.lock().outcome.end = end;
    }

    /// Its tokens so far.
    pub fn tokens(&self) -> u64 {
        self.output_tokens.load(Ordering::Relaxed)
    }

    pub fn outcome(&self) -> Outcome {
        self.lock().outcome
    }

    /// Unread bytes exceed the bound: the reader is lagging.
    pub fn is_over_bound(&self) -> bool {
        self.lock().buf.len() > self.bound
    }

    /// How long the reader has lagged past the bound, as of `now` (None: it keeps up).
    pub fn lagging_for(&self, now: Instant) -> Option<Duration> {
        let mut state = self.lock();
        if state.buf.len() <= self.bound {
            state.over_since = None;
            return None;
        }
        let since = *state.over_since.get_or_insert(now);
        Some(now.saturating_duration_since(since))
    }

    // Consumer side.

    /// Runs `f` on all pending bytes (an empty slice if none yet) and consumes them; `None` once
    /// the stream is closed and drained. `f` runs without the lock held.
    pub fn take_with<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        self.take_numbered_with(|data, _| f(data))
    }

    /// As [`Channel::take_with`], and `f` is told the id of the last event taken so far (0 for
    /// a response that is not streamed or has sent none).
    pub fn take_numbered_with<R>(&self, f: impl FnOnce(&[u8], u64) -> R) -> Option<R> {
        let (mut data, last_id) = {
            let mut state = self.lock();
            // What is queued is taken whole, so the last event taken is the last one queued.
            let last_id = state.numbering.as_ref().map_or(0, |n| n.queued);
            if state.buf.is_empty() {
                let closed = state.closed;
                drop(state);
                return if closed { None } else { Some(f(&[], last_id)) };
            }
            let spare = std::mem::take(&mut state.spare);
            (std::mem::replace(&mut state.buf, spare), last_id)
        };
        let result = f(&data, last_id);
        if data.capacity() <= KEEP_CAPACITY {
            data.clear();
            let mut state = self.lock();
            if state.spare.capacity() < data.capacity() {
                state.spare = data;
            }
        }
        Some(result)
    }

    /// Stores `waker` unless data is pending or the stream is closed.
    pub fn park(&self, waker: W) -> Park<W> {
        let mut state = self.lock();
        if !state.buf.is_empty() || state.closed {
            return Park::Ready(waker);
        }
        Park::Parked(state.waker.replace(waker))
    }

    /// The reader went away: drop pending bytes, close, and tell the router. Returns the parked
    /// waker so a task waiting on this reader sees end of stream.
    pub fn cancel(&self) -> Option<W> {
        let waker = {
            let mut state = self.lock();
            state.buf = Vec::new();
            if state.closed {
                return state.waker.take();
            }
            state.closed = true;
            state.cancelled = true;
            state.waker.take()
        };
        self.inbox
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .extend(self.stream_ids.iter().map(|&id| (id, self.serial)));
        waker
    }

    pub fn is_cancelled(&self) -> bool {
        self.lock().cancelled
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub fn unread_bytes(&self) -> usize {
        self.lock().buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel() -> (Channel<&'static str>, Arc<CancelInbox>) {
        let inbox = Arc::new(CancelInbox::default());
        (Channel::new(vec![7], 1, 4, inbox.clone(), false), inbox)
    }

    fn take(ch: &Channel<&'static str>) -> Option<Vec<u8>> {
        ch.take_with(<[u8]>::to_vec)
    }

    #[test]
    fn frames_coalesce_and_take_drains_all() {
        let (ch, _) = channel();
        assert_eq!(take(&ch), Some(vec![]));
        assert!(ch.append_with(|b| b.extend_from_slice(b"ab")).is_none());
        ch.append_with(|b| b.extend_from_slice(b"cd"));
        assert_eq!(ch.unread_bytes(), 4);
        assert!(!ch.is_over_bound());
        ch.append_with(|b| b.push(b'e'));
        assert!(ch.is_over_bound());
        assert_eq!(take(&ch), Some(b"abcde".to_vec()));
        assert_eq!(ch.unread_bytes(), 0);
        assert_eq!(take(&ch), Some(vec![]));
    }

    #[test]
    fn park_then_wake_once_on_append() {
        let (ch, _) = channel();
        assert!(matches!(ch.park("w1"), Park::Parked(None)));
        assert!(matches!(ch.park("w2"), Park::Parked(Some("w1"))));
        assert_eq!(ch.append_with(|_| {}), None, "no bytes, no wake");
        assert_eq!(ch.append_with(|b| b.push(b'x')), Some("w2"));
        assert_eq!(ch.append_with(|b| b.push(b'y')), None, "woken once");
        assert!(matches!(ch.park("w3"), Park::Ready("w3")), "data pending");
    }

    #[test]
    fn close_wakes_and_reads_to_eof() {
        let (ch, _) = channel();
        ch.append_with(|b| b.push(b'a'));
        assert_eq!(take(&ch), Some(b"a".to_vec()));
        assert!(matches!(ch.park("w"), Park::Parked(None)));
        assert_eq!(ch.close_with(|b| b.push(b'z')), Some("w"));
        assert_eq!(ch.append_with(|b| b.push(b'!')), None);
        assert!(matches!(ch.park("late"), Park::Ready(_)));
        assert_eq!(take(&ch), Some(b"z".to_vec()));
        assert_eq!(take(&ch), None);
        assert_eq!(take(&ch), None);
    }

    #[test]
    fn cancel_drops_data_reports_once_and_wakes() {
        let (ch, inbox) = channel();
        assert!(matches!(ch.park("w"), Park::Parked(None)));
        assert_eq!(ch.cancel(), Some("w"));
        assert_eq!(ch.cancel(), None);
        assert!(ch.is_cancelled() && ch.is_closed());
        assert_eq!(*inbox.lock().unwrap(), [(7, 1)]);
        assert_eq!(ch.append_with(|b| b.push(b'x')), None);
        assert_eq!(take(&ch), None);
    }

    #[test]
    fn cancel_after_close_is_not_reported() {
        let (ch, inbox) = channel();
        ch.close_with(|b| b.push(b'x'));
        ch.cancel();
        assert!(inbox.lock().unwrap().is_empty());
        assert_eq!(take(&ch), None);
    }
}
