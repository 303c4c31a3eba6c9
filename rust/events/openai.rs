//! OpenAI Chat Completions and legacy Completions: data-only SSE chunks ending in `[DONE]`, or one JSON body.

use std::str::FromStr;

use serde::Serialize;
use serde_json::value::RawValue;

use super::custom_input::CustomInput;
use super::{tool_call_id, ErrorKind, ErrorReply, Finish, PromptUsage, TokenLogprob};
use crate::error::CoreError;
use crate::jsonscan::minify;
use crate::sse::write_json;

/// Which endpoint the stream answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// `/v1/chat/completions`: `chat.completion(.chunk)` objects.
    Chat,
    /// `/v1/completions`: `text_completion` objects; plain text only (markup is not parsed).
    Completion,
}

impl FromStr for CompletionKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "chat" => Ok(Self::Chat),
            "completion" => Ok(Self::Completion),
            _ => Err(CoreError::UnknownCompletionKind(s.to_owned())),
        }
    }
}

/// What follows a call's index in a chunk that adds to its arguments, or to a custom call's input.
const FUNCTION_ARGUMENTS: &[u8] = b",\"function\":{\"arguments\":";
const CUSTOM_INPUT: &[u8] = b",\"custom\":{\"input\":";

/// What an OpenAI stream is opened with.
#[derive(Debug, Clone)]
pub struct OpenAiParams {
    pub model: String,
    pub completion_id: String,
    pub created: u64,
    pub stream: bool,
    /// `stream_options.include_usage`: every chunk carries `"usage":null` and a last chunk with
    /// empty `choices` carries the usage.
    pub include_usage: bool,
    pub kind: CompletionKind,
    /// The request's custom (freeform) tools: a call to one is a `custom` tool call whose
    /// `input` is raw text.
    pub custom_tools: Vec<String>,
}

/// One stream's chunk framing (streaming) or its assembled message (not).
#[derive(Debug)]
pub struct OpenAiStream {
    params: OpenAiParams,
    pub(crate) usage: PromptUsage,
    /// This stream's choice: `n` > 1 writes one stream per choice into one response.
    choice_index: u32,
    /// `data: {"id":…,"object":…,"created":…,"model":…,` shared by every chunk.
    head: Vec<u8>,
    tool_calls: u32,
    /// The open call's input, when it is a custom tool's.
    custom_input: Option<CustomInput>,
    /// Non-streaming only: the message so far.
    content: String,
    reasoning: String,
    calls: Vec<ToolCall>,
    /// Token log-probabilities not yet written (streaming: since the last chunk; else all).
    logprobs: Vec<TokenLogprob>,
    /// Completions: the characters of text before the next token in `logprobs`.
    text_offset: u64,
}

impl OpenAiStream {
    pub fn new(params: OpenAiParams, usage: PromptUsage, choice_index: u32) -> Self {
        let mut head = Vec::new();
        if params.stream {
            head.extend_from_slice(b"data: {\"id\":");
            write_json(&mut head, &params.completion_id);
            head.extend_from_slice(b",\"object\":\"");
            head.extend_from_slice(match params.kind {
                CompletionKind::Chat => b"chat.completion.chunk".as_slice(),
                CompletionKind::Completion => b"text_completion".as_slice(),
            });
            head.extend_from_slice(b"\",\"created\":");
            write_json(&mut head, &params.created);
            head.extend_from_slice(b",\"model\":");
            write_json(&mut head, &params.model);
            head.push(b',');
        }
        Self {
            params,
            usage,
            choice_index,
            head,
            tool_calls: 0,
            custom_input: None,
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            logprobs: Vec::new(),
            text_offset: 0,
        }
    }

    pub fn logprob(&mut self, entry: TokenLogprob) {
        self.logprobs.push(entry);
    }

    /// The `logprobs` of a choice for the tokens in `self.logprobs` (then emptied): chat's
    /// `{"content": [...]}`, or the legacy Completions object of parallel lists.
    fn write_logprobs(&mut self, out: &mut Vec<u8>) {
        if self.logprobs.is_empty() {
            out.extend_from_slice(b"null");
            return;
        }
        match self.params.kind {
            CompletionKind::Chat => write_json(
                out,
                &ChatLogprobs {
                    content: &self.logprobs,
                },
            ),
            CompletionKind::Completion => {
                let mut offsets = Vec::with_capacity(self.logprobs.len());
                for entry in &self.logprobs {
                    offsets.push(self.text_offset);
                    self.text_offset += entry.token.chars().count() as u64;
                }
                let top: Vec<serde_json::Map<String, serde_json::Value>> = self
                    .logprobs
                    .iter()
                    .map(|entry| {
                        entry
                            .top_logprobs
                            .iter()
                            .map(|alt| (alt.token.clone(), alt.logprob.into()))
                            .collect()
                    })
                    .collect();
                let tokens: Vec<&str> = self.logprobs.iter().map(|e| e.token.as_str()).collect();
                let logprobs: Vec<f32> = self.logprobs.iter().map(|e| e.logprob).collect();
                write_json(
                    out,
                    &CompletionLogprobs {
                        tokens: &tokens,
                        token_logprobs: &logprobs,
                        top_logprobs: &top,
                        text_offset: &offsets,
                    },
                );
            }
        }
        self.logprobs.clear();
    }

    pub fn is_streaming(&self) -> bool {
        self.params.stream
    }

    pub fn supports_markup(&self) -> bool {
        self.params.kind == CompletionKind::Chat
    }

    pub fn start(&mut self, out: &mut Vec<u8>) {
        if self.params.stream && self.params.kind == CompletionKind::Chat {
            self.chunk(out, None, |out| {
                out.extend_from_slice(b"{\"role\":\"assistant\",\"content\":\"\"}");
            });
        }
    }

    /// While the prompt waits or prefills: an empty chunk (`"delta":{}`, `"text":""`), which every
    /// OpenAI client reads as a chunk with nothing in it. Not an SSE comment: a decoder that keeps
    /// the last event id (the openai SDK's, httpx-sse's) dispatches the blank line after a
    /// comment as an event with empty data, and the SDK fails to parse that as JSON.
    pub fn ping(&mut self, out: &mut Vec<u8>) {
        if self.params.stream {
            let empty = self.empty_body();
            self.chunk(out, None, |out| out.extend_from_slice(empty));
        }
    }

    /// A chunk's `delta` (chat) or `text` (completion) with nothing in it.
    fn empty_body(&self) -> &'static [u8] {
        match self.params.kind {
            CompletionKind::Chat => b"{}",
            CompletionKind::Completion => b"\"\"",
        }
    }

    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        if !self.params.stream {
            self.content.push_str(text);
            return;
        }
        match self.params.kind {
            CompletionKind::Chat => self.chunk(out, None, |out| {
                out.extend_from_slice(b"{\"content\":");
                write_json(out, text);
                out.push(b'}');
            }),
            CompletionKind::Completion => self.chunk(out, None, |out| write_json(out, text)),
        }
    }

    /// `reasoning_content`, as vLLM, SGLang and DeepSeek name it.
    pub fn thinking(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() || !self.supports_markup() {
            return;
        }
        if !self.params.stream {
            self.reasoning.push_str(text);
            return;
        }
        self.chunk(out, None, |out| {
            out.extend_from_slice(b"{\"reasoning_content\":");
            write_json(out, text);
            out.push(b'}');
        });
    }

    pub fn tool_start(&mut self, name: &str, out: &mut Vec<u8>) {
        if !self.supports_markup() {
            return;
        }
        let index = self.tool_calls;
        self.tool_calls += 1;
        let mut id = String::with_capacity(29);
        let call = (self.choice_index << 16) | index; // distinct across choices too
        tool_call_id("call_", &self.params.completion_id, call, &mut id);
        let custom = self.params.custom_tools.iter().any(|tool| tool == name);
        self.custom_input = custom.then(CustomInput::default);
        let kind = if custom { "custom" } else { "function" };
        if !self.params.stream {
            self.calls.push(ToolCall {
                id,
                kind,
                name: name.to_owned(),
                arguments: String::new(),
            });
            return;
        }
        self.chunk(out, None, |out| {
            out.extend_from_slice(b"{\"tool_calls\":[{\"index\":");
            write_json(out, &index);
            out.extend_from_slice(b",\"id\":");
            write_json(out, &id);
            out.extend_from_slice(b",\"type\":");
            write_json(out, kind);
            out.extend_from_slice(b",\"");
            out.extend_from_slice(kind.as_bytes());
            out.extend_from_slice(b"\":{\"name\":");
            write_json(out, name);
            out.extend_from_slice(if custom {
                b",\"input\":\"\"}}]}".as_slice()
            } else {
                b",\"arguments\":\"\"}}]}".as_slice()
            });
        });
    }

    pub fn tool_args(&mut self, fragment: &str, out: &mut Vec<u8>) {
        if fragment.is_empty() || self.tool_calls == 0 {
            return;
        }
        let input = self
            .custom_input
            .as_mut()
            .map(|reader| reader.push(fragment));
        if !self.params.stream {
            // A custom call's input is set whole when it ends.
            if let (None, Some(call)) = (&input, self.calls.last_mut()) {
                call.arguments.push_str(fragment);
            }
            return;
        }
        match input {
            Some(text) => self.call_delta(CUSTOM_INPUT, &text, out),
            None => self.call_delta(FUNCTION_ARGUMENTS, fragment, out),
        }
    }

    /// A chunk that adds `text` to the open call: `{"tool_calls":[{"index":N,` + `field` + text.
    fn call_delta(&mut self, field: &[u8], text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        let index = self.tool_calls - 1;
        self.chunk(out, None, |out| {
            out.extend_from_slice(b"{\"tool_calls\":[{\"index\":");
            write_json(out, &index);
            out.extend_from_slice(field);
            write_json(out, text);
            out.extend_from_slice(b"}}]}");
        });
    }

    /// A custom call ends: its input whole (not streamed), or what did not stream yet.
    pub fn tool_end(&mut self, out: &mut Vec<u8>) {
        let Some(reader) = self.custom_input.take() else {
            return;
        };
        let (whole, rest) = reader.finish();
        if !self.params.stream {
            if let Some(call) = self.calls.last_mut() {
                call.arguments = whole;
            }
            return;
        }
        self.call_delta(CUSTOM_INPUT, &rest, out);
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        let mut choice = Vec::new();
        self.finish_choice(finish, out, &mut choice);
        self.end(output_tokens, &[choice], out);
    }

    /// This choice's end: streamed, its last chunk (into `out`); not, its choice object (into
    /// `choice`), for [`OpenAiStream::end`] to write with the others.
    pub fn finish_choice(&mut self, finish: Finish<'_>, out: &mut Vec<u8>, choice: &mut Vec<u8>) {
        let finish_reason = match finish {
            Finish::EndTurn | Finish::StopSequence(_) => "stop",
            Finish::MaxTokens | Finish::Repetition => "length",
            Finish::ToolUse => "tool_calls",
        };
        if self.params.stream {
            let empty = self.empty_body();
            self.chunk(out, Some(finish_reason), |out| out.extend_from_slice(empty));
            return;
        }
        let mut logprobs = Vec::new();
        self.write_logprobs(&mut logprobs);
        let logprobs = RawValue::from_string(String::from_utf8(logprobs).expect("JSON is UTF-8"))
            .expect("write_logprobs writes JSON");
        match self.params.kind {
            CompletionKind::Chat => {
                for call in self.calls.iter_mut().filter(|call| call.kind == "function") {
                    let mut compact = String::with_capacity(call.arguments.len());
                    minify(&call.arguments, &mut compact);
                    call.arguments = compact;
                }
                let no_content = self.content.is_empty() && !self.calls.is_empty();
                let chat = Choice::Chat {
                    index: self.choice_index,
                    message: Message {
                        role: "assistant",
                        content: (!no_content).then_some(self.content.as_str()),
                        tool_calls: &self.calls,
                        reasoning_content: (!self.reasoning.is_empty())
                            .then_some(self.reasoning.as_str()),
                    },
                    logprobs: &logprobs,
                    finish_reason,
                };
                write_json(choice, &chat);
            }
            CompletionKind::Completion => {
                let completion = Choice::Completion {
                    text: &self.content,
                    index: self.choice_index,
                    logprobs: &logprobs,
                    finish_reason,
                };
                write_json(choice, &completion);
            }
        }
    }

    /// The response's end once every choice finished, `completion_tokens` their tokens:
    /// streamed, the usage chunk (if asked for) and `[DONE]`; not, the body with `choices` (the
    /// choice objects, in order) and the usage (the prompt counted once).
    pub fn end(&self, completion_tokens: u64, choices: &[Vec<u8>], out: &mut Vec<u8>) {
        let usage = Usage {
            prompt_tokens: self.usage.prompt_tokens,
            completion_tokens,
            total_tokens: self.usage.prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: self.usage.cached_tokens,
            },
        };
        if self.params.stream {
            if self.params.include_usage {
                out.extend_from_slice(&self.head);
                out.extend_from_slice(b"\"choices\":[],\"usage\":");
                write_json(out, &usage);
                out.extend_from_slice(b"}\n\n");
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
            return;
        }
        out.extend_from_slice(b"{\"id\":");
        write_json(out, &self.params.completion_id);
        out.extend_from_slice(match self.params.kind {
            CompletionKind::Chat => b",\"object\":\"chat.completion\",\"created\":".as_slice(),
            CompletionKind::Completion => b",\"object\":\"text_completion\",\"created\":",
        });
        write_json(out, &self.params.created);
        out.extend_from_slice(b",\"model\":");
        write_json(out, &self.params.model);
        out.extend_from_slice(b",\"choices\":[");
        for (i, choice) in choices.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(choice);
        }
        out.extend_from_slice(b"],\"usage\":");
        write_json(out, &usage);
        out.push(b'}');
    }

    /// One chunk with one choice: `delta` (chat) or `text` (completion) is what `body` writes;
    /// the token log-probabilities since the last chunk go with it.
    fn chunk(
        &mut self,
        out: &mut Vec<u8>,
        finish_reason: Option<&str>,
        body: impl FnOnce(&mut Vec<u8>),
    ) {
        out.extend_from_slice(&self.head);
        match self.params.kind {
            CompletionKind::Chat => {
                out.extend_from_slice(b"\"choices\":[{\"index\":");
                write_json(out, &self.choice_index);
                out.extend_from_slice(b",\"delta\":");
                body(out);
            }
            CompletionKind::Completion => {
                out.extend_from_slice(b"\"choices\":[{\"text\":");
                body(out);
                out.extend_from_slice(b",\"index\":");
                write_json(out, &self.choice_index);
            }
        }
        out.extend_from_slice(b",\"logprobs\":");
        self.write_logprobs(out);
        out.extend_from_slice(b",\"finish_reason\":");
        match finish_reason {
            Some(reason) => {
                out.push(b'"');
                out.extend_from_slice(reason.as_bytes());
                out.push(b'"');
            }
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b"}]");
        if self.params.include_usage {
            out.extend_from_slice(b",\"usage\":null");
        }
        out.extend_from_slice(b"}\n\n");
    }
}

/// OpenAI's error type for each kind: client errors are `invalid_request_error` (a wrong key
/// too, with code `invalid_api_key`, as OpenAI answers), anything server-side `server_error`.
pub fn error_type(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidRequest
        | ErrorKind::Authentication
        | ErrorKind::Permission
        | ErrorKind::NotFound
        | ErrorKind::RequestTooLarge => "invalid_request_error",
        ErrorKind::RateLimited => "rate_limit_error",
        ErrorKind::Overloaded | ErrorKind::Unavailable | ErrorKind::Internal => "server_error",
    }
}

/// The status OpenAI's clients act on: the plain HTTP one (503 is their "overloaded, retry").
pub fn error_status(kind: ErrorKind) -> u16 {
    kind.http_status()
}

/// Streaming: an error chunk, then `[DONE]`. Non-streaming: the error envelope as the body.
pub fn write_error(error: &ErrorReply<'_>, stream: bool, out: &mut Vec<u8>) {
    let body = ErrorEnvelope {
        error: ErrorBody::of(error),
    };
    if stream {
        out.extend_from_slice(b"data: ");
        write_json(out, &body);
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    } else {
        write_json(out, &body);
    }
}

// Field order below is the wire order of OpenAI's API.

#[derive(Serialize)]
#[serde(untagged)]
enum Choice<'a> {
    Chat {
        index: u32,
        message: Message<'a>,
        logprobs: &'a RawValue,
        finish_reason: &'a str,
    },
    Completion {
        text: &'a str,
        index: u32,
        logprobs: &'a RawValue,
        finish_reason: &'a str,
    },
}

#[derive(Serialize)]
struct ChatLogprobs<'a> {
    content: &'a [TokenLogprob],
}

/// The legacy Completions shape: parallel lists, alternatives as `{token: logprob}`.
#[derive(Serialize)]
struct CompletionLogprobs<'a> {
    tokens: &'a [&'a str],
    token_logprobs: &'a [f32],
    top_logprobs: &'a [serde_json::Map<String, serde_json::Value>],
    text_offset: &'a [u64],
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [ToolCall],
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

/// A call of the message: `{"id", "type": "function", "function": {"name", "arguments"}}`, or
/// for a custom tool `{"id", "type": "custom", "custom": {"name", "input"}}`.
#[derive(Debug)]
struct ToolCall {
    id: String,
    kind: &'static str,
    name: String,
    /// A function's arguments (a JSON object as a string, as OpenAI sends it), or a custom
    /// tool's input.
    arguments: String,
}

impl Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(3))?;
        map.serialize_entry("id", &self.id)?;
        map.serialize_entry("type", self.kind)?;
        map.serialize_entry(self.kind, &Called(self))?;
        map.end()
    }
}

/// The `function` or `custom` object of a call.
struct Called<'a>(&'a ToolCall);

impl Serialize for Called<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let call = self.0;
        let mut map = serializer.serialize_map(Some(2))?;
        map.serialize_entry("name", &call.name)?;
        let key = if call.kind == "custom" {
            "input"
        } else {
            "arguments"
        };
        map.serialize_entry(key, &call.arguments)?;
        map.end()
    }
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: PromptDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: u64,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
}

/// The `error` member of OpenAI's error envelope.
#[derive(Serialize)]
pub struct ErrorBody<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl<'a> ErrorBody<'a> {
    pub fn of(error: &ErrorReply<'a>) -> Self {
        Self {
            message: error.message,
            kind: error_type(error.kind),
            param: error.param,
            code: error.code,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Protocol;

    fn params(stream: bool, include_usage: bool, kind: CompletionKind) -> OpenAiParams {
        OpenAiParams {
            model: "smol".into(),
            completion_id: "chatcmpl-1".into(),
            created: 1_700_000_000,
            stream,
            include_usage,
            kind,
            custom_tools: vec!["apply_patch".into()],
        }
    }

    fn stream(stream: bool, include_usage: bool, kind: CompletionKind) -> OpenAiStream {
        let usage = PromptUsage {
            prompt_tokens: 5,
            cached_tokens: 2,
        };
        OpenAiStream::new(params(stream, include_usage, kind), usage, 0)
    }

    fn frames(out: &[u8]) -> Vec<serde_json::Value> {
        let text = std::str::from_utf8(out).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        text.split_terminator("\n\n")
            .filter(|f| *f != "data: [DONE]")
            .map(|f| serde_json::from_str(f.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    #[test]
    fn pings_are_empty_chunks_not_comments() {
        for (kind, include_usage) in [
            (CompletionKind::Chat, false),
            (CompletionKind::Chat, true),
            (CompletionKind::Completion, false),
        ] {
            let mut s = stream(true, include_usage, kind);
            let mut out = Vec::new();
            s.ping(&mut out);
            s.finish(Finish::EndTurn, 0, &mut out);
            let ping = &frames(&out)[0];
            let choice = &ping["choices"][0];
            match kind {
                CompletionKind::Chat => assert_eq!(choice["delta"], serde_json::json!({})),
                CompletionKind::Completion => assert_eq!(choice["text"], ""),
            }
            assert_eq!(choice["finish_reason"], serde_json::Value::Null);
            assert_eq!(ping.get("usage").is_some(), include_usage, "{ping}");
        }
        let mut whole = stream(false, false, CompletionKind::Chat);
        let mut out = Vec::new();
        whole.ping(&mut out);
        assert!(out.is_empty(), "no keep-alive in a JSON body");
    }

    #[test]
    fn chat_stream_with_usage() {
        let mut s = stream(true, true, CompletionKind::Chat);
        let mut out = Vec::new();
        s.start(&mut out);
        s.text("Hi \"x\"", &mut out);
        s.finish(Finish::MaxTokens, 3, &mut out);
        let f = frames(&out);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(f[1]["choices"][0]["delta"]["content"], "Hi \"x\"");
        assert!(f[..3]
            .iter()
            .all(|c| c["usage"].is_null() && c.get("usage").is_some()));
        assert_eq!(f[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(f[3]["choices"], serde_json::json!([]));
        assert_eq!(f[3]["usage"]["total_tokens"], 8);
        assert_eq!(f[3]["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    }

    #[test]
    fn chat_nonstream_tool_calls_and_reasoning() {
        let mut s = stream(false, false, CompletionKind::Chat);
        let mut out = Vec::new();
        s.start(&mut out);
        s.thinking("hmm", &mut out);
        s.tool_start("f", &mut out);
        s.tool_args("{\"a\": ", &mut out);
        s.tool_args("\"b c\"}", &mut out);
        s.tool_end(&mut out);
        assert!(out.is_empty());
        s.finish(Finish::ToolUse, 4, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let message = &body["choices"][0]["message"];
        assert!(message["content"].is_null());
        assert_eq!(message["reasoning_content"], "hmm");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            "{\"a\":\"b c\"}"
        );
        assert!(message["tool_calls"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("call_"));
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn a_custom_tool_call_carries_raw_input_streamed_or_not() {
        let call = |s: &mut OpenAiStream, out: &mut Vec<u8>| {
            s.tool_start("apply_patch", out);
            s.tool_args("{\"input\": \"a\\nb", out);
            s.tool_args("\"}", out);
            s.tool_end(out);
            s.finish(Finish::ToolUse, 4, out);
        };
        let mut s = stream(false, false, CompletionKind::Chat);
        let mut out = Vec::new();
        call(&mut s, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let tool_call = &body["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(tool_call["type"], "custom");
        assert_eq!(tool_call["custom"]["name"], "apply_patch");
        assert_eq!(tool_call["custom"]["input"], "a\nb");

        let mut s = stream(true, false, CompletionKind::Chat);
        let mut out = Vec::new();
        call(&mut s, &mut out);
        let deltas: Vec<serde_json::Value> = frames(&out)
            .iter()
            .filter_map(|f| f["choices"][0]["delta"]["tool_calls"].get(0).cloned())
            .collect();
        assert_eq!(deltas[0]["type"], "custom");
        let input: String = deltas
            .iter()
            .map(|d| d["custom"]["input"].as_str().unwrap())
            .collect();
        assert_eq!(input, "a\nb");
    }

    #[test]
    fn errors_map_types() {
        let mut s = Protocol::OpenAi(Box::new(stream(false, false, CompletionKind::Chat)));
        let mut out = Vec::new();
        assert_eq!(s.error(ErrorKind::Overloaded, "Overloaded", &mut out), 503);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "{\"error\":{\"message\":\"Overloaded\",\"type\":\"server_error\",\"param\":null,\"code\":null}}"
        );
        assert_eq!(
            error_type(ErrorKind::Authentication),
            "invalid_request_error"
        );
        assert_eq!(error_type(ErrorKind::Internal), "server_error");
        let mut out = Vec::new();
        let key = ErrorReply {
            kind: ErrorKind::Authentication,
            message: "bad key",
            param: None,
            code: Some("invalid_api_key"),
        };
        write_error(&key, true, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "data: {\"error\":{\"message\":\"bad key\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":\"invalid_api_key\"}}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn completion_ignores_markup_pieces() {
        let mut s = stream(true, false, CompletionKind::Completion);
        let mut out = Vec::new();
        s.start(&mut out);
        assert!(out.is_empty(), "no role chunk for completions");
        s.thinking("x", &mut out);
        s.tool_start("f", &mut out);
        s.tool_args("{}", &mut out);
        assert!(out.is_empty());
        s.text("ab", &mut out);
        s.finish(Finish::EndTurn, 1, &mut out);
        let f = frames(&out);
        assert_eq!(f[0]["choices"][0]["text"], "ab");
        assert_eq!(f[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(f[1]["object"], "text_completion");
    }
}
