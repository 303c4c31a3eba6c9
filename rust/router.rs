//! Per-stream state keyed by engine stream id; turns one engine step for many streams into frames.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::channel::{CancelInbox, Channel};
use crate::detok::Detok;
use crate::error::CoreError;
use crate::events::anthropic::{AnthropicParams, AnthropicStream};
use crate::events::openai::{OpenAiParams, OpenAiStream};
use crate::events::{Finish, Protocol};
use crate::markup::{MarkupParser, MarkupSpec, PieceKind, Pieces};
use crate::stop::StopMatcher;
use crate::vocab::Vocab;

/// `finish_codes` values of [`Router::step`].
pub const RUNNING: u32 = 0;
/// The token is EOS: counted, not rendered.
pub const END_TURN: u32 = 1;
/// The token is rendered, then the stream ends.
pub const MAX_TOKENS: u32 = 2;

pub const DEFAULT_MAX_UNREAD_BYTES: usize = 1 << 20;

/// Routes engine output to every open stream. `W` is the reader's waker type (see [`Channel`]).
#[derive(Debug)]
pub struct Router<W> {
    vocab: Arc<Vocab>,
    streams: HashMap<u64, Stream<W>, BuildHasherDefault<IdHasher>>,
    max_unread_bytes: usize,
    inbox: Arc<CancelInbox>,
    next_serial: u64,
    /// Scratch for one token's detokenized text, then for what the stop matcher releases.
    raw: String,
    text: String,
    /// Scratch for markup streams: what the parser emits, then what the stop matcher releases.
    pieces: Pieces,
    staged: Pieces,
}

#[derive(Debug)]
struct Stream<W> {
    serial: u64,
    detok: Detok,
    stop: StopMatcher,
    /// Only for models with thinking or tool-call markup; plain streams skip it entirely.
    markup: Option<Box<MarkupParser>>,
    protocol: Protocol,
    channel: Arc<Channel<W>>,
    output_tokens: u64,
}

impl<W> Router<W> {
    pub fn new(vocab: Arc<Vocab>, max_unread_bytes: usize) -> Self {
        Self {
            vocab,
            streams: HashMap::default(),
            max_unread_bytes,
            inbox: Arc::default(),
            next_serial: 0,
            raw: String::new(),
            text: String::new(),
            pieces: Pieces::default(),
            staged: Pieces::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Opens an Anthropic Messages stream; streaming ones get `message_start` and `ping` at once.
    pub fn open_anthropic(
        &mut self,
        stream_id: u64,
        params: AnthropicParams,
        stop_sequences: Vec<String>,
    ) -> Result<Arc<Channel<W>>, CoreError> {
        self.open(
            stream_id,
            Protocol::Anthropic(AnthropicStream::new(params)),
            stop_sequences,
            None,
            "",
        )
    }

    /// Opens an OpenAI stream; streaming chat ones get the role chunk at once.
    pub fn open_openai(
        &mut self,
        stream_id: u64,
        params: OpenAiParams,
        stop_sequences: Vec<String>,
        markup: Option<Arc<MarkupSpec>>,
        prefill: &str,
    ) -> Result<Arc<Channel<W>>, CoreError> {
        self.open(
            stream_id,
            Protocol::OpenAi(Box::new(OpenAiStream::new(params))),
            stop_sequences,
            markup,
            prefill,
        )
    }

    /// Opens a stream of any dialect. With `markup`, text is split into text, thinking and tool
    /// calls before stop sequences see it (so stops match visible text only); the parser starts
    /// as if it had read `prefill`, and tool pieces the prefill completes (a forced call's name)
    /// are emitted at once. Without `markup`, `prefill` is ignored.
    pub fn open(
        &mut self,
        stream_id: u64,
        mut protocol: Protocol,
        stop_sequences: Vec<String>,
        markup: Option<Arc<MarkupSpec>>,
        prefill: &str,
    ) -> Result<Arc<Channel<W>>, CoreError> {
        if self.streams.contains_key(&stream_id) {
            return Err(CoreError::DuplicateStream(stream_id));
        }
        self.next_serial += 1;
        let serial = self.next_serial;
        let channel = Arc::new(Channel::new(
            stream_id,
            serial,
            self.max_unread_bytes,
            self.inbox.clone(),
        ));
        let mut markup = markup
            .filter(|_| protocol.supports_markup())
            .map(|spec| Box::new(MarkupParser::new(spec)));
        let pieces = &mut self.pieces;
        pieces.clear();
        if let Some(parser) = markup.as_deref_mut() {
            parser.prefill(prefill, pieces);
        }
        // A new channel has no waker yet, so there is nobody to wake.
        let _ = channel.append_with(|buf| {
            protocol.start(buf);
            emit(&mut protocol, pieces, buf);
        });
        let stream = Stream {
            serial,
            detok: Detok::new(self.vocab.trim_leading_space()),
            stop: StopMatcher::new(stop_sequences),
            markup,
            protocol,
            channel: channel.clone(),
            output_tokens: 0,
        };
        self.streams.insert(stream_id, stream);
        Ok(channel)
    }

    /// One engine step: `stream_ids[i]` produced `token_ids[i]` with `finish_codes[i]`.
    ///
    /// Appends to `dropped` the streams the engine must drop because the router ended them
    /// (cancelled readers, matched stop sequences), and to `wake` the wakers to call once no lock
    /// is held. Unknown stream ids are ignored.
    pub fn step(
        &mut self,
        stream_ids: &[u64],
        token_ids: &[u32],
        finish_codes: &[u32],
        dropped: &mut Vec<u64>,
        wake: &mut Vec<W>,
    ) -> Result<(), CoreError> {
        if stream_ids.len() != token_ids.len() || stream_ids.len() != finish_codes.len() {
            return Err(CoreError::LengthMismatch {
                stream_ids: stream_ids.len(),
                token_ids: token_ids.len(),
                finish_codes: finish_codes.len(),
            });
        }
        if let Some(i) = finish_codes.iter().position(|&code| code > MAX_TOKENS) {
            return Err(CoreError::InvalidFinishCode {
                stream_id: stream_ids[i],
                code: finish_codes[i],
            });
        }
        self.cancelled(dropped);

        let Self {
            vocab,
            streams,
            raw,
            text,
            pieces,
            staged,
            ..
        } = self;
        for ((&stream_id, &token_id), &code) in stream_ids.iter().zip(token_ids).zip(finish_codes) {
            let Some(stream) = streams.get_mut(&stream_id) else {
                continue;
            };
            stream.output_tokens += 1;
            raw.clear();
            text.clear();
            if code != END_TURN {
                stream.detok.push(vocab.token_bytes(token_id), raw);
            }
            if code != RUNNING {
                stream.detok.finish(raw);
            }
            if stream.markup.is_some() {
                let waker = step_markup(stream, raw, code, pieces, staged);
                wake.extend(waker.0);
                if waker.1 {
                    streams.remove(&stream_id);
                    if code == RUNNING {
                        dropped.push(stream_id);
                    }
                }
                continue;
            }
            let matched = stream.stop.push(raw, text);
            if matched.is_none() && code != RUNNING {
                stream.stop.finish(text);
            }
            let finish = match (matched, code) {
                (Some(index), _) => Some(Finish::StopSequence(stream.stop.stop(index))),
                (None, END_TURN) => Some(Finish::EndTurn),
                (None, MAX_TOKENS) => Some(Finish::MaxTokens),
                (None, _) => None,
            };
            let output_tokens = stream.output_tokens;
            let protocol = &mut stream.protocol;
            let waker = match finish {
                None if text.is_empty() => None,
                None => stream.channel.append_with(|buf| protocol.text(text, buf)),
                Some(finish) => stream.channel.close_with(|buf| {
                    protocol.text(text, buf);
                    protocol.finish(finish, output_tokens, buf);
                }),
            };
            wake.extend(waker);
            if finish.is_some() {
                streams.remove(&stream_id);
                if code == RUNNING {
                    dropped.push(stream_id);
                }
            }
        }
        Ok(())
    }

    /// Removes the streams whose readers cancelled since the last call and appends their ids.
    pub fn cancelled(&mut self, out: &mut Vec<u64>) {
        let cancelled = std::mem::take(&mut *self.inbox.lock().unwrap_or_else(|p| p.into_inner()));
        for (stream_id, serial) in cancelled {
            if self
                .streams
                .get(&stream_id)
                .is_some_and(|s| s.serial == serial)
            {
                self.streams.remove(&stream_id);
                out.push(stream_id);
            }
        }
    }

    /// Ends a stream with an error event (streaming) or error body (not). Returns the waker.
    pub fn fail(&mut self, stream_id: u64, error_type: &str, message: &str) -> Option<W> {
        let mut stream = self.streams.remove(&stream_id)?;
        let protocol = &mut stream.protocol;
        stream
            .channel
            .close_with(|buf| protocol.error(error_type, message, buf))
    }

    /// Drops a stream without emitting anything; its reader sees end of stream.
    pub fn close(&mut self, stream_id: u64) -> Option<W> {
        let stream = self.streams.remove(&stream_id)?;
        stream.channel.close_with(|_| {})
    }

    /// Queues a keep-alive ping on a streaming response (e.g. during a long prefill).
    pub fn ping(&mut self, stream_id: u64) -> Option<W> {
        let stream = self.streams.get_mut(&stream_id)?;
        let protocol = &mut stream.protocol;
        stream.channel.append_with(|buf| protocol.ping(buf))
    }

    /// Appends, sorted, the ids of open streams whose readers lag past the unread-byte bound.
    pub fn over_bound(&self, out: &mut Vec<u64>) {
        let start = out.len();
        out.extend(
            self.streams
                .iter()
                .filter(|(_, stream)| stream.channel.is_over_bound())
                .map(|(&id, _)| id),
        );
        out[start..].sort_unstable();
    }
}

/// The markup path of one step for one stream: parse, match stops on visible text, emit.
/// Returns the waker to call and whether the stream ended.
// NOTE: kept out of line so the plain-text loop in `step` stays as small as before markup.
#[inline(never)]
fn step_markup<W>(
    stream: &mut Stream<W>,
    raw: &str,
    code: u32,
    pieces: &mut Pieces,
    staged: &mut Pieces,
) -> (Option<W>, bool) {
    let Some(markup) = stream.markup.as_deref_mut() else {
        return (None, false);
    };
    pieces.clear();
    staged.clear();
    markup.push(raw, pieces);
    if code != RUNNING {
        markup.finish(pieces);
    }
    let stop = &mut stream.stop;
    let mut matched = None;
    for (kind, piece) in pieces.iter() {
        if kind == PieceKind::Text {
            matched = staged.push_with(PieceKind::Text, |buf| stop.push(piece, buf));
            if matched.is_some() {
                break;
            }
        } else {
            // Markup ends the visible run, so held text cannot become a stop any more.
            staged.push_with(PieceKind::Text, |buf| stop.finish(buf));
            staged.push(kind, piece);
        }
    }
    if matched.is_none() && code != RUNNING {
        staged.push_with(PieceKind::Text, |buf| stop.finish(buf));
    }
    let finish = match (matched, code) {
        (Some(index), _) => Some(Finish::StopSequence(stop.stop(index))),
        (None, END_TURN) => Some(Finish::EndTurn),
        (None, MAX_TOKENS) => Some(Finish::MaxTokens),
        (None, _) => None,
    };
    // After a complete tool call the client must run it, however generation ended; a call cut
    // short keeps the real reason (usually max_tokens).
    let finish = finish.map(|f| {
        if markup.tool_calls() > 0 && !markup.truncated() {
            Finish::ToolUse
        } else {
            f
        }
    });
    let output_tokens = stream.output_tokens;
    let protocol = &mut stream.protocol;
    let waker = match finish {
        None if staged.is_empty() => None,
        None => stream
            .channel
            .append_with(|buf| emit(protocol, staged, buf)),
        Some(finish) => stream.channel.close_with(|buf| {
            emit(protocol, staged, buf);
            protocol.finish(finish, output_tokens, buf);
        }),
    };
    (waker, finish.is_some())
}

fn emit(protocol: &mut Protocol, pieces: &Pieces, out: &mut Vec<u8>) {
    for (kind, piece) in pieces.iter() {
        match kind {
            PieceKind::Text => protocol.text(piece, out),
            PieceKind::Thinking => protocol.thinking(piece, out),
            PieceKind::ToolStart => protocol.tool_start(piece, out),
            PieceKind::ToolArgs => protocol.tool_args(piece, out),
            PieceKind::ToolEnd => protocol.tool_end(out),
        }
    }
}

/// Stream ids are engine counters: one multiply spreads them well enough for a hash map.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, n: u64) {
        let h = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Park;
    use crate::vocab::VocabKind;

    type TestRouter = Router<u32>;

    fn vocab() -> Arc<Vocab> {
        let e = "😀".as_bytes();
        let tokens: Vec<&[u8]> = vec![
            b"<eos>",
            b"Hi",
            b" there",
            &e[..2],
            &e[2..],
            b"</",
            b"stop",
            b">",
            b"!",
            b"\xff",
        ];
        Arc::new(Vocab::from_token_bytes(&tokens, &[0]).unwrap())
    }

    fn params(stream: bool) -> AnthropicParams {
        AnthropicParams {
            model: "m".into(),
            message_id: "msg_x".into(),
            input_tokens: 3,
            cache_read_input_tokens: 0,
            stream,
        }
    }

    fn read_all(ch: &Channel<u32>) -> String {
        let mut out = Vec::new();
        while let Some(bytes) = ch.take_with(<[u8]>::to_vec) {
            if bytes.is_empty() {
                break;
            }
            out.extend(bytes);
        }
        String::from_utf8(out).unwrap()
    }

    fn events(sse: &str) -> Vec<&str> {
        sse.split_terminator("\n\n")
            .map(|f| f.lines().next().unwrap())
            .collect()
    }

    fn step(r: &mut TestRouter, ids: &[u64], toks: &[u32], codes: &[u32]) -> (Vec<u64>, Vec<u32>) {
        let (mut dropped, mut wake) = (Vec::new(), Vec::new());
        r.step(ids, toks, codes, &mut dropped, &mut wake).unwrap();
        (dropped, wake)
    }

    #[test]
    fn event_order_for_two_interleaved_streams() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let a = r.open_anthropic(1, params(true), vec![]).unwrap();
        let b = r.open_anthropic(2, params(true), vec![]).unwrap();
        assert_eq!(
            events(&read_all(&a)),
            ["event: message_start", "event: ping"]
        );
        step(&mut r, &[1, 2], &[1, 3], &[0, 0]);
        step(&mut r, &[2, 1], &[4, 2], &[0, 0]);
        let (dropped, _) = step(&mut r, &[1, 2], &[0, 8], &[1, 2]);
        assert!(dropped.is_empty());
        assert_eq!(r.len(), 0);
        let a = read_all(&a);
        assert_eq!(
            events(&a),
            [
                "event: content_block_start",
                "event: content_block_delta",
                "event: content_block_delta",
                "event: content_block_stop",
                "event: message_delta",
                "event: message_stop",
            ]
        );
        assert!(a.contains("\"text\":\"Hi\"") && a.contains("\"text\":\" there\""));
        assert!(a.contains(
            "\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":3}"
        ));
        let b = read_all(&b);
        assert_eq!(events(&b).len(), 2 + 6);
        assert!(b.contains("\"text\":\"😀\"}") && b.contains("\"text\":\"!\"}"));
        assert!(b.contains("\"stop_reason\":\"max_tokens\""));
        assert_eq!(a.matches("text_delta").count(), 2);
        assert_eq!(
            b.matches("text_delta").count(),
            2,
            "no delta for the held half emoji"
        );
    }

    #[test]
    fn stop_sequence_over_three_tokens_ends_stream_and_is_reported() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = r
            .open_anthropic(9, params(true), vec!["</stop>".into()])
            .unwrap();
        read_all(&ch);
        for tok in [1, 5, 6] {
            assert_eq!(step(&mut r, &[9], &[tok], &[0]).0, Vec::<u64>::new());
        }
        assert_eq!(step(&mut r, &[9], &[7], &[0]).0, [9]);
        assert!(r.is_empty());
        let sse = read_all(&ch);
        assert_eq!(sse.matches("text_delta").count(), 1);
        assert!(sse.contains("\"text\":\"Hi\"}") && !sse.contains("\"text\":\"</"));
        assert!(sse.contains(
            "{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":\"</stop>\"},\"usage\":{\"output_tokens\":4}"
        ));
        assert_eq!(ch.take_with(|_| ()), None);
        // Later steps for the dropped id are ignored.
        assert_eq!(step(&mut r, &[9], &[1], &[0]).0, Vec::<u64>::new());
    }

    #[test]
    fn holdback_and_partial_char_released_at_finish() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = r
            .open_anthropic(1, params(false), vec!["</stop>".into()])
            .unwrap();
        assert_eq!(
            ch.take_with(<[u8]>::to_vec),
            Some(vec![]),
            "non-streaming: nothing yet"
        );
        step(&mut r, &[1], &[1], &[0]);
        step(&mut r, &[1], &[5], &[0]);
        step(&mut r, &[1], &[3], &[0]);
        step(&mut r, &[1], &[0], &[1]);
        let body = read_all(&ch);
        assert!(
            body.contains("\"content\":[{\"type\":\"text\",\"text\":\"Hi</\u{fffd}\"}]"),
            "{body}"
        );
        assert!(body.contains("\"stop_reason\":\"end_turn\""));
    }

    #[test]
    fn cancel_reported_by_step_and_cancelled() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let a = r.open_anthropic(1, params(true), vec![]).unwrap();
        let b = r.open_anthropic(2, params(true), vec![]).unwrap();
        let c = r.open_anthropic(3, params(true), vec![]).unwrap();
        a.cancel();
        assert_eq!(step(&mut r, &[2], &[1], &[0]).0, [1]);
        b.cancel();
        c.cancel();
        let mut out = Vec::new();
        r.cancelled(&mut out);
        out.sort_unstable();
        assert_eq!(out, [2, 3]);
        assert!(r.is_empty());
        r.cancelled(&mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn stale_cancel_does_not_hit_reused_id() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let old = r.open_anthropic(1, params(true), vec![]).unwrap();
        step(&mut r, &[1], &[0], &[1]);
        let _new = r.open_anthropic(1, params(true), vec![]).unwrap();
        old.cancel();
        let mut out = Vec::new();
        r.cancelled(&mut out);
        assert!(out.is_empty());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn wakers_come_back_once_per_append() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = r.open_anthropic(1, params(true), vec![]).unwrap();
        read_all(&ch);
        assert!(matches!(ch.park(11), Park::Parked(None)));
        assert_eq!(
            step(&mut r, &[1], &[3], &[0]).1,
            Vec::<u32>::new(),
            "held half char"
        );
        assert_eq!(step(&mut r, &[1], &[4], &[0]).1, [11]);
        assert_eq!(
            step(&mut r, &[1], &[1], &[0]).1,
            Vec::<u32>::new(),
            "not parked again"
        );
        read_all(&ch);
        assert!(matches!(ch.park(12), Park::Parked(None)));
        assert_eq!(r.close(1), Some(12));
        assert_eq!(ch.take_with(|_| ()), None);
    }

    #[test]
    fn fail_streaming_and_errors() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = r.open_anthropic(1, params(true), vec![]).unwrap();
        step(&mut r, &[1], &[1], &[0]);
        assert_eq!(r.fail(1, "overloaded_error", "Overloaded"), None);
        assert_eq!(r.fail(1, "x", "y"), None);
        let sse = read_all(&ch);
        assert!(sse.ends_with(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
        ));
        assert!(matches!(
            r.open_anthropic(2, params(true), vec![])
                .and_then(|_| r.open_anthropic(2, params(true), vec![])),
            Err(CoreError::DuplicateStream(2))
        ));
        let (mut d, mut w) = (Vec::new(), Vec::new());
        assert!(matches!(
            r.step(&[2], &[], &[0], &mut d, &mut w),
            Err(CoreError::LengthMismatch { .. })
        ));
        assert_eq!(
            r.step(&[2], &[1], &[3], &mut d, &mut w),
            Err(CoreError::InvalidFinishCode {
                stream_id: 2,
                code: 3
            })
        );
    }

    #[test]
    fn over_bound_lists_lagging_readers() {
        let mut r = TestRouter::new(vocab(), 500);
        let a = r.open_anthropic(1, params(true), vec![]).unwrap();
        let _b = r.open_anthropic(2, params(true), vec![]).unwrap();
        read_all(&a);
        for _ in 0..3 {
            step(&mut r, &[1, 2], &[1, 1], &[0, 0]);
        }
        let mut out = Vec::new();
        r.over_bound(&mut out);
        assert_eq!(out, [2]);
    }

    #[test]
    fn sentencepiece_trim_applies_to_first_text_only() {
        let tokens = ["<s>", "\u{2581}Hi", "\u{2581}there"];
        let vocab = Vocab::from_token_strings(&tokens, VocabKind::SentencePiece, &[0])
            .unwrap()
            .with_trim_leading_space(true);
        let mut r = TestRouter::new(Arc::new(vocab), DEFAULT_MAX_UNREAD_BYTES);
        let ch = r.open_anthropic(1, params(false), vec![]).unwrap();
        step(&mut r, &[1, 1, 1], &[1, 2, 0], &[0, 0, 1]);
        assert!(read_all(&ch).contains("\"text\":\"Hi there\""));
    }
}
