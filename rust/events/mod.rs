//! Protocol event state machines, one module per API dialect, driven by the router through `Protocol`.

pub mod anthropic;
pub mod custom_input;
pub mod openai;
pub mod responses;
pub mod tool_search;

use crate::error::CoreError;

/// Why a message ended, as the encoders write it (with the stop sequence that matched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish<'a> {
    EndTurn,
    MaxTokens,
    StopSequence(&'a str),
    /// The generation ended after at least one complete tool call.
    ToolUse,
    /// The loop guard ended a reply that repeats itself. The agents' dialects write it as an
    /// end of turn: an agent continues a length stop (Claude Code asks three times, then fails)
    /// or gives up on it (Codex); Chat Completions as a length stop.
    Repetition,
}

impl Finish<'_> {
    pub fn reason(self) -> FinishReason {
        match self {
            Self::EndTurn => FinishReason::EndTurn,
            Self::MaxTokens => FinishReason::MaxTokens,
            Self::StopSequence(_) => FinishReason::StopSequence,
            Self::ToolUse => FinishReason::ToolUse,
            Self::Repetition => FinishReason::Repetition,
        }
    }
}

/// Why a stream ended, as the router reports it to the engine: the only place a generation's
/// end is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-turn token.
    EndTurn,
    /// `max_tokens` tokens were generated.
    MaxTokens,
    StopSequence,
    /// The generation ended after at least one complete tool call.
    ToolUse,
    /// The reader went away.
    Cancelled,
    /// The loop guard ended a reply that repeats itself.
    Repetition,
}

/// What went wrong, in no dialect's words: each dialect's encoder names it and picks its HTTP
/// status (`Dialect::error_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    RequestTooLarge,
    RateLimited,
    /// Too much work queued: retry later.
    Overloaded,
    /// The server cannot serve now (not started, shutting down).
    Unavailable,
    Internal,
}

impl ErrorKind {
    /// The kind in words: "invalid_request", ..., "internal".
    pub fn name(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::Authentication => "authentication",
            Self::Permission => "permission",
            Self::NotFound => "not_found",
            Self::RequestTooLarge => "request_too_large",
            Self::RateLimited => "rate_limited",
            Self::Overloaded => "overloaded",
            Self::Unavailable => "unavailable",
            Self::Internal => "internal",
        }
    }

    /// The plain HTTP status for the kind; a dialect may answer one kind differently.
    pub fn http_status(self) -> u16 {
        match self {
            Self::InvalidRequest => 400,
            Self::Authentication => 401,
            Self::Permission => 403,
            Self::NotFound => 404,
            Self::RequestTooLarge => 413,
            Self::RateLimited => 429,
            Self::Overloaded | Self::Unavailable => 503,
            Self::Internal => 500,
        }
    }
}

impl std::str::FromStr for ErrorKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        Ok(match s {
            "invalid_request" => Self::InvalidRequest,
            "authentication" => Self::Authentication,
            "permission" => Self::Permission,
            "not_found" => Self::NotFound,
            "request_too_large" => Self::RequestTooLarge,
            "rate_limited" => Self::RateLimited,
            "overloaded" => Self::Overloaded,
            "unavailable" => Self::Unavailable,
            "internal" => Self::Internal,
            _ => return Err(CoreError::UnknownErrorKind(s.to_owned())),
        })
    }
}

/// An API dialect: how its streams are encoded and how its errors are worded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    Anthropic,
    OpenAi,
    /// OpenAI's Responses API: OpenAI's error envelope and statuses, its own events.
    Responses,
}

/// An error answer of one dialect: the HTTP status, and the envelope as a body or as the last
/// frames of a stream whose headers are out. `param` and `code` are OpenAI's (Anthropic has
/// neither).
#[derive(Debug, Clone, Copy)]
pub struct ErrorReply<'a> {
    pub kind: ErrorKind,
    pub message: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Self::Anthropic => "Anthropic",
            Self::OpenAi => "OpenAI",
            Self::Responses => "Responses",
        }
    }

    pub fn error_status(self, kind: ErrorKind) -> u16 {
        match self {
            Self::Anthropic => anthropic::error_status(kind),
            Self::OpenAi | Self::Responses => openai::error_status(kind),
        }
    }

    /// The error envelope: as the whole body (`stream` false) or as the stream's last frames.
    pub fn write_error(self, error: &ErrorReply<'_>, stream: bool, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic => anthropic::write_error(error, stream, out),
            Self::OpenAi => openai::write_error(error, stream, out),
            Self::Responses => responses::write_error(error, stream, out),
        }
    }
}

/// One generated token's log-probability and its likeliest alternatives, as OpenAI reports
/// them (`logprobs`): the token's text (lossy where it is part of a character) and bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The prompt's size as the engine admitted it, for the dialects' usage reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptUsage {
    pub prompt_tokens: u64,
    /// Of `prompt_tokens`, those whose KV came from the prefix cache.
    pub cached_tokens: u64,
}

/// What a stream of each dialect is opened with (besides the prompt's usage).
#[derive(Debug, Clone)]
pub enum DialectParams {
    Anthropic(anthropic::AnthropicParams),
    OpenAi(openai::OpenAiParams),
    Responses(responses::ResponsesParams),
}

impl DialectParams {
    /// The encoder of choice `choice` (only OpenAI's `n` has more than choice 0).
    pub fn protocol(&self, usage: PromptUsage, choice: u32) -> Protocol {
        match self {
            Self::Anthropic(p) => {
                Protocol::Anthropic(Box::new(anthropic::AnthropicStream::new(p.clone(), usage)))
            }
            Self::OpenAi(p) => Protocol::OpenAi(Box::new(openai::OpenAiStream::new(
                p.clone(),
                usage,
                choice,
            ))),
            Self::Responses(p) => {
                Protocol::Responses(Box::new(responses::ResponsesStream::new(p.clone(), usage)))
            }
        }
    }

    /// A response that generates nothing (the Responses API's `generate: false`): its frames from
    /// opening to end, with no output and no usage, into `out`; returns the response object it
    /// ends with, where the dialect keeps one.
    pub fn empty_response(&self, out: &mut Vec<u8>) -> Option<Vec<u8>> {
        let mut protocol = self.protocol(PromptUsage::default(), 0);
        protocol.start(out);
        protocol.finish(Finish::EndTurn, 0, out);
        protocol.result()
    }

    pub fn stream(&self) -> bool {
        match self {
            Self::Anthropic(p) => p.stream,
            Self::OpenAi(p) => p.stream,
            Self::Responses(p) => p.stream,
        }
    }

    pub fn model(&self) -> &str {
        match self {
            Self::Anthropic(p) => &p.model,
            Self::OpenAi(p) => &p.model,
            Self::Responses(p) => &p.model,
        }
    }

    /// Whether a response may have several choices (OpenAI's `n`).
    pub fn has_choices(&self) -> bool {
        matches!(self, Self::OpenAi(_))
    }

    pub fn dialect(&self) -> Dialect {
        match self {
            Self::Anthropic(_) => Dialect::Anthropic,
            Self::OpenAi(_) => Dialect::OpenAi,
            Self::Responses(_) => Dialect::Responses,
        }
    }
}

/// The dialect state of one stream. Each boxed: a stream is allocated once, and the enum stays
/// a pointer wide whatever the dialects' states grow to.
#[derive(Debug)]
pub enum Protocol {
    Anthropic(Box<anthropic::AnthropicStream>),
    OpenAi(Box<openai::OpenAiStream>),
    Responses(Box<responses::ResponsesStream>),
}

macro_rules! dispatch {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            Self::Anthropic($s) => $call,
            Self::OpenAi($s) => $call,
            Self::Responses($s) => $call,
        }
    };
}

impl Protocol {
    /// Frames sent as soon as the stream opens, before any token.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.start(out))
    }

    /// A keep-alive frame; nothing for non-streaming responses.
    pub fn ping(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.ping(out))
    }

    /// The prompt turned out to reuse `cached_tokens` from the prefix cache (more than at
    /// admission: another prompt's prefill it waited for), for the usage reported at the end.
    pub fn cached(&mut self, cached_tokens: u64) {
        dispatch!(self, s => s.usage.cached_tokens = cached_tokens)
    }

    #[inline]
    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.text(text, out))
    }

    pub fn thinking(&mut self, text: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.thinking(text, out))
    }

    /// A tool call named `name` begins; its arguments follow as `tool_args` fragments.
    pub fn tool_start(&mut self, name: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_start(name, out))
    }

    pub fn tool_args(&mut self, fragment: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_args(fragment, out))
    }

    pub fn tool_end(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_end(out))
    }

    /// The next token's log-probabilities, reported with the next text written (only OpenAI's
    /// dialect has the field; the others drop them).
    pub fn logprob(&mut self, entry: TokenLogprob) {
        if let Self::OpenAi(s) = self {
            s.logprob(entry);
        }
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        dispatch!(self, s => s.finish(finish, output_tokens, out))
    }

    /// One choice of several ends (OpenAI's `n`): streamed, its last chunk goes to `out`; not,
    /// its choice object to `choice`. [`Protocol::end`] ends the response after the last one.
    pub fn finish_choice(&mut self, finish: Finish<'_>, out: &mut Vec<u8>, choice: &mut Vec<u8>) {
        if let Self::OpenAi(s) = self {
            s.finish_choice(finish, out, choice);
        }
    }

    /// The end of a response with several choices, `output_tokens` theirs together.
    pub fn end(&self, output_tokens: u64, choices: &[Vec<u8>], out: &mut Vec<u8>) {
        if let Self::OpenAi(s) = self {
            s.end(output_tokens, choices, out);
        }
    }

    /// What a finished generation is kept for, where the dialect keeps something (Responses:
    /// the object `previous_response_id` and `GET /v1/responses/{id}` return; an Anthropic
    /// compaction: its summary's text).
    pub fn result(&mut self) -> Option<Vec<u8>> {
        match self {
            Self::Responses(s) => s.take_result(),
            Self::Anthropic(s) => s.take_result(),
            Self::OpenAi(_) => None,
        }
    }

    /// Ends the stream with an error; returns the HTTP status a non-streamed answer gets.
    pub fn error(&mut self, kind: ErrorKind, message: &str, out: &mut Vec<u8>) -> u16 {
        let error = ErrorReply {
            kind,
            message,
            param: None,
            code: None,
        };
        let (dialect, stream) = match self {
            Self::Anthropic(s) => (Dialect::Anthropic, s.is_streaming()),
            Self::OpenAi(s) => (Dialect::OpenAi, s.is_streaming()),
            Self::Responses(s) => {
                s.error(&error, out);
                return Dialect::Responses.error_status(kind);
            }
        };
        dialect.write_error(&error, stream, out);
        dialect.error_status(kind)
    }

    /// False for dialects that carry plain text only (legacy completions).
    pub fn supports_markup(&self) -> bool {
        match self {
            Self::Anthropic(_) | Self::Responses(_) => true,
            Self::OpenAi(s) => s.supports_markup(),
        }
    }
}

/// Appends a deterministic tool-call id: `prefix` and 24 base62 chars hashed from the message id
/// and the call's position, so transcripts are reproducible.
pub fn tool_call_id(prefix: &str, message_id: &str, index: u32, out: &mut String) {
    const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    // FNV-1a over the id, then splitmix64 as a stream of digits.
    let mut state = message_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    out.push_str(prefix);
    for _ in 0..3 {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        for _ in 0..8 {
            out.push(char::from(ALPHABET[(z % 62) as usize]));
            z /= 62;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ErrorKind; 9] = [
        ErrorKind::InvalidRequest,
        ErrorKind::Authentication,
        ErrorKind::Permission,
        ErrorKind::NotFound,
        ErrorKind::RequestTooLarge,
        ErrorKind::RateLimited,
        ErrorKind::Overloaded,
        ErrorKind::Unavailable,
        ErrorKind::Internal,
    ];

    #[test]
    fn dialects_agree_on_every_status_but_overload() {
        for kind in KINDS {
            let (a, o) = (
                Dialect::Anthropic.error_status(kind),
                Dialect::OpenAi.error_status(kind),
            );
            if kind == ErrorKind::Overloaded {
                assert_eq!((a, o), (529, 503));
            } else {
                assert_eq!(a, o, "{kind:?}");
            }
        }
        assert_eq!(
            Dialect::Anthropic.error_status(ErrorKind::Authentication),
            401
        );
    }

    #[test]
    fn tool_call_ids_are_stable_and_distinct() {
        let id = |m: &str, i| {
            let mut out = String::new();
            tool_call_id("toolu_", m, i, &mut out);
            out
        };
        assert_eq!(id("msg_1", 0), id("msg_1", 0));
        assert_ne!(id("msg_1", 0), id("msg_1", 1));
        assert_ne!(id("msg_1", 0), id("msg_2", 0));
        let a = id("msg_1", 0);
        assert_eq!(a.len(), 6 + 24);
        assert!(a[6..].bytes().all(|b| b.is_ascii_alphanumeric()));
    }
}
