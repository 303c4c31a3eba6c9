//! Per-stream state keyed by engine stream id; turns one engine step for many streams into frames.
//! A response is one channel: one stream writes it, or (OpenAI's `n`) one stream per choice.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::channel::{CancelInbox, Channel};
use crate::detok::Detok;
use crate::error::CoreError;
use crate::events::{
    DialectParams, ErrorKind, Finish, FinishReason, PromptUsage, Protocol, TokenLogprob, TopLogprob,
};
use crate::loop_guard::LoopGuard;
use crate::markup::{MarkupParser, MarkupSpec, PieceKind, Pieces, ToolSchemas};
use crate::stop::StopMatcher;
use crate::vocab::Vocab;

pub const DEFAULT_MAX_UNREAD_BYTES: usize = 1 << 20;

/// Everything that decides how a stream reads and when it ends, but the engine's numbers: the
/// dialect, stop sequences, the model's markup and its end-of-turn tokens. Built by the API.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    pub dialect: DialectParams,
    pub stop_sequences: Vec<String>,
    /// Thinking and tool-call markup to parse; `None` for plain text.
    pub markup: Option<Arc<MarkupSpec>>,
    /// Markup the prompt already holds (an opened `<think>`, a forced call's opening).
    pub prefill: String,
    /// Tokens that end the turn: counted, not rendered.
    pub eos_ids: Vec<u32>,
    /// The request's tools: the XML formats type parameters by their schemas.
    pub tools: Arc<ToolSchemas>,
}

/// What one token does to its stream, before stop sequences and markup are considered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenEnd {
    Running,
    /// An end-of-turn token: counted, not rendered.
    EndTurn,
    /// The last token `max_tokens` allows: rendered, then the stream ends.
    MaxTokens,
    /// The token with which the reply fell into a loop (the loop guard): rendered, then the
    /// stream ends.
    Repeating,
}

/// A sampled token's log-probability and its likeliest alternatives `(token id, logprob)`, for a
/// stream whose request asked for them; the engine reports them before the step's tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledLogprobs {
    pub stream_id: u64,
    pub token_id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Routes engine output to every open stream. `W` is the reader's waker type (see [`Channel`]).
#[derive(Debug)]
pub struct Router<W> {
    vocab: Arc<Vocab>,
    streams: HashMap<u64, Stream<W>, BuildHasherDefault<IdHasher>>,
    /// Responses with several choices, by channel serial: what their ended choices left.
    choices: ChoicesBySerial,
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

/// A response with several choices: how many still run, what the ended ones left.
#[derive(Debug, Default)]
struct Choices {
    running: usize,
    output_tokens: u64,
    /// Not streamed: each ended choice's object, by choice index.
    objects: Vec<Vec<u8>>,
}

/// Where a stream writes: its response (the channel's serial) and its choice in it.
#[derive(Debug, Clone, Copy)]
struct Place {
    serial: u64,
    choice: u32,
    /// Several choices write the response (see `Router::choices`).
    shared: bool,
}

type ChoicesBySerial = HashMap<u64, Choices, BuildHasherDefault<IdHasher>>;

#[derive(Debug)]
struct Stream<W> {
    place: Place,
    detok: Detok,
    stop: StopMatcher,
    /// Only for models with thinking or tool-call markup; plain streams skip it entirely.
    markup: Option<Box<MarkupParser>>,
    protocol: Protocol,
    channel: Arc<Channel<W>>,
    output_tokens: u64,
    max_tokens: u64,
    eos_ids: Box<[u32]>,
    /// Only for requests that have it: ends the stream once its reply repeats itself.
    loop_guard: Option<Box<LoopGuard>>,
}

impl<W> Router<W> {
    pub fn new(vocab: Arc<Vocab>, max_unread_bytes: usize) -> Self {
        Self {
            vocab,
            streams: HashMap::default(),
            choices: HashMap::default(),
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

    /// Opens a response as `spec` says, for a prompt of `usage` that may add `max_tokens` tokens:
    /// one stream per id in `stream_ids` (its choices; several only where the dialect has `n`),
    /// all writing one channel. Frames due at once (Anthropic's `message_start`, OpenAI's role
    /// chunk) are queued now. With `loop_span`, each stream has a loop guard of that span (see
    /// [`LoopGuard`]): a reply that repeats itself ends ([`Finish::Repetition`]).
    ///
    /// With markup, text is split into text, thinking and tool calls before stop sequences see
    /// it (so stops match visible text only); the parser starts as if it had read the prefill,
    /// and tool pieces the prefill completes (a forced call's name) are emitted at once.
    pub fn open(
        &mut self,
        stream_ids: &[u64],
        spec: &StreamSpec,
        usage: PromptUsage,
        max_tokens: u64,
        loop_span: Option<u32>,
    ) -> Result<Arc<Channel<W>>, CoreError> {
        let count = stream_ids.len();
        if count == 0 || (count > 1 && !spec.dialect.has_choices()) {
            return Err(CoreError::Choices {
                dialect: spec.dialect.dialect().name(),
                count,
            });
        }
        for (i, id) in stream_ids.iter().enumerate() {
            if self.streams.contains_key(id) || stream_ids[..i].contains(id) {
                return Err(CoreError::DuplicateStream(*id));
            }
        }
        self.next_serial += 1;
        let serial = self.next_serial;
        let channel = Arc::new(Channel::new(
            stream_ids.to_vec(),
            serial,
            self.max_unread_bytes,
            self.inbox.clone(),
            spec.dialect.stream(),
        ));
        channel.prompt(usage.prompt_tokens, usage.cached_tokens);
        let shared = count > 1;
        if shared {
            let choices = Choices {
                running: count,
                output_tokens: 0,
                objects: vec![Vec::new(); count],
            };
            self.choices.insert(serial, choices);
        }
        for (choice, &stream_id) in (0u32..).zip(stream_ids) {
            let mut protocol = spec.dialect.protocol(usage, choice);
            let mut markup = spec
                .markup
                .clone()
                .filter(|_| protocol.supports_markup())
                .map(|markup| Box::new(MarkupParser::new(markup, spec.tools.clone())));
            let pieces = &mut self.pieces;
            pieces.clear();
            if let Some(parser) = markup.as_deref_mut() {
                parser.prefill(&spec.prefill, pieces);
            }
            // A new channel has no waker yet, so there is nobody to wake.
            let _ = channel.append_with(|buf| {
                protocol.start(buf);
                emit(&mut protocol, pieces, buf);
            });
            let stream = Stream {
                place: Place {
                    serial,
                    choice,
                    shared,
                },
                detok: Detok::new(self.vocab.trim_leading_space()),
                stop: StopMatcher::new(spec.stop_sequences.clone()),
                markup,
                protocol,
                channel: channel.clone(),
                output_tokens: 0,
                max_tokens: max_tokens.max(1),
                eos_ids: spec.eos_ids.clone().into_boxed_slice(),
                loop_guard: loop_span.map(|span| Box::new(LoopGuard::new(span))),
            };
            self.streams.insert(stream_id, stream);
        }
        Ok(channel)
    }

    /// One engine step: `stream_ids[i]` produced `token_ids[i]`.
    ///
    /// Appends to `ended` every stream that ended, and why: an end-of-turn token, `max_tokens`,
    /// a stop sequence, a finished tool call, or a reader that cancelled since the last report.
    /// The engine drops exactly those. Appends to `wake` the wakers to call once no lock is held.
    /// Unknown stream ids are ignored.
    pub fn step(
        &mut self,
        stream_ids: &[u64],
        token_ids: &[u32],
        ended: &mut Vec<(u64, FinishReason)>,
        wake: &mut Vec<W>,
    ) -> Result<(), CoreError> {
        if stream_ids.len() != token_ids.len() {
            return Err(CoreError::LengthMismatch {
                stream_ids: stream_ids.len(),
                token_ids: token_ids.len(),
            });
        }
        self.drain_cancelled(|stream_id| ended.push((stream_id, FinishReason::Cancelled)));

        let Self {
            vocab,
            streams,
            choices,
            raw,
            text,
            pieces,
            staged,
            ..
        } = self;
        for (&stream_id, &token_id) in stream_ids.iter().zip(token_ids) {
            let Some(stream) = streams.get_mut(&stream_id) else {
                continue;
            };
            stream.output_tokens += 1;
            stream.channel.count_token();
            let looping = |guard: &mut LoopGuard| guard.push(token_id);
            let code = if stream.eos_ids.contains(&token_id) {
                TokenEnd::EndTurn
            } else if stream.output_tokens >= stream.max_tokens {
                TokenEnd::MaxTokens
            } else if stream.loop_guard.as_deref_mut().is_some_and(looping) {
                TokenEnd::Repeating
            } else {
                TokenEnd::Running
            };
            raw.clear();
            text.clear();
            if code != TokenEnd::EndTurn {
                let mut bytes = vocab.token_bytes(token_id);
                if bytes.is_empty() {
                    bytes = markup_special(stream.markup.as_deref(), vocab, token_id);
                }
                stream.detok.push(bytes, raw);
            }
            if code != TokenEnd::Running {
                stream.detok.finish(raw);
            }
            if stream.markup.is_some() {
                let (waker, finish) = step_markup(stream, choices, raw, code, pieces, staged);
                wake.extend(waker);
                if let Some(reason) = finish {
                    streams.remove(&stream_id);
                    ended.push((stream_id, reason));
                }
                continue;
            }
            let matched = stream.stop.push(raw, text);
            if matched.is_none() && code != TokenEnd::Running {
                stream.stop.finish(text);
            }
            let finish = match (matched, code) {
                (Some(index), _) => Some(Finish::StopSequence(stream.stop.stop(index))),
                (None, TokenEnd::EndTurn) => Some(Finish::EndTurn),
                (None, TokenEnd::MaxTokens) => Some(Finish::MaxTokens),
                (None, TokenEnd::Repeating) => Some(Finish::Repetition),
                (None, TokenEnd::Running) => None,
            };
            let reason = finish.map(Finish::reason);
            let waker = release(
                &mut stream.protocol,
                &stream.channel,
                (stream.place, stream.output_tokens),
                choices,
                finish,
                !text.is_empty(),
                |p, buf| p.text(text, buf),
            );
            wake.extend(waker);
            if let Some(reason) = reason {
                streams.remove(&stream_id);
                ended.push((stream_id, reason));
            }
        }
        Ok(())
    }

    /// The log-probabilities of tokens the next `step` brings (an end-of-turn token has none,
    /// as it has no text). They are written with the text those tokens release.
    pub fn logprobs(&mut self, sampled: &[SampledLogprobs]) {
        for entry in sampled {
            let Some(stream) = self.streams.get_mut(&entry.stream_id) else {
                continue;
            };
            if stream.eos_ids.contains(&entry.token_id) {
                continue;
            }
            let (token, bytes) = token_text(&self.vocab, entry.token_id);
            let top_logprobs = entry
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = token_text(&self.vocab, id);
                    TopLogprob {
                        token,
                        logprob,
                        bytes,
                    }
                })
                .collect();
            stream.protocol.logprob(TokenLogprob {
                token,
                logprob: entry.logprob,
                bytes,
                top_logprobs,
            });
        }
    }

    /// Removes the streams whose readers cancelled since the last call and appends their ids.
    pub fn cancelled(&mut self, out: &mut Vec<u64>) {
        self.drain_cancelled(|stream_id| out.push(stream_id));
    }

    fn drain_cancelled(&mut self, mut report: impl FnMut(u64)) {
        let cancelled = std::mem::take(&mut *self.inbox.lock().unwrap_or_else(|p| p.into_inner()));
        for (stream_id, serial) in cancelled {
            if self
                .streams
                .get(&stream_id)
                .is_some_and(|s| s.place.serial == serial)
            {
                if let Some(stream) = self.streams.remove(&stream_id) {
                    self.choices.remove(&stream.place.serial);
                    if !stream.channel.is_failed() {
                        stream.channel.ended("cancelled");
                    }
                }
                report(stream_id);
            }
        }
    }

    /// Ends a stream's response with an error in its dialect: an error event (streaming) or the
    /// error envelope as the body, whose HTTP status the reader then reports. The response's
    /// other choices are reported cancelled by the next `step` or `cancelled`. Returns the waker.
    pub fn fail(&mut self, stream_id: u64, kind: ErrorKind, message: &str) -> Option<W> {
        let mut stream = self.remove(stream_id)?;
        stream.channel.ended(kind.name());
        let protocol = &mut stream.protocol;
        stream
            .channel
            .fail_with(|buf| protocol.error(kind, message, buf))
    }

    /// Drops a stream's response without emitting anything; its reader sees end of stream.
    pub fn close(&mut self, stream_id: u64) -> Option<W> {
        let stream = self.remove(stream_id)?;
        stream.channel.close_with(|_| {})
    }

    /// Removes a stream, and with it its response's other choices (reported as cancelled).
    fn remove(&mut self, stream_id: u64) -> Option<Stream<W>> {
        let stream = self.streams.remove(&stream_id)?;
        let Place { serial, shared, .. } = stream.place;
        if shared && self.choices.remove(&serial).is_some() {
            let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
            let others = stream
                .channel
                .stream_ids()
                .iter()
                .filter(|&&id| id != stream_id);
            inbox.extend(others.map(|&id| (id, serial)));
        }
        Some(stream)
    }

    /// Queues a keep-alive ping on a streaming response (e.g. during a long prefill); the first
    /// choice pings for a response with several.
    pub fn ping(&mut self, stream_id: u64) -> Option<W> {
        let stream = self.streams.get_mut(&stream_id)?;
        if stream.place.choice > 0 {
            return None;
        }
        let protocol = &mut stream.protocol;
        stream.channel.append_with(|buf| protocol.ping(buf))
    }

    /// The stream's prompt reused `cached_tokens` from the prefix cache's tier `cached_from`
    /// ("memory", "disk", "in-flight": another prompt's prefill waited for); usage reported from
    /// now on says so, the request log names the tier. Unknown ids are ignored.
    pub fn cached(
        &mut self,
        stream_id: u64,
        cached_tokens: u64,
        cached_from: &str,
    ) -> Result<(), CoreError> {
        let tier = cache_tier(cached_from)?;
        if let Some(stream) = self.streams.get_mut(&stream_id) {
            stream.protocol.cached(cached_tokens);
            stream.channel.cached(cached_tokens, tier);
        }
        Ok(())
    }

    /// Verify passes checked `guessed[i]` tokens that `drafter` ("prompt-lookup", "draft-model")
    /// guessed for stream `stream_ids[i]`, which kept `kept[i]` of them: the request log says so.
    /// Unknown ids are ignored.
    pub fn guessed(
        &self,
        stream_ids: &[u64],
        guessed: &[u64],
        kept: &[u64],
        drafter: &str,
    ) -> Result<(), CoreError> {
        let drafter = drafter_kind(drafter)?;
        if guessed.len() != stream_ids.len() || kept.len() != stream_ids.len() {
            return Err(CoreError::GuessedLengths {
                stream_ids: stream_ids.len(),
                guessed: guessed.len(),
                kept: kept.len(),
            });
        }
        for ((id, guessed), kept) in stream_ids.iter().zip(guessed).zip(kept) {
            if let Some(stream) = self.streams.get(id) {
                stream.channel.guessed(*guessed, *kept, drafter);
            }
        }
        Ok(())
    }

    /// Ends with an `overloaded` error every response whose reader has lagged past the unread-byte
    /// bound for longer than `timeout` (the engine never waits for a reader) and appends, sorted,
    /// the ids of its streams. Appends the wakers to `wake`.
    pub fn fail_stalled(&mut self, timeout: Duration, out: &mut Vec<u64>, wake: &mut Vec<W>) {
        let now = Instant::now();
        let start = out.len();
        out.extend(
            self.streams
                .iter()
                .filter(|(_, stream)| stream.channel.lagging_for(now).is_some_and(|d| d > timeout))
                .map(|(&id, _)| id),
        );
        out[start..].sort_unstable();
        for &stream_id in &out[start..] {
            let message = "the client stopped reading the stream";
            wake.extend(self.fail(stream_id, ErrorKind::Overloaded, message));
        }
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

/// A special token renders to nothing, except one whose text is a tag of the stream's markup
/// (gpt-oss, Kimi, DeepSeek and Mistral write their tool markup as special tokens).
/// A token's text as logprobs report it (lossy where it is part of a character) and its bytes;
/// a special token's own text.
/// A prefix cache tier's name as the engine gives it: "memory", "disk" or "in-flight".
pub fn cache_tier(name: &str) -> Result<&'static str, CoreError> {
    match name {
        "memory" => Ok("memory"),
        "disk" => Ok("disk"),
        "in-flight" => Ok("in-flight"),
        _ => Err(CoreError::UnknownCacheTier(name.to_owned())),
    }
}

/// The drafter's name as the request log gives it.
pub fn drafter_kind(name: &str) -> Result<&'static str, CoreError> {
    match name {
        "prompt-lookup" => Ok("prompt-lookup"),
        "draft-model" => Ok("draft-model"),
        _ => Err(CoreError::UnknownDrafter(name.to_owned())),
    }
}

fn token_text(vocab: &Vocab, token_id: u32) -> (String, Vec<u8>) {
    let mut bytes = vocab.token_bytes(token_id);
    if bytes.is_empty() {
        bytes = vocab.special_bytes(token_id).unwrap_or_default();
    }
    (String::from_utf8_lossy(bytes).into_owned(), bytes.to_vec())
}

fn markup_special<'v>(markup: Option<&MarkupParser>, vocab: &'v Vocab, token_id: u32) -> &'v [u8] {
    let Some(markup) = markup else {
        return &[]; // no lookup for streams without markup
    };
    match vocab.special_bytes(token_id) {
        Some(bytes) if markup.spec().renders_special(bytes) => bytes,
        _ => &[],
    }
}

/// The markup path of one step for one stream: parse, match stops on visible text, emit.
/// Returns the waker to call and why the stream ended, if it did.
// NOTE: kept out of line so the plain-text loop in `step` stays as small as before markup.
#[inline(never)]
fn step_markup<W>(
    stream: &mut Stream<W>,
    choices: &mut ChoicesBySerial,
    raw: &str,
    code: TokenEnd,
    pieces: &mut Pieces,
    staged: &mut Pieces,
) -> (Option<W>, Option<FinishReason>) {
    let Some(markup) = stream.markup.as_deref_mut() else {
        return (None, None);
    };
    pieces.clear();
    staged.clear();
    markup.push(raw, pieces);
    if code != TokenEnd::Running {
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
    if matched.is_none() && code != TokenEnd::Running {
        staged.push_with(PieceKind::Text, |buf| stop.finish(buf));
    }
    let finish = match (matched, code) {
        (Some(index), _) => Some(Finish::StopSequence(stop.stop(index))),
        (None, TokenEnd::EndTurn) => Some(Finish::EndTurn),
        (None, TokenEnd::MaxTokens) => Some(Finish::MaxTokens),
        (None, TokenEnd::Repeating) => Some(Finish::Repetition),
        (None, TokenEnd::Running) => None,
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
    let waker = release(
        &mut stream.protocol,
        &stream.channel,
        (stream.place, stream.output_tokens),
        choices,
        finish,
        !staged.is_empty(),
        |p, buf| emit(p, staged, buf),
    );
    (waker, finish.map(Finish::reason))
}

/// What a token released (`last` writes it, if `released`) goes out; with `finish`, the stream
/// ends after it. Returns the waker to call.
fn release<W>(
    protocol: &mut Protocol,
    channel: &Channel<W>,
    (place, output_tokens): (Place, u64),
    choices: &mut ChoicesBySerial,
    finish: Option<Finish<'_>>,
    released: bool,
    last: impl FnOnce(&mut Protocol, &mut Vec<u8>),
) -> Option<W> {
    match finish {
        None if !released => None,
        None => channel.append_with(|buf| last(protocol, buf)),
        Some(finish) => end_stream(
            protocol,
            channel,
            place,
            output_tokens,
            choices,
            finish,
            last,
        ),
    }
}

/// A stream ends as `finish` says, after `last` writes what its last token released. The
/// response ends with it, unless other choices of it still run.
fn end_stream<W>(
    protocol: &mut Protocol,
    channel: &Channel<W>,
    place: Place,
    output_tokens: u64,
    choices: &mut ChoicesBySerial,
    finish: Finish<'_>,
    last: impl FnOnce(&mut Protocol, &mut Vec<u8>),
) -> Option<W> {
    let Some(response) = choices.get_mut(&place.serial).filter(|_| place.shared) else {
        let waker = channel.close_with(|buf| {
            last(protocol, buf);
            protocol.finish(finish, output_tokens, buf);
        });
        if let Some(result) = protocol.result() {
            channel.set_result(result);
        }
        channel.ended("finished");
        return waker;
    };
    response.running -= 1;
    response.output_tokens += output_tokens;
    if response.running > 0 {
        let object = &mut response.objects[place.choice as usize];
        return channel.append_with(|buf| {
            last(protocol, buf);
            protocol.finish_choice(finish, buf, object);
        });
    }
    let Choices {
        output_tokens,
        mut objects,
        ..
    } = choices
        .remove(&place.serial)
        .expect("the response was just found");
    let waker = channel.close_with(|buf| {
        last(protocol, buf);
        protocol.finish_choice(finish, buf, &mut objects[place.choice as usize]);
        protocol.end(output_tokens, &objects, buf);
    });
    channel.ended("finished");
    waker
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
    use crate::events::anthropic::AnthropicParams;
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

    /// An Anthropic stream ending at token 0 (`<eos>`) or after `max_tokens`.
    fn open(
        r: &mut TestRouter,
        id: u64,
        stream: bool,
        stops: &[&str],
        max_tokens: u64,
    ) -> Result<Arc<Channel<u32>>, CoreError> {
        open_guarded(r, id, stream, stops, max_tokens, None)
    }

    /// The same, with a loop guard of `loop_span` tokens.
    fn open_guarded(
        r: &mut TestRouter,
        id: u64,
        stream: bool,
        stops: &[&str],
        max_tokens: u64,
        loop_span: Option<u32>,
    ) -> Result<Arc<Channel<u32>>, CoreError> {
        let spec = StreamSpec {
            dialect: DialectParams::Anthropic(AnthropicParams {
                model: "m".into(),
                message_id: "msg_x".into(),
                stream,
                compaction: false,
                compacted: None,
                applied_edits: None,
                tool_search: None,
            }),
            stop_sequences: stops.iter().map(|s| (*s).to_owned()).collect(),
            markup: None,
            prefill: String::new(),
            eos_ids: vec![0],
            tools: Arc::default(),
        };
        let usage = PromptUsage {
            prompt_tokens: 3,
            cached_tokens: 0,
        };
        r.open(&[id], &spec, usage, max_tokens, loop_span)
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

    /// Each frame's first line after its `id:` line.
    fn events(sse: &str) -> Vec<&str> {
        sse.split_terminator("\n\n")
            .map(|f| f.lines().find(|l| !l.starts_with("id: ")).unwrap())
            .collect()
    }

    type Ended = Vec<(u64, FinishReason)>;

    fn step(r: &mut TestRouter, ids: &[u64], toks: &[u32]) -> (Ended, Vec<u32>) {
        let (mut ended, mut wake) = (Vec::new(), Vec::new());
        r.step(ids, toks, &mut ended, &mut wake).unwrap();
        (ended, wake)
    }

    const NONE: Ended = Vec::new();

    #[test]
    fn each_channel_tells_what_its_stream_came_to() {
        let mut r = TestRouter::new(vocab(), 1 << 20);
        let finished = open(&mut r, 1, true, &[], 3).unwrap();
        let failed = open(&mut r, 2, true, &[], 10).unwrap();
        let cancelled = open(&mut r, 3, true, &[], 10).unwrap();
        assert_eq!(finished.outcome().end, "running");
        assert_eq!(finished.outcome().prompt_tokens, 3);
        assert_eq!(finished.outcome().first_token, None);
        step(&mut r, &[1, 2, 3], &[1, 2, 1]);
        assert!(finished.outcome().first_token.is_some());
        step(&mut r, &[1, 1], &[2, 8]);
        assert_eq!((finished.outcome().end, finished.tokens()), ("finished", 3));
        r.fail(2, ErrorKind::Unavailable, "the server is shutting down");
        assert_eq!((failed.outcome().end, failed.tokens()), ("unavailable", 1));
        cancelled.cancel();
        r.cancelled(&mut Vec::new());
        assert_eq!(
            (cancelled.outcome().end, cancelled.tokens()),
            ("cancelled", 1)
        );
    }

    #[test]
    fn a_channel_counts_the_guesses_its_streams_kept() {
        let mut r = TestRouter::new(vocab(), 1 << 20);
        let guessing = open(&mut r, 1, false, &[], 10).unwrap();
        let plain = open(&mut r, 2, false, &[], 10).unwrap();
        r.guessed(&[1, 2, 9], &[4, 0, 4], &[3, 0, 1], "prompt-lookup")
            .unwrap();
        r.guessed(&[1], &[4], &[4], "prompt-lookup").unwrap();
        let outcome = guessing.outcome();
        assert_eq!(
            (outcome.guessed, outcome.guesses_kept, outcome.drafter),
            (8, 7, "prompt-lookup")
        );
        assert_eq!(plain.outcome().drafter, "prompt-lookup");
        assert_eq!(plain.outcome().guessed, 0);
        assert!(matches!(
            r.guessed(&[1], &[1], &[1], "oracle"),
            Err(CoreError::UnknownDrafter(_))
        ));
        assert!(matches!(
            r.guessed(&[1, 2], &[1], &[1, 1], "draft-model"),
            Err(CoreError::GuessedLengths { .. })
        ));
    }

    #[test]
    fn a_guarded_reply_that_repeats_itself_ends() {
        let mut r = TestRouter::new(vocab(), 1 << 20);
        let guarded = open_guarded(&mut r, 1, false, &[], 1000, Some(12)).unwrap();
        let unguarded = open(&mut r, 2, false, &[], 1000).unwrap();
        let mut ended = NONE;
        for _ in 0..10 {
            ended.extend(step(&mut r, &[1, 1, 2, 2], &[1, 2, 1, 2]).0);
        }
        // " Hi there" four times takes 8 tokens; the guard wants 12 and at least 4 cycles.
        assert_eq!(ended, vec![(1, FinishReason::Repetition)]);
        assert_eq!(guarded.tokens(), 12);
        let body = read_all(&guarded);
        // An agent would ask for more after max_tokens: Anthropic's end is an end of turn.
        assert!(body.contains(r#""stop_reason":"end_turn""#), "{body}");
        assert_eq!(unguarded.outcome().end, "running");
    }

    fn open_openai(r: &mut TestRouter, id: u64, stream: bool, stops: &[&str]) -> Arc<Channel<u32>> {
        let spec = StreamSpec {
            dialect: DialectParams::OpenAi(crate::events::openai::OpenAiParams {
                model: "m".into(),
                completion_id: "chatcmpl-x".into(),
                created: 1,
                stream,
                include_usage: false,
                kind: crate::events::openai::CompletionKind::Chat,
                custom_tools: Vec::new(),
            }),
            stop_sequences: stops.iter().map(|s| (*s).to_owned()).collect(),
            markup: None,
            prefill: String::new(),
            eos_ids: vec![0],
            tools: Arc::default(),
        };
        r.open(&[id], &spec, PromptUsage::default(), 100, None)
            .unwrap()
    }

    fn open_choices(r: &mut TestRouter, ids: &[u64], stream: bool) -> Arc<Channel<u32>> {
        let spec = StreamSpec {
            dialect: DialectParams::OpenAi(crate::events::openai::OpenAiParams {
                model: "m".into(),
                completion_id: "chatcmpl-x".into(),
                created: 1,
                stream,
                include_usage: true,
                kind: crate::events::openai::CompletionKind::Chat,
                custom_tools: Vec::new(),
            }),
            stop_sequences: Vec::new(),
            markup: None,
            prefill: String::new(),
            eos_ids: vec![0],
            tools: Arc::default(),
        };
        let usage = PromptUsage {
            prompt_tokens: 4,
            cached_tokens: 0,
        };
        r.open(ids, &spec, usage, 100, None).unwrap()
    }

    #[test]
    fn events_are_numbered_as_they_are_queued() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        assert_eq!(
            ch.take_numbered_with(|_, last| last),
            Some(2),
            "message_start and ping"
        );
        r.ping(1);
        step(&mut r, &[1], &[1]);
        step(&mut r, &[1], &[0]);
        let sse = read_all(&ch);
        let ids: Vec<&str> = sse
            .split_terminator("\n\n")
            .map(|f| f.lines().next().unwrap())
            .collect();
        let want: Vec<String> = (3..3 + ids.len()).map(|i| format!("id: {i}")).collect();
        assert_eq!(ids, want, "{sse}");
        let body = open(&mut r, 2, false, &[], u64::MAX).unwrap();
        step(&mut r, &[2], &[0]);
        assert!(read_all(&body).starts_with('{'), "a body has no ids");
    }

    #[test]
    fn choices_stream_into_one_response_with_one_ending() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open_choices(&mut r, &[5, 6], true);
        step(&mut r, &[5, 6], &[1, 2]);
        assert_eq!(
            step(&mut r, &[5, 6], &[0, 8]).0,
            [(5, FinishReason::EndTurn)]
        );
        assert_eq!(ch.outcome().end, "running", "choice 1 still runs");
        assert_eq!(step(&mut r, &[6], &[0]).0, [(6, FinishReason::EndTurn)]);
        assert!(r.is_empty() && r.choices.is_empty());
        let sse = read_all(&ch);
        let data: Vec<&str> = sse
            .split_terminator("\n\n")
            .map(|f| f.split_once("data: ").unwrap().1)
            .collect();
        assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
        assert_eq!(*data.last().unwrap(), "[DONE]");
        let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let usage: Vec<_> = chunks
            .iter()
            .filter(|c| c["choices"] == serde_json::json!([]))
            .collect();
        assert_eq!(usage.len(), 1, "{sse}");
        assert_eq!(usage[0]["usage"]["prompt_tokens"], 4);
        assert_eq!(usage[0]["usage"]["completion_tokens"], 5);
        let finished: Vec<_> = chunks
            .iter()
            .filter_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(|_| c["choices"][0]["index"].clone())
            })
            .collect();
        assert_eq!(finished, [serde_json::json!(0), serde_json::json!(1)]);
        assert_eq!(ch.outcome().end, "finished");
        assert_eq!(ch.tokens(), 5);
    }

    #[test]
    fn choices_merge_into_one_body_in_choice_order() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open_choices(&mut r, &[5, 6, 7], false);
        step(&mut r, &[5, 6, 7], &[1, 2, 8]);
        step(&mut r, &[6], &[0]);
        step(&mut r, &[5, 7], &[0, 1]);
        assert_eq!(
            ch.take_with(<[u8]>::to_vec),
            Some(vec![]),
            "nothing before the last"
        );
        step(&mut r, &[7], &[0]);
        let body: serde_json::Value = serde_json::from_str(&read_all(&ch)).unwrap();
        let texts: Vec<&str> = body["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["Hi", " there", "!Hi"]);
        assert_eq!(body["choices"][2]["index"], 2);
        assert_eq!(body["usage"]["completion_tokens"], 7);
        assert_eq!(body["usage"]["total_tokens"], 11);
    }

    #[test]
    fn a_choice_cancelled_or_failed_ends_its_whole_response() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let cancelled = open_choices(&mut r, &[1, 2], true);
        cancelled.cancel();
        let mut out = Vec::new();
        r.cancelled(&mut out);
        out.sort_unstable();
        assert_eq!(out, [1, 2]);
        let failed = open_choices(&mut r, &[3, 4], true);
        r.fail(3, ErrorKind::Internal, "boom");
        assert_eq!(step(&mut r, &[4], &[1]).0, [(4, FinishReason::Cancelled)]);
        assert!(r.is_empty() && r.choices.is_empty());
        assert_eq!(failed.outcome().end, "internal");
        assert!(read_all(&failed).ends_with("data: [DONE]\n\n"));
        open(&mut r, 9, true, &[], 1).unwrap();
        let spec = StreamSpec {
            dialect: DialectParams::Anthropic(AnthropicParams {
                model: "m".into(),
                message_id: "msg_x".into(),
                stream: true,
                compaction: false,
                compacted: None,
                applied_edits: None,
                tool_search: None,
            }),
            stop_sequences: Vec::new(),
            markup: None,
            prefill: String::new(),
            eos_ids: vec![0],
            tools: Arc::default(),
        };
        assert!(matches!(
            r.open(&[10, 11], &spec, PromptUsage::default(), 5, None),
            Err(CoreError::Choices { count: 2, .. })
        ));
        assert!(matches!(
            r.open(&[9], &spec, PromptUsage::default(), 5, None),
            Err(CoreError::DuplicateStream(9))
        ));
    }

    fn sampled(stream_id: u64, token_id: u32, logprob: f32) -> SampledLogprobs {
        SampledLogprobs {
            stream_id,
            token_id,
            logprob,
            top: vec![(token_id, logprob), (8, -3.0)],
        }
    }

    #[test]
    fn logprobs_go_with_the_text_their_tokens_release() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open_openai(&mut r, 1, true, &["</stop>"]);
        read_all(&ch);
        r.logprobs(&[sampled(1, 1, -0.5)]);
        step(&mut r, &[1], &[1]);
        let first = read_all(&ch);
        assert!(first.contains(r#""content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5,"bytes":[72,105],"top_logprobs":[{"token":"Hi","logprob":-0.5,"bytes":[72,105]},{"token":"!","logprob":-3.0,"bytes":[33]}]}]}"#), "{first}");
        // `</` may start the stop sequence: held back, and its logprob with it.
        r.logprobs(&[sampled(1, 5, -1.0)]);
        step(&mut r, &[1], &[5]);
        assert_eq!(read_all(&ch), "");
        r.logprobs(&[sampled(1, 8, -2.0), sampled(1, 0, -0.1)]);
        step(&mut r, &[1], &[8]);
        let released = read_all(&ch);
        assert!(
            released.contains(r#""content":"</!"},"logprobs":{"content":[{"token":"</","#),
            "{released}"
        );
        assert!(
            released.contains(r#"{"token":"!","logprob":-2.0,"#),
            "{released}"
        );

        let body = open_openai(&mut r, 2, false, &[]);
        r.logprobs(&[sampled(2, 2, -0.25)]);
        step(&mut r, &[2], &[2]);
        r.logprobs(&[sampled(2, 0, -0.1)]); // the end of turn: no text, no logprob
        step(&mut r, &[2], &[0]);
        let json: serde_json::Value = serde_json::from_str(&read_all(&body)).unwrap();
        let content = &json["choices"][0]["logprobs"]["content"];
        assert_eq!(content.as_array().unwrap().len(), 1);
        assert_eq!(content[0]["token"], " there");
        assert_eq!(content[0]["logprob"], -0.25);
    }

    #[test]
    fn event_order_for_two_interleaved_streams() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let a = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        let b = open(&mut r, 2, true, &[], 3).unwrap();
        assert_eq!(
            events(&read_all(&a)),
            ["event: message_start", "event: ping"]
        );
        step(&mut r, &[1, 2], &[1, 3]);
        step(&mut r, &[2, 1], &[4, 2]);
        let (ended, _) = step(&mut r, &[1, 2], &[0, 8]);
        assert_eq!(
            ended,
            [(1, FinishReason::EndTurn), (2, FinishReason::MaxTokens)]
        );
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
        let ch = open(&mut r, 9, true, &["</stop>"], u64::MAX).unwrap();
        read_all(&ch);
        for tok in [1, 5, 6] {
            assert_eq!(step(&mut r, &[9], &[tok]).0, NONE);
        }
        assert_eq!(
            step(&mut r, &[9], &[7]).0,
            [(9, FinishReason::StopSequence)]
        );
        assert!(r.is_empty());
        let sse = read_all(&ch);
        assert_eq!(sse.matches("text_delta").count(), 1);
        assert!(sse.contains("\"text\":\"Hi\"}") && !sse.contains("\"text\":\"</"));
        assert!(sse.contains(
            "{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":\"</stop>\"},\"usage\":{\"output_tokens\":4}"
        ));
        assert_eq!(ch.take_with(|_| ()), None);
        // Later steps for the dropped id are ignored.
        assert_eq!(step(&mut r, &[9], &[1]).0, NONE);
    }

    #[test]
    fn holdback_and_partial_char_released_at_finish() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open(&mut r, 1, false, &["</stop>"], u64::MAX).unwrap();
        assert_eq!(
            ch.take_with(<[u8]>::to_vec),
            Some(vec![]),
            "non-streaming: nothing yet"
        );
        step(&mut r, &[1], &[1]);
        step(&mut r, &[1], &[5]);
        step(&mut r, &[1], &[3]);
        step(&mut r, &[1], &[0]);
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
        let a = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        let b = open(&mut r, 2, true, &[], u64::MAX).unwrap();
        let c = open(&mut r, 3, true, &[], u64::MAX).unwrap();
        a.cancel();
        assert_eq!(step(&mut r, &[2], &[1]).0, [(1, FinishReason::Cancelled)]);
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
        let old = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        step(&mut r, &[1], &[0]);
        let _new = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        old.cancel();
        let mut out = Vec::new();
        r.cancelled(&mut out);
        assert!(out.is_empty());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn wakers_come_back_once_per_append() {
        let mut r = TestRouter::new(vocab(), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        read_all(&ch);
        assert!(matches!(ch.park(11), Park::Parked(None)));
        assert_eq!(
            step(&mut r, &[1], &[3]).1,
            Vec::<u32>::new(),
            "held half char"
        );
        assert_eq!(step(&mut r, &[1], &[4]).1, [11]);
        assert_eq!(
            step(&mut r, &[1], &[1]).1,
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
        let ch = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        step(&mut r, &[1], &[1]);
        assert_eq!(r.fail(1, ErrorKind::Overloaded, "Overloaded"), None);
        assert_eq!(r.fail(1, ErrorKind::Internal, "y"), None);
        assert_eq!(ch.status(), 529);
        let sse = read_all(&ch);
        assert!(sse.ends_with(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
        ));
        assert!(matches!(
            open(&mut r, 2, true, &[], u64::MAX).and_then(|_| open(&mut r, 2, true, &[], u64::MAX)),
            Err(CoreError::DuplicateStream(2))
        ));
        let (mut d, mut w) = (Vec::new(), Vec::new());
        assert!(matches!(
            r.step(&[2], &[], &mut d, &mut w),
            Err(CoreError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn readers_lagging_past_the_timeout_are_failed_once() {
        let mut r = TestRouter::new(vocab(), 500);
        let lagging = open_choices(&mut r, &[1, 2], true);
        let keeping_up = open(&mut r, 3, true, &[], u64::MAX).unwrap();
        for _ in 0..3 {
            step(&mut r, &[1, 2, 3], &[1, 1, 1]);
            read_all(&keeping_up);
        }
        let (mut out, mut wake) = (Vec::new(), Vec::new());
        r.fail_stalled(Duration::from_secs(60), &mut out, &mut wake);
        assert!(out.is_empty(), "lagging, but not for long");
        std::thread::sleep(Duration::from_millis(20));
        r.fail_stalled(Duration::from_millis(10), &mut out, &mut wake);
        assert_eq!(out, [1, 2]);
        assert_eq!(lagging.status(), 503);
        assert_eq!(lagging.outcome().end, "overloaded");
        assert!(read_all(&lagging).contains("the client stopped reading the stream"));
        out.clear();
        r.fail_stalled(Duration::ZERO, &mut out, &mut wake);
        assert!(out.is_empty() && r.len() == 1);
    }

    #[test]
    fn over_bound_lists_lagging_readers() {
        let mut r = TestRouter::new(vocab(), 500);
        let a = open(&mut r, 1, true, &[], u64::MAX).unwrap();
        let _b = open(&mut r, 2, true, &[], u64::MAX).unwrap();
        read_all(&a);
        for _ in 0..3 {
            step(&mut r, &[1, 2], &[1, 1]);
        }
        let mut out = Vec::new();
        r.over_bound(&mut out);
        assert_eq!(out, [2]);
    }

    #[test]
    fn special_tokens_render_only_as_the_markups_tags() {
        let tokens: Vec<&[u8]> = vec![
            b"<eos>",
            b"[TOOL_CALLS]",
            b"ls",
            b"[ARGS]",
            b"{}",
            b"[INST]",
        ];
        let vocab = Vocab::from_token_bytes(&tokens, &[0, 1, 3, 5]).unwrap();
        assert_eq!(vocab.special_bytes(1), Some(&b"[TOOL_CALLS]"[..]));
        assert_eq!(vocab.special_bytes(2), None);
        let mut r = TestRouter::new(Arc::new(vocab), DEFAULT_MAX_UNREAD_BYTES);
        for (id, markup) in [(1, true), (2, false)] {
            let spec = StreamSpec {
                dialect: DialectParams::Anthropic(AnthropicParams {
                    model: "m".into(),
                    message_id: "msg_x".into(),
                    stream: false,
                    compaction: false,
                    compacted: None,
                    applied_edits: None,
                    tool_search: None,
                }),
                stop_sequences: Vec::new(),
                markup: markup
                    .then(|| Arc::new(MarkupSpec::new(None, Some("mistral_v11")).unwrap())),
                prefill: String::new(),
                eos_ids: vec![0],
                tools: Arc::default(),
            };
            let usage = PromptUsage {
                prompt_tokens: 1,
                cached_tokens: 0,
            };
            let ch = r.open(&[id], &spec, usage, u64::MAX, None).unwrap();
            for tok in [5, 1, 2, 3, 4] {
                assert_eq!(step(&mut r, &[id], &[tok]).0, NONE);
            }
            let end = if markup {
                FinishReason::ToolUse
            } else {
                FinishReason::EndTurn
            };
            assert_eq!(step(&mut r, &[id], &[0]).0, [(id, end)]);
            let body = read_all(&ch);
            if markup {
                assert!(
                    body.contains("\"content\":[{\"type\":\"tool_use\"")
                        && body.contains("\"name\":\"ls\",\"input\":{}"),
                    "{body}"
                );
            } else {
                assert!(body.contains("\"text\":\"ls{}\""), "{body}");
            }
            assert!(!body.contains("[INST]"));
        }
    }

    #[test]
    fn sentencepiece_trim_applies_to_first_text_only() {
        let tokens = ["<s>", "\u{2581}Hi", "\u{2581}there"];
        let vocab = Vocab::from_token_strings(&tokens, VocabKind::SentencePiece, &[0])
            .unwrap()
            .with_trim_leading_space(true);
        let mut r = TestRouter::new(Arc::new(vocab), DEFAULT_MAX_UNREAD_BYTES);
        let ch = open(&mut r, 1, false, &[], u64::MAX).unwrap();
        step(&mut r, &[1, 1, 1], &[1, 2, 0]);
        assert!(read_all(&ch).contains("\"text\":\"Hi there\""));
    }
}
