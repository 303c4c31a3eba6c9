//! OpenAI Responses: typed SSE events, each with a `sequence_number`, from `response.created` to
//! `response.completed` (or `.incomplete` / `.failed`); or the Response object as one JSON body.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use super::custom_input::CustomInput;
use super::{openai, tool_call_id, ErrorKind, ErrorReply, Finish, PromptUsage};
use crate::sse::write_json;

/// What a Responses stream is opened with.
#[derive(Debug, Clone)]
pub struct ResponsesParams {
    pub model: String,
    pub response_id: String,
    pub created_at: u64,
    pub stream: bool,
    /// The request's settings every Response object repeats (`instructions`, `tools`, `store`,
    /// ...): one JSON object, whose members follow the generated ones.
    pub echo: String,
    /// The model's reasoning goes out as a summary (the request asked for `reasoning.summary`)
    /// instead of as reasoning text.
    pub reasoning_summary: bool,
    /// `include: ["reasoning.encrypted_content"]`: a reasoning item carries its text, encoded,
    /// so that a client that stores nothing can hand it back (`reasoning_from_encrypted`).
    pub encrypted_reasoning: bool,
    /// Functions the request gave inside a namespace: the flat name the model calls each by.
    pub namespaced: Vec<NamespacedTool>,
    /// The request's custom (freeform) tools: a call to one is a `custom_tool_call` whose
    /// `input` is raw text.
    pub custom_tools: Vec<String>,
    /// The generation is a compaction: its text is the summary of the conversation, answered as
    /// one `compaction` item (nothing else is output).
    pub compaction: Option<Compaction>,
}

/// How a compaction is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compaction {
    /// A Response whose output is the `compaction` item (`compaction_trigger` in `/v1/responses`).
    Item,
    /// `/v1/responses/compact`'s `response.compaction` object: these items (a JSON array, the
    /// conversation's user messages) and then the `compaction` item.
    Endpoint { kept: String },
}

/// A function of a `namespace` tool, which the model sees under one flat name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespacedTool {
    pub flat_name: String,
    pub namespace: String,
    pub name: String,
}

const ENCRYPTED_PREFIX: &str = "mlxgate-reasoning-v1.";
const COMPACTION_PREFIX: &str = "mlxgate-compaction-v1.";

/// The `encrypted_content` of a reasoning item: opaque to the client, the reasoning text to us.
pub fn encrypted_reasoning(text: &str, out: &mut String) {
    opaque(ENCRYPTED_PREFIX, text, out);
}

/// The reasoning text an `encrypted_content` of ours carries; None for anything else.
pub fn reasoning_from_encrypted(encrypted: &str) -> Option<String> {
    from_opaque(ENCRYPTED_PREFIX, encrypted)
}

/// The `encrypted_content` of a compaction item: the summary, opaque to the client.
pub fn encrypted_compaction(summary: &str, out: &mut String) {
    opaque(COMPACTION_PREFIX, summary, out);
}

/// The summary a compaction item of ours carries; None for anything else.
pub fn compaction_from_encrypted(encrypted: &str) -> Option<String> {
    from_opaque(COMPACTION_PREFIX, encrypted)
}

/// `text` made opaque to a client, not secret: our prefix, then the text in URL-safe base64 (the
/// API calls the field `encrypted_content`; nothing here is encrypted).
fn opaque(prefix: &str, text: &str, out: &mut String) {
    out.push_str(prefix);
    URL_SAFE_NO_PAD.encode_string(text, out);
}

/// The text `opaque` made into `encrypted`, if it carries our `prefix`.
fn from_opaque(prefix: &str, encrypted: &str) -> Option<String> {
    let payload = encrypted.strip_prefix(prefix)?;
    String::from_utf8(URL_SAFE_NO_PAD.decode(payload).ok()?).ok()
}

#[derive(Debug)]
enum ItemBody {
    Message {
        text: String,
    },
    Reasoning {
        text: String,
    },
    FunctionCall {
        call_id: String,
        name: String,
        namespace: Option<String>,
        arguments: String,
    },
    CustomToolCall {
        call_id: String,
        name: String,
        /// The whole input, once the call ended (what streamed is in `reader`).
        input: String,
        reader: CustomInput,
    },
    Compaction {
        summary: String,
    },
}

#[derive(Debug)]
struct Item {
    id: String,
    body: ItemBody,
    /// `in_progress` while it is written, then `completed` or `incomplete`.
    status: &'static str,
}

/// One stream's event sequence (streaming) and the output it has produced (both modes: the last
/// event carries the whole Response).
#[derive(Debug)]
pub struct ResponsesStream {
    params: ResponsesParams,
    pub(crate) usage: PromptUsage,
    sequence_number: u64,
    output: Vec<Item>,
    /// The last output item is still being written.
    open: bool,
    reasoning_tokens: u64,
    /// The Response object the stream ended with (completed, incomplete or failed).
    result: Option<Vec<u8>>,
}

impl ResponsesStream {
    pub fn new(params: ResponsesParams, usage: PromptUsage) -> Self {
        Self {
            params,
            usage,
            sequence_number: 0,
            output: Vec::new(),
            open: false,
            reasoning_tokens: 0,
            result: None,
        }
    }

    /// The Response object the stream ended with, once it ended (not for a non-streamed error).
    pub fn take_result(&mut self) -> Option<Vec<u8>> {
        self.result.take()
    }

    pub fn is_streaming(&self) -> bool {
        self.params.stream
    }

    pub fn start(&mut self, out: &mut Vec<u8>) {
        if self.params.stream {
            self.in_progress(out, "response.created");
            self.in_progress(out, "response.in_progress");
        }
    }

    /// While the prompt waits or prefills: `response.in_progress` again. An SSE comment would
    /// not do: Codex's idle timer (300 s) counts events, and a long prompt on a CPU takes more.
    pub fn ping(&mut self, out: &mut Vec<u8>) {
        if self.params.stream {
            self.in_progress(out, "response.in_progress");
        }
    }

    fn in_progress(&mut self, out: &mut Vec<u8>, kind: &str) {
        self.event(out, kind, |this, out| {
            out.extend_from_slice(b",\"response\":");
            this.write_response(out, "in_progress", None, None);
        });
    }

    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        if self.params.compaction.is_some() {
            let index = self.compaction_item(out);
            if let ItemBody::Compaction { summary } = &mut self.output[index].body {
                summary.push_str(text);
            }
            return;
        }
        let index = self.enter(Kind::Message, out);
        if let ItemBody::Message { text: body } = &mut self.output[index].body {
            body.push_str(text);
        }
        if self.params.stream {
            self.delta(
                out,
                "response.output_text.delta",
                index,
                b",\"content_index\":0",
                text,
            );
        }
    }

    pub fn thinking(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        self.reasoning_tokens += 1;
        if self.params.compaction.is_some() {
            return; // the summary is the answer's text
        }
        let index = self.enter(Kind::Reasoning, out);
        if let ItemBody::Reasoning { text: body } = &mut self.output[index].body {
            body.push_str(text);
        }
        if self.params.stream {
            if self.params.reasoning_summary {
                let kind = "response.reasoning_summary_text.delta";
                self.delta(out, kind, index, b",\"summary_index\":0", text);
            } else {
                let kind = "response.reasoning_text.delta";
                self.delta(out, kind, index, b",\"content_index\":0", text);
            }
        }
    }

    /// A `function_call` item (a namespaced function goes back under its namespace and name),
    /// or a `custom_tool_call` for a custom tool.
    pub fn tool_start(&mut self, name: &str, out: &mut Vec<u8>) {
        if self.params.compaction.is_some() {
            return; // a summary calls no tool
        }
        self.close(out);
        let custom = self.params.custom_tools.iter().any(|tool| tool == name);
        let prefix = if custom { "ctc_" } else { "fc_" };
        // Hashed from the item's id, so it differs from every item id.
        let mut call_id = String::with_capacity(29);
        let mut item_id = String::with_capacity(28);
        tool_call_id(
            prefix,
            &self.params.response_id,
            self.output.len() as u32,
            &mut item_id,
        );
        tool_call_id("call_", &item_id, 0, &mut call_id);
        let body = if custom {
            ItemBody::CustomToolCall {
                call_id,
                name: name.to_owned(),
                input: String::new(),
                reader: CustomInput::default(),
            }
        } else {
            let (name, namespace) =
                match self.params.namespaced.iter().find(|t| t.flat_name == name) {
                    Some(tool) => (tool.name.clone(), Some(tool.namespace.clone())),
                    None => (name.to_owned(), None),
                };
            ItemBody::FunctionCall {
                call_id,
                name,
                namespace,
                arguments: String::new(),
            }
        };
        self.open_item(prefix, body, out);
    }

    pub fn tool_args(&mut self, fragment: &str, out: &mut Vec<u8>) {
        if fragment.is_empty() || !self.open {
            return;
        }
        let index = self.output.len() - 1;
        let (kind, delta) = match &mut self.output[index].body {
            ItemBody::FunctionCall { arguments, .. } => {
                arguments.push_str(fragment);
                (
                    "response.function_call_arguments.delta",
                    fragment.to_owned(),
                )
            }
            ItemBody::CustomToolCall { reader, .. } => (
                "response.custom_tool_call_input.delta",
                reader.push(fragment),
            ),
            _ => return,
        };
        if self.params.stream && !delta.is_empty() {
            self.delta(out, kind, index, b"", &delta);
        }
    }

    pub fn tool_end(&mut self, out: &mut Vec<u8>) {
        if self.params.compaction.is_none() {
            self.close(out);
        }
    }

    /// The one `compaction` item, opened when the summary begins (or at the end, empty).
    fn compaction_item(&mut self, out: &mut Vec<u8>) -> usize {
        if self.open {
            return self.output.len() - 1;
        }
        let body = ItemBody::Compaction {
            summary: String::new(),
        };
        self.open_item("cmp_", body, out)
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        if self.params.compaction.is_some() {
            self.compaction_item(out);
        }
        let truncated = finish == Finish::MaxTokens;
        if truncated {
            self.cut_short();
        }
        self.close(out);
        let usage = self.usage(output_tokens);
        let (kind, status, incomplete) = if truncated {
            (
                "response.incomplete",
                "incomplete",
                Some("max_output_tokens"),
            )
        } else {
            ("response.completed", "completed", None)
        };
        let mut response = Vec::new();
        self.write_response(
            &mut response,
            status,
            Some(&usage),
            incomplete.map(Ending::Incomplete),
        );
        if self.params.stream {
            self.event(out, kind, |_, out| {
                out.extend_from_slice(b",\"response\":");
                out.extend_from_slice(&response);
            });
        } else {
            out.extend_from_slice(&response);
        }
        self.result = Some(response);
    }

    /// Ends the stream with `response.failed` (streaming) or the error envelope (not).
    pub fn error(&mut self, error: &ErrorReply<'_>, out: &mut Vec<u8>) {
        if !self.params.stream {
            openai::write_error(error, false, out);
            return;
        }
        self.cut_short();
        self.close(out);
        let code = error.code.unwrap_or_else(|| error_code(error.kind));
        let failure = Ending::Failed {
            code,
            message: error.message,
        };
        let mut response = Vec::new();
        self.write_response(&mut response, "failed", None, Some(failure));
        self.event(out, "response.failed", |_, out| {
            out.extend_from_slice(b",\"response\":");
            out.extend_from_slice(&response);
        });
        self.result = Some(response);
    }

    /// The open item ends before the model ended it.
    fn cut_short(&mut self) {
        if let Some(item) = self.output.last_mut().filter(|_| self.open) {
            item.status = "incomplete";
        }
    }

    /// Returns the index of the open item of `kind`, closing another and opening one.
    fn enter(&mut self, kind: Kind, out: &mut Vec<u8>) -> usize {
        if self.open {
            let last = self.output.len() - 1;
            if Kind::of(&self.output[last].body) == Some(kind) {
                return last;
            }
            self.close(out);
        }
        match kind {
            Kind::Message => self.open_item(
                "msg_",
                ItemBody::Message {
                    text: String::new(),
                },
                out,
            ),
            Kind::Reasoning => self.open_item(
                "rs_",
                ItemBody::Reasoning {
                    text: String::new(),
                },
                out,
            ),
        }
    }

    fn open_item(&mut self, prefix: &str, body: ItemBody, out: &mut Vec<u8>) -> usize {
        let index = self.output.len();
        let mut id = String::with_capacity(prefix.len() + 24);
        tool_call_id(prefix, &self.params.response_id, index as u32, &mut id);
        self.output.push(Item {
            id,
            body,
            status: "in_progress",
        });
        self.open = true;
        if !self.params.stream {
            return index;
        }
        self.event(out, "response.output_item.added", |this, out| {
            out.extend_from_slice(b",\"output_index\":");
            write_json(out, &index);
            out.extend_from_slice(b",\"item\":");
            this.write_item(out, index);
        });
        let part = match &self.output[index].body {
            ItemBody::Message { .. } => Some((PartKind::OutputText, "response.content_part.added")),
            ItemBody::Reasoning { .. } if self.params.reasoning_summary => {
                Some((PartKind::Summary, "response.reasoning_summary_part.added"))
            }
            ItemBody::Reasoning { .. } => {
                Some((PartKind::ReasoningText, "response.content_part.added"))
            }
            ItemBody::FunctionCall { .. }
            | ItemBody::CustomToolCall { .. }
            | ItemBody::Compaction { .. } => None,
        };
        if let Some((part, kind)) = part {
            self.part_event(out, kind, index, part, false);
        }
        index
    }

    /// Closes the open item: its `.done` events, then `response.output_item.done`.
    fn close(&mut self, out: &mut Vec<u8>) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let index = self.output.len() - 1;
        let item = &mut self.output[index];
        if item.status == "in_progress" {
            item.status = "completed";
        }
        let mut rest = String::new();
        if let ItemBody::CustomToolCall { input, reader, .. } = &mut item.body {
            (*input, rest) = reader.finish();
        }
        if !self.params.stream {
            return;
        }
        let (part, text_done, part_done) = match &self.output[index].body {
            ItemBody::Message { .. } => (
                PartKind::OutputText,
                "response.output_text.done",
                "response.content_part.done",
            ),
            ItemBody::Reasoning { .. } if self.params.reasoning_summary => (
                PartKind::Summary,
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
            ),
            ItemBody::Reasoning { .. } => (
                PartKind::ReasoningText,
                "response.reasoning_text.done",
                "response.content_part.done",
            ),
            ItemBody::FunctionCall { .. } => {
                self.event(out, "response.function_call_arguments.done", |this, out| {
                    let ItemBody::FunctionCall {
                        name, arguments, ..
                    } = &this.output[index].body
                    else {
                        unreachable!("the item is a function call");
                    };
                    this.item_location(out, index);
                    out.extend_from_slice(b",\"name\":");
                    write_json(out, name);
                    out.extend_from_slice(b",\"arguments\":");
                    write_json(
                        out,
                        if arguments.is_empty() {
                            "{}"
                        } else {
                            arguments
                        },
                    );
                });
                self.item_done(out, index);
                return;
            }
            ItemBody::Compaction { .. } => {
                self.item_done(out, index);
                return;
            }
            ItemBody::CustomToolCall { .. } => {
                if !rest.is_empty() {
                    let kind = "response.custom_tool_call_input.delta";
                    self.delta(out, kind, index, b"", &rest);
                }
                self.event(out, "response.custom_tool_call_input.done", |this, out| {
                    this.item_location(out, index);
                    out.extend_from_slice(b",\"input\":");
                    write_json(out, this.text_of(index));
                });
                self.item_done(out, index);
                return;
            }
        };
        self.event(out, text_done, |this, out| {
            this.part_location(out, index, part);
            out.extend_from_slice(b",\"text\":");
            write_json(out, this.text_of(index));
            if part == PartKind::OutputText {
                out.extend_from_slice(b",\"logprobs\":[]");
            }
        });
        self.part_event(out, part_done, index, part, true);
        self.item_done(out, index);
    }

    /// A part opens (empty) or is done (with the item's text).
    fn part_event(
        &mut self,
        out: &mut Vec<u8>,
        kind: &str,
        index: usize,
        part: PartKind,
        done: bool,
    ) {
        self.event(out, kind, |this, out| {
            this.part_location(out, index, part);
            out.extend_from_slice(b",\"part\":");
            let text = if done { this.text_of(index) } else { "" };
            write_json(out, &Part { kind: part, text });
        });
    }

    fn text_of(&self, index: usize) -> &str {
        match &self.output[index].body {
            ItemBody::Message { text } | ItemBody::Reasoning { text } => text,
            ItemBody::FunctionCall { arguments, .. } => arguments,
            ItemBody::CustomToolCall { input, .. } => input,
            ItemBody::Compaction { summary } => summary,
        }
    }

    fn item_done(&mut self, out: &mut Vec<u8>, index: usize) {
        self.event(out, "response.output_item.done", |this, out| {
            out.extend_from_slice(b",\"output_index\":");
            write_json(out, &index);
            out.extend_from_slice(b",\"item\":");
            this.write_item(out, index);
        });
    }

    /// `,"item_id":…,"output_index":…`
    fn item_location(&self, out: &mut Vec<u8>, index: usize) {
        out.extend_from_slice(b",\"item_id\":");
        write_json(out, &self.output[index].id);
        out.extend_from_slice(b",\"output_index\":");
        write_json(out, &index);
    }

    /// The item's location and the part's: `content_index` or (a summary) `summary_index`.
    fn part_location(&self, out: &mut Vec<u8>, index: usize, part: PartKind) {
        self.item_location(out, index);
        out.extend_from_slice(match part {
            PartKind::Summary => b",\"summary_index\":0",
            PartKind::OutputText | PartKind::ReasoningText => b",\"content_index\":0",
        });
    }

    /// One event: `event: KIND` and `{"type":KIND,` + `fields` + `,"sequence_number":N}`.
    fn event(&mut self, out: &mut Vec<u8>, kind: &str, fields: impl FnOnce(&Self, &mut Vec<u8>)) {
        begin_event(out, kind);
        fields(self, out);
        self.end_event(out);
    }

    /// The per-token frame, written by hand so only the text goes through JSON escaping.
    #[inline]
    fn delta(&mut self, out: &mut Vec<u8>, kind: &str, index: usize, part: &[u8], text: &str) {
        begin_event(out, kind);
        self.item_location(out, index);
        out.extend_from_slice(part);
        out.extend_from_slice(b",\"delta\":");
        write_json(out, text);
        if kind == "response.output_text.delta" {
            out.extend_from_slice(b",\"logprobs\":[]");
        }
        self.end_event(out);
    }

    fn end_event(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(b",\"sequence_number\":");
        write_json(out, &self.sequence_number);
        out.extend_from_slice(b"}\n\n");
        self.sequence_number += 1;
    }

    fn usage(&self, output_tokens: u64) -> Usage {
        Usage {
            input_tokens: self.usage.prompt_tokens,
            input_tokens_details: InputDetails {
                cached_tokens: self.usage.cached_tokens,
            },
            output_tokens,
            output_tokens_details: OutputDetails {
                reasoning_tokens: self.reasoning_tokens.min(output_tokens),
            },
            total_tokens: self.usage.prompt_tokens + output_tokens,
        }
    }

    fn write_item(&self, out: &mut Vec<u8>, index: usize) {
        write_json(
            out,
            &ItemView {
                item: &self.output[index],
                params: &self.params,
            },
        );
    }

    /// The Response object: what was generated, then the request's echoed settings.
    fn write_response(
        &self,
        out: &mut Vec<u8>,
        status: &str,
        usage: Option<&Usage>,
        ending: Option<Ending<'_>>,
    ) {
        if let Some(Compaction::Endpoint { kept }) = &self.params.compaction {
            self.write_compacted(out, kept, usage);
            return;
        }
        let head = ResponseHead {
            id: &self.params.response_id,
            object: "response",
            created_at: self.params.created_at,
            status,
            error: match ending {
                Some(Ending::Failed { code, message }) => Some(ErrorObject { code, message }),
                _ => None,
            },
            incomplete_details: match ending {
                Some(Ending::Incomplete(reason)) => Some(Incomplete { reason }),
                _ => None,
            },
            model: &self.params.model,
            output: OutputView(self),
            usage,
        };
        write_json(out, &head);
        let echo = self.params.echo.trim();
        let members = echo
            .strip_prefix('{')
            .and_then(|e| e.strip_suffix('}'))
            .unwrap_or("")
            .trim();
        if !members.is_empty() {
            out.pop();
            out.push(b',');
            out.extend_from_slice(members.as_bytes());
            out.push(b'}');
        }
    }
}

impl ResponsesStream {
    /// `/v1/responses/compact`'s answer: the kept items, then the compaction item.
    fn write_compacted(&self, out: &mut Vec<u8>, kept: &str, usage: Option<&Usage>) {
        out.extend_from_slice(b"{\"id\":");
        write_json(out, &self.params.response_id);
        out.extend_from_slice(b",\"object\":\"response.compaction\",\"created_at\":");
        write_json(out, &self.params.created_at);
        out.extend_from_slice(b",\"output\":[");
        let kept = kept.trim();
        let kept = kept.strip_prefix('[').and_then(|k| k.strip_suffix(']'));
        let kept = kept.unwrap_or("").trim();
        out.extend_from_slice(kept.as_bytes());
        for index in 0..self.output.len() {
            if index > 0 || !kept.is_empty() {
                out.push(b',');
            }
            self.write_item(out, index);
        }
        out.extend_from_slice(b"],\"usage\":");
        write_json(out, &usage);
        out.push(b'}');
    }
}

/// `event: KIND` and the start of its data: `{"type":"KIND"`.
fn begin_event(out: &mut Vec<u8>, kind: &str) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: {\"type\":\"");
    out.extend_from_slice(kind.as_bytes());
    out.push(b'"');
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Message,
    Reasoning,
}

impl Kind {
    fn of(body: &ItemBody) -> Option<Self> {
        match body {
            ItemBody::Message { .. } => Some(Self::Message),
            ItemBody::Reasoning { .. } => Some(Self::Reasoning),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Ending<'a> {
    Incomplete(&'a str),
    Failed { code: &'a str, message: &'a str },
}

/// The `code` of a failed Response for an error of `kind` (the reply may name a closer one).
pub fn error_code(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::RateLimited => "rate_limit_exceeded",
        ErrorKind::InvalidRequest | ErrorKind::RequestTooLarge => "invalid_prompt",
        _ => "server_error",
    }
}

/// Streaming, with no stream state (the stream failed outside the encoder): an `error` event.
/// Non-streaming: OpenAI's error envelope, as every OpenAI route answers.
pub fn write_error(error: &ErrorReply<'_>, stream: bool, out: &mut Vec<u8>) {
    if !stream {
        openai::write_error(error, false, out);
        return;
    }
    let event = StreamError {
        kind: "error",
        code: error.code.unwrap_or_else(|| error_code(error.kind)),
        message: error.message,
        param: error.param,
        sequence_number: 0,
    };
    crate::sse::write_event(out, "error", &event);
}

/// An error answering a `response.create` message of the WebSocket mode, as one message: the
/// status the HTTP request would have had, and OpenAI's error object.
pub fn write_websocket_error(error: &ErrorReply<'_>, out: &mut Vec<u8>) {
    let message = WebSocketError {
        kind: "error",
        status: openai::error_status(error.kind),
        error: openai::ErrorBody::of(error),
    };
    write_json(out, &message);
}

// Field order below is the wire order of OpenAI's API.

#[derive(Serialize)]
struct WebSocketError<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    status: u16,
    error: openai::ErrorBody<'a>,
}

#[derive(Serialize)]
struct ResponseHead<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'a str,
    error: Option<ErrorObject<'a>>,
    incomplete_details: Option<Incomplete<'a>>,
    model: &'a str,
    output: OutputView<'a>,
    usage: Option<&'a Usage>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    code: &'a str,
    message: &'a str,
}

#[derive(Serialize)]
struct Incomplete<'a> {
    reason: &'a str,
}

#[derive(Serialize)]
struct StreamError<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    code: &'a str,
    message: &'a str,
    param: Option<&'a str>,
    sequence_number: u64,
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    input_tokens_details: InputDetails,
    output_tokens: u64,
    output_tokens_details: OutputDetails,
    total_tokens: u64,
}

#[derive(Serialize)]
struct InputDetails {
    cached_tokens: u64,
}

#[derive(Serialize)]
struct OutputDetails {
    /// Output tokens that produced reasoning text.
    reasoning_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartKind {
    OutputText,
    ReasoningText,
    Summary,
}

struct Part<'a> {
    kind: PartKind,
    text: &'a str,
}

impl Serialize for Part<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        match self.kind {
            PartKind::OutputText => {
                map.serialize_entry("type", "output_text")?;
                map.serialize_entry("annotations", &[(); 0])?;
                map.serialize_entry("logprobs", &[(); 0])?;
            }
            PartKind::ReasoningText => map.serialize_entry("type", "reasoning_text")?,
            PartKind::Summary => map.serialize_entry("type", "summary_text")?,
        }
        map.serialize_entry("text", self.text)?;
        map.end()
    }
}

struct OutputView<'a>(&'a ResponsesStream);

impl Serialize for OutputView<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.output.iter().map(|item| ItemView {
            item,
            params: &self.0.params,
        }))
    }
}

/// An output item as the API shows it (in `output_item.added/done` and in the Response).
struct ItemView<'a> {
    item: &'a Item,
    params: &'a ResponsesParams,
}

impl Serialize for ItemView<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Item { id, body, status } = self.item;
        let done = *status != "in_progress";
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("id", id)?;
        match body {
            ItemBody::Message { text } => {
                map.serialize_entry("type", "message")?;
                map.serialize_entry("status", status)?;
                map.serialize_entry("role", "assistant")?;
                let part = done.then_some(Part {
                    kind: PartKind::OutputText,
                    text,
                });
                map.serialize_entry("content", part.as_slice())?;
            }
            ItemBody::Reasoning { text } => {
                map.serialize_entry("type", "reasoning")?;
                let (summary, content) = if !done {
                    (None, None)
                } else if self.params.reasoning_summary {
                    (Some(PartKind::Summary), None)
                } else {
                    (None, Some(PartKind::ReasoningText))
                };
                let part = |kind: Option<PartKind>| kind.map(|kind| Part { kind, text });
                map.serialize_entry("summary", &part(summary).as_slice())?;
                if !self.params.reasoning_summary {
                    map.serialize_entry("content", &part(content).as_slice())?;
                }
                if done && self.params.encrypted_reasoning {
                    let mut encrypted = String::new();
                    encrypted_reasoning(text, &mut encrypted);
                    map.serialize_entry("encrypted_content", &encrypted)?;
                }
            }
            ItemBody::FunctionCall {
                call_id,
                name,
                namespace,
                arguments,
            } => {
                map.serialize_entry("type", "function_call")?;
                map.serialize_entry("status", status)?;
                // The arguments as the model wrote them: what the deltas add up to.
                let arguments = match arguments.as_str() {
                    "" if done => "{}",
                    _ if !done => "",
                    written => written,
                };
                map.serialize_entry("arguments", arguments)?;
                map.serialize_entry("call_id", call_id)?;
                map.serialize_entry("name", name)?;
                if let Some(namespace) = namespace {
                    map.serialize_entry("namespace", namespace)?;
                }
            }
            ItemBody::CustomToolCall {
                call_id,
                name,
                input,
                ..
            } => {
                map.serialize_entry("type", "custom_tool_call")?;
                map.serialize_entry("status", status)?;
                map.serialize_entry("call_id", call_id)?;
                map.serialize_entry("name", name)?;
                map.serialize_entry("input", if done { input.as_str() } else { "" })?;
            }
            ItemBody::Compaction { summary } => {
                map.serialize_entry("type", "compaction")?;
                let mut encrypted = String::new();
                if done {
                    encrypted_compaction(summary, &mut encrypted);
                }
                map.serialize_entry("encrypted_content", &encrypted)?;
            }
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Protocol;

    fn stream(stream: bool, namespaced: Vec<NamespacedTool>) -> ResponsesStream {
        let params = ResponsesParams {
            model: "m".into(),
            response_id: "resp_1".into(),
            created_at: 1,
            stream,
            echo: r#"{"store":false}"#.into(),
            reasoning_summary: false,
            encrypted_reasoning: true,
            namespaced,
            custom_tools: vec!["apply_patch".into()],
            compaction: None,
        };
        let usage = PromptUsage {
            prompt_tokens: 10,
            cached_tokens: 4,
        };
        ResponsesStream::new(params, usage)
    }

    fn events(out: &[u8]) -> Vec<serde_json::Value> {
        let text = std::str::from_utf8(out).unwrap();
        text.split_terminator("\n\n")
            .map(|frame| {
                let (event, data) = frame.split_once('\n').unwrap();
                let data: serde_json::Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(event.strip_prefix("event: ").unwrap(), data["type"]);
                data
            })
            .collect()
    }

    #[test]
    fn encrypted_reasoning_round_trips_and_refuses_foreign_text() {
        let mut encrypted = String::new();
        encrypted_reasoning("I think \"so\" ✓\n", &mut encrypted);
        assert_eq!(
            reasoning_from_encrypted(&encrypted).as_deref(),
            Some("I think \"so\" ✓\n")
        );
        assert_eq!(reasoning_from_encrypted("gAAAAABo-openai-blob"), None);
        assert_eq!(reasoning_from_encrypted("mlxgate-reasoning-v1.%%"), None);
    }

    #[test]
    fn items_follow_the_models_order_and_sequence_numbers_count_up() {
        let mut s = stream(true, Vec::new());
        let mut out = Vec::new();
        s.start(&mut out);
        s.ping(&mut out);
        s.text("Let me look.", &mut out);
        s.tool_start("ls", &mut out);
        s.tool_end(&mut out);
        s.thinking("done?", &mut out);
        s.text("Done.", &mut out);
        s.finish(Finish::EndTurn, 7, &mut out);
        let events = events(&out);
        for (i, event) in events.iter().enumerate() {
            assert_eq!(event["sequence_number"], i);
        }
        assert_eq!(events[2]["type"], "response.in_progress", "a ping");
        let response = &events.last().unwrap()["response"];
        let kinds: Vec<&str> = response["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["type"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["message", "function_call", "reasoning", "message"]);
        assert_eq!(response["output"][1]["arguments"], "{}");
        assert_eq!(
            response["usage"]["input_tokens_details"]["cached_tokens"],
            4
        );
        assert_eq!(response["store"], false);
    }

    #[test]
    fn a_namespaced_call_goes_out_under_its_namespace() {
        let tool = NamespacedTool {
            flat_name: "mcp__files__read".into(),
            namespace: "mcp__files".into(),
            name: "read".into(),
        };
        let mut s = stream(false, vec![tool]);
        let mut out = Vec::new();
        s.tool_start("mcp__files__read", &mut out);
        s.tool_args("{\"path\": \"a\"}", &mut out);
        s.tool_end(&mut out);
        s.finish(Finish::ToolUse, 3, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let call = &body["output"][0];
        assert_eq!(
            (&call["name"], &call["namespace"]),
            (&"read".into(), &"mcp__files".into())
        );
        assert_eq!(call["arguments"], "{\"path\": \"a\"}");
    }

    #[test]
    fn a_custom_tool_call_streams_its_input_as_raw_text() {
        let mut s = stream(true, Vec::new());
        let mut out = Vec::new();
        s.tool_start("apply_patch", &mut out);
        s.tool_args("{\"input\": \"*** Begin", &mut out);
        s.tool_args(" Patch\\n\"}", &mut out);
        s.tool_end(&mut out);
        s.finish(Finish::ToolUse, 3, &mut out);
        let events = events(&out);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        assert_eq!(events[0]["item"]["type"], "custom_tool_call");
        assert_eq!(events[2]["delta"], " Patch\n");
        assert_eq!(events[3]["input"], "*** Begin Patch\n");
        let call = &events[5]["response"]["output"][0];
        assert_eq!(call["input"], "*** Begin Patch\n");
        assert_eq!(call["name"], "apply_patch");
        assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
        assert!(call["id"].as_str().unwrap().starts_with("ctc_"));
    }

    #[test]
    fn a_compaction_answers_with_one_item_carrying_the_summary() {
        let mut s = stream(true, Vec::new());
        s.params.compaction = Some(Compaction::Item);
        let mut out = Vec::new();
        s.thinking("let me see", &mut out);
        s.text("The user ", &mut out);
        s.tool_start("ls", &mut out);
        s.tool_end(&mut out);
        s.text("said hi.", &mut out);
        s.finish(Finish::EndTurn, 5, &mut out);
        let response = &events(&out).pop().unwrap()["response"];
        let output = response["output"].as_array().unwrap();
        assert_eq!(output.len(), 1);
        assert_eq!(output[0]["type"], "compaction");
        let encrypted = output[0]["encrypted_content"].as_str().unwrap();
        assert_eq!(
            compaction_from_encrypted(encrypted).as_deref(),
            Some("The user said hi.")
        );

        let mut s = stream(false, Vec::new());
        s.params.compaction = Some(Compaction::Endpoint {
            kept: r#"[{"type":"message","role":"user","content":"hi"}]"#.into(),
        });
        let mut out = Vec::new();
        s.finish(Finish::EndTurn, 0, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(body["object"], "response.compaction");
        let kinds: Vec<&str> = body["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            ["message", "compaction"],
            "an empty summary is still one item"
        );
    }

    #[test]
    fn a_failure_marks_the_open_item_incomplete_or_answers_openais_envelope() {
        let mut s = Protocol::Responses(Box::new(stream(true, Vec::new())));
        let mut out = Vec::new();
        s.text("partial", &mut out);
        assert_eq!(s.error(ErrorKind::Internal, "boom", &mut out), 500);
        let last = events(&out).pop().unwrap();
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["error"]["code"], "server_error");
        assert_eq!(last["response"]["output"][0]["status"], "incomplete");

        let mut s = Protocol::Responses(Box::new(stream(false, Vec::new())));
        let mut out = Vec::new();
        assert_eq!(s.error(ErrorKind::Overloaded, "busy", &mut out), 503);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(body["error"]["type"], "server_error");
    }

    #[test]
    fn a_websocket_error_carries_its_status_and_openais_error_object() {
        let error = ErrorReply {
            kind: ErrorKind::InvalidRequest,
            message: "input: field required",
            param: Some("input"),
            code: None,
        };
        let mut out = Vec::new();
        write_websocket_error(&error, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"type":"error","status":400,"error":{"message":"input: field required","type":"invalid_request_error","param":"input","code":null}}"#
        );
    }

    #[test]
    fn an_empty_response_opens_and_completes_with_no_output() {
        let params = crate::events::DialectParams::Responses(stream(true, Vec::new()).params);
        let mut out = Vec::new();
        let result = params.empty_response(&mut out).unwrap();
        let events = events(&out);
        let kinds: Vec<_> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.completed"
            ]
        );
        let completed = &events[2]["response"];
        assert_eq!(completed["status"], "completed");
        assert_eq!(completed["output"], serde_json::json!([]));
        assert_eq!(completed["usage"]["input_tokens"], 0);
        assert_eq!(completed["usage"]["total_tokens"], 0);
        let result: serde_json::Value = serde_json::from_slice(&result).unwrap();
        assert_eq!(&result, completed);
    }
}
