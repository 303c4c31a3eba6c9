//! Anthropic Messages: streaming event sequence and the non-streaming Message body.

use std::sync::Arc;

use serde::{Serialize, Serializer};

use super::tool_search::ToolSearch;
use super::{tool_call_id, ErrorKind, ErrorReply, Finish, PromptUsage};
use crate::jsonscan::minify;
use crate::sse::{write_event, write_json};

/// What an Anthropic stream is opened with.
#[derive(Debug, Clone)]
pub struct AnthropicParams {
    pub model: String,
    pub message_id: String,
    pub stream: bool,
    /// The generation is a compaction: its text is the summary of the conversation, answered as
    /// one `compaction` block and stop reason `compaction` (nothing else is output).
    pub compaction: bool,
    /// A compaction made before this generation (a `compact_20260112` edit that does not
    /// pause): its summary, the message's first block.
    pub compacted: Option<String>,
    /// The context-management edits applied to the request (a JSON array, Anthropic's
    /// `applied_edits`), reported in the message's `context_management`.
    pub applied_edits: Option<String>,
    /// A declared server-side tool search: the stream answers the model's calls of it.
    pub tool_search: Option<Arc<ToolSearch>>,
}

/// Kinds of content block. A change of kind closes the open block and opens the next index;
/// every tool call is a block of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Text,
    Thinking,
    ToolUse,
    Compaction,
    /// A call of the server-side tool search, answered by the `SearchResult` after it.
    ServerToolUse,
    SearchResult,
}

#[derive(Debug, Clone, Copy)]
struct OpenBlock {
    index: u32,
    kind: BlockKind,
}

/// One stream's position in the event sequence (streaming) or its assembled content (not).
#[derive(Debug)]
pub struct AnthropicStream {
    params: AnthropicParams,
    pub(crate) usage: PromptUsage,
    /// The cached tokens `message_start` reported (`usage` may learn of more later).
    started_cached: u64,
    open: Option<OpenBlock>,
    next_index: u32,
    tool_calls: u32,
    /// Calls the client runs (not the server's tool search).
    client_calls: u32,
    /// The open tool search call's id and input so far.
    search_call: Option<(String, String)>,
    /// Non-streaming only: the content blocks so far.
    content: Vec<Block>,
    /// The open compaction block's summary (sent whole when the block closes).
    summary: String,
    /// A compaction's summary, once written (`Reader.result`).
    result: Option<Vec<u8>>,
}

impl AnthropicStream {
    fn delta_usage(&self, output_tokens: u64) -> OutputUsage {
        let usage = self.usage;
        let changed = usage.cached_tokens != self.started_cached;
        OutputUsage {
            input_tokens: changed.then(|| usage.prompt_tokens - usage.cached_tokens),
            cache_read_input_tokens: changed.then_some(usage.cached_tokens),
            output_tokens,
        }
    }

    pub fn new(params: AnthropicParams, usage: PromptUsage) -> Self {
        Self {
            params,
            usage,
            started_cached: usage.cached_tokens,
            open: None,
            next_index: 0,
            tool_calls: 0,
            client_calls: 0,
            search_call: None,
            content: Vec::new(),
            summary: String::new(),
            result: None,
        }
    }

    /// The summary a compaction generation wrote, once it ended.
    pub fn take_result(&mut self) -> Option<Vec<u8>> {
        self.result.take()
    }

    pub fn start(&mut self, out: &mut Vec<u8>) {
        if !self.params.stream {
            self.write_compacted(out);
            return;
        }
        let message = self.message(&[], None, None, 0);
        write(out, &Event::MessageStart { message });
        write(out, &Event::Ping);
        self.write_compacted(out);
    }

    /// The summary of a compaction made before this generation, as the first block.
    fn write_compacted(&mut self, out: &mut Vec<u8>) {
        if let Some(summary) = self.params.compacted.take() {
            self.enter_block(BlockKind::Compaction, out);
            self.summary = summary;
            self.close_block(out);
        }
    }

    pub fn ping(&mut self, out: &mut Vec<u8>) {
        if self.params.stream {
            write(out, &Event::Ping);
        }
    }

    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        if self.params.compaction {
            self.enter_block(BlockKind::Compaction, out);
            self.summary.push_str(text);
            return;
        }
        let index = self.enter_block(BlockKind::Text, out);
        if self.params.stream {
            write_str_delta(out, index, TEXT_DELTA, text);
        } else if let Some(Block::Text { text: body }) = self.content.last_mut() {
            body.push_str(text);
        }
    }

    pub fn thinking(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() || self.params.compaction {
            return; // a compaction's answer is its summary
        }
        let index = self.enter_block(BlockKind::Thinking, out);
        if self.params.stream {
            write_str_delta(out, index, THINKING_DELTA, text);
        } else if let Some(Block::Thinking { thinking, .. }) = self.content.last_mut() {
            thinking.push_str(text);
        }
    }

    /// Opens a `tool_use` block with an empty `input`; the input follows as `input_json_delta`s
    /// (clients ignore an input given in `content_block_start`).
    /// A call of the declared tool search opens a `server_tool_use` block instead, streamed
    /// the same way.
    pub fn tool_start(&mut self, name: &str, out: &mut Vec<u8>) {
        if self.params.compaction {
            return; // a summary calls no tool
        }
        if self.search_call.is_some() {
            self.tool_end(out); // a search call is answered even if its end went unsaid
        }
        self.close_block(out);
        let search = self
            .params
            .tool_search
            .as_ref()
            .is_some_and(|s| s.name == name);
        let mut id = String::with_capacity(32);
        let prefix = if search { "srvtoolu_" } else { "toolu_" };
        tool_call_id(prefix, &self.params.message_id, self.tool_calls, &mut id);
        self.tool_calls += 1;
        let (name, input) = (name.to_owned(), String::new());
        if search {
            self.search_call = Some((id.clone(), String::new()));
            let block = Block::ServerToolUse { id, name, input };
            self.open_block(BlockKind::ServerToolUse, block, out);
        } else {
            self.client_calls += 1;
            self.open_block(BlockKind::ToolUse, Block::ToolUse { id, name, input }, out);
        }
    }

    pub fn tool_args(&mut self, fragment: &str, out: &mut Vec<u8>) {
        let Some(open) = self
            .open
            .filter(|o| matches!(o.kind, BlockKind::ToolUse | BlockKind::ServerToolUse))
        else {
            return;
        };
        if fragment.is_empty() {
            return;
        }
        if let (BlockKind::ServerToolUse, Some((_, input))) = (open.kind, &mut self.search_call) {
            input.push_str(fragment);
        }
        if self.params.stream {
            write_str_delta(out, open.index, INPUT_JSON_DELTA, fragment);
        } else if let Some(Block::ToolUse { input, .. } | Block::ServerToolUse { input, .. }) =
            self.content.last_mut()
        {
            input.push_str(fragment);
        }
    }

    /// A tool search call, once complete, is answered at once: its result block follows it.
    pub fn tool_end(&mut self, out: &mut Vec<u8>) {
        if self.params.compaction {
            return; // a summary calls no tool: its block stays open
        }
        self.close_block(out);
        let (Some((tool_use_id, input)), Some(search)) =
            (self.search_call.take(), self.params.tool_search.clone())
        else {
            return;
        };
        let content = match search.run(&input) {
            Ok(names) => SearchOutcome::ToolSearchToolSearchResult {
                tool_references: names
                    .into_iter()
                    .map(|name| ToolReference {
                        kind: "tool_reference",
                        tool_name: name.to_owned(),
                    })
                    .collect(),
            },
            Err(invalid) => SearchOutcome::ToolSearchToolResultError {
                error_code: "invalid_tool_input",
                error_message: invalid.0,
            },
        };
        let block = Block::ToolSearchToolResult {
            tool_use_id,
            content,
        };
        self.open_block(BlockKind::SearchResult, block, out);
        self.close_block(out);
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        if self.params.compaction {
            self.enter_block(BlockKind::Compaction, out);
        }
        self.close_block(out);
        let (stop_reason, stop_sequence) = match finish {
            _ if self.params.compaction && finish != Finish::MaxTokens => ("compaction", None),
            Finish::EndTurn | Finish::Repetition => ("end_turn", None),
            Finish::MaxTokens => ("max_tokens", None),
            Finish::StopSequence(stop) => ("stop_sequence", Some(stop)),
            // Only the server's search was called: the client sends the reply back to go on.
            Finish::ToolUse if self.client_calls == 0 => ("pause_turn", None),
            Finish::ToolUse => ("tool_use", None),
        };
        if self.params.stream {
            write(
                out,
                &Event::MessageDelta {
                    delta: StopInfo {
                        stop_reason: Some(stop_reason),
                        stop_sequence,
                    },
                    context_management: self.context_management().map(|edits| AppliedEdits {
                        applied_edits: edits,
                    }),
                    usage: self.delta_usage(output_tokens),
                },
            );
            write(out, &Event::MessageStop);
        } else {
            let content = std::mem::take(&mut self.content);
            let message = self.message(&content, Some(stop_reason), stop_sequence, output_tokens);
            write_json(out, &message);
        }
    }

    pub fn is_streaming(&self) -> bool {
        self.params.stream
    }

    /// Returns the index of an open block of `kind`, closing another kind and opening one.
    fn enter_block(&mut self, kind: BlockKind, out: &mut Vec<u8>) -> u32 {
        if let Some(open) = self.open {
            if open.kind == kind {
                return open.index;
            }
            self.close_block(out);
        }
        let block = match kind {
            BlockKind::Text => Block::Text {
                text: String::new(),
            },
            BlockKind::Thinking => Block::Thinking {
                thinking: String::new(),
                signature: "",
            },
            BlockKind::Compaction => Block::Compaction { content: None },
            // Opened by `tool_start` and `tool_end` with what they hold; never entered by kind.
            BlockKind::ToolUse | BlockKind::ServerToolUse | BlockKind::SearchResult => {
                Block::ToolUse {
                    id: String::new(),
                    name: String::new(),
                    input: String::new(),
                }
            }
        };
        self.open_block(kind, block, out)
    }

    fn open_block(&mut self, kind: BlockKind, block: Block, out: &mut Vec<u8>) -> u32 {
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some(OpenBlock { index, kind });
        if self.params.stream {
            write(
                out,
                &Event::ContentBlockStart {
                    index,
                    content_block: &block,
                },
            );
        } else {
            self.content.push(block);
        }
        index
    }

    fn close_block(&mut self, out: &mut Vec<u8>) {
        if let Some(open) = self.open.take() {
            if open.kind == BlockKind::Compaction {
                self.close_compaction(open.index, out);
                return;
            }
            if self.params.stream {
                if open.kind == BlockKind::Thinking {
                    // No real signature exists; clients echo the empty one back.
                    write_str_delta(out, open.index, SIGNATURE_DELTA, "");
                }
                write(out, &Event::ContentBlockStop { index: open.index });
            }
        }
    }

    /// A compaction block's summary goes out whole: streamed, as its one `compaction_delta`
    /// (clients take a delta's content as the block's, not as more of it).
    fn close_compaction(&mut self, index: u32, out: &mut Vec<u8>) {
        let summary = std::mem::take(&mut self.summary);
        if self.params.compaction {
            self.result = Some(summary.clone().into_bytes());
        }
        if self.params.stream {
            let delta = Delta::Compaction { content: &summary };
            write(out, &Event::ContentBlockDelta { index, delta });
            write(out, &Event::ContentBlockStop { index });
        } else if let Some(Block::Compaction { content }) = self.content.last_mut() {
            *content = Some(summary);
        }
    }

    /// `{"applied_edits": [...]}`, when the request's context-management edits did anything.
    fn context_management(&self) -> Option<&serde_json::value::RawValue> {
        let edits = self.params.applied_edits.as_deref()?;
        serde_json::from_str::<&serde_json::value::RawValue>(edits).ok()
    }

    fn message<'a>(
        &'a self,
        content: &'a [Block],
        stop_reason: Option<&'a str>,
        stop_sequence: Option<&'a str>,
        output_tokens: u64,
    ) -> Message<'a> {
        Message {
            id: &self.params.message_id,
            kind: "message",
            role: "assistant",
            model: &self.params.model,
            content,
            stop_reason,
            stop_sequence,
            context_management: self.context_management().map(|edits| AppliedEdits {
                applied_edits: edits,
            }),
            usage: Usage {
                input_tokens: self.usage.prompt_tokens - self.usage.cached_tokens,
                cache_creation_input_tokens: 0,
                cache_read_input_tokens: self.usage.cached_tokens,
                output_tokens,
            },
        }
    }
}

/// Anthropic's error type for each kind.
pub fn error_type(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidRequest => "invalid_request_error",
        ErrorKind::Authentication => "authentication_error",
        ErrorKind::Permission => "permission_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::RequestTooLarge => "request_too_large",
        ErrorKind::RateLimited => "rate_limit_error",
        ErrorKind::Overloaded | ErrorKind::Unavailable => "overloaded_error",
        ErrorKind::Internal => "api_error",
    }
}

/// The status Anthropic's clients act on: 529 is its "overloaded, retry".
pub fn error_status(kind: ErrorKind) -> u16 {
    match kind {
        ErrorKind::Overloaded => 529,
        _ => kind.http_status(),
    }
}

/// Streaming: an `error` event (open blocks stay unclosed, as Anthropic does). Non-streaming:
/// the error envelope as the body.
pub fn write_error(error: &ErrorReply<'_>, stream: bool, out: &mut Vec<u8>) {
    let event = Event::Error {
        error: ErrorBody {
            kind: error_type(error.kind),
            message: error.message,
        },
    };
    if stream {
        write(out, &event);
    } else {
        write_json(out, &event);
    }
}

fn write(out: &mut Vec<u8>, event: &Event<'_>) {
    write_event(out, event.name(), event);
}

/// What follows the index in a `content_block_delta` frame, up to the delta's string value.
const TEXT_DELTA: &[u8] = b",\"delta\":{\"type\":\"text_delta\",\"text\":";
const THINKING_DELTA: &[u8] = b",\"delta\":{\"type\":\"thinking_delta\",\"thinking\":";
const INPUT_JSON_DELTA: &[u8] = b",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":";
const SIGNATURE_DELTA: &[u8] = b",\"delta\":{\"type\":\"signature_delta\",\"signature\":";

/// The per-token frame, written by hand so only the text itself goes through JSON escaping.
/// `delta` is one of the `*_DELTA` constants. Byte-identical to
/// `write(out, &Event::ContentBlockDelta { .. })` (checked by a test).
// NOTE: inline(always): one call site is the per-token hot path (measured: +50 instr/token otherwise).
#[inline(always)]
fn write_str_delta(out: &mut Vec<u8>, index: u32, delta: &[u8], text: &str) {
    out.extend_from_slice(
        b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":",
    );
    write_json(out, &index);
    out.extend_from_slice(delta);
    write_json(out, text);
    out.extend_from_slice(b"}}\n\n");
}

// Field order below is the wire order of Anthropic's API; `type` comes first.

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event<'a> {
    MessageStart {
        message: Message<'a>,
    },
    Ping,
    ContentBlockStart {
        index: u32,
        content_block: &'a Block,
    },
    // The per-token deltas are written by `write_str_delta`; the derive is their reference, and
    // writes the others (a compaction's).
    ContentBlockDelta {
        index: u32,
        delta: Delta<'a>,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: StopInfo<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        context_management: Option<AppliedEdits<'a>>,
        usage: OutputUsage,
    },
    MessageStop,
    Error {
        error: ErrorBody<'a>,
    },
}

impl Event<'_> {
    fn name(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::Ping => "ping",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop => "message_stop",
            Self::Error { .. } => "error",
        }
    }
}

#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: &'a [Block],
    stop_reason: Option<&'a str>,
    stop_sequence: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    context_management: Option<AppliedEdits<'a>>,
    usage: Usage,
}

#[derive(Serialize)]
struct AppliedEdits<'a> {
    applied_edits: &'a serde_json::value::RawValue,
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    cache_creation_input_tokens: u64,
    cache_read_input_tokens: u64,
    output_tokens: u64,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Thinking {
        thinking: String,
        signature: &'static str,
    },
    ToolUse {
        id: String,
        name: String,
        /// The arguments JSON as the model wrote it, sent as an object (`{}` while streaming).
        #[serde(serialize_with = "raw_object")]
        input: String,
    },
    Compaction {
        content: Option<String>,
    },
    ServerToolUse {
        id: String,
        name: String,
        #[serde(serialize_with = "raw_object")]
        input: String,
    },
    /// Sent whole in its `content_block_start`, with no deltas.
    ToolSearchToolResult {
        tool_use_id: String,
        content: SearchOutcome,
    },
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum SearchOutcome {
    ToolSearchToolSearchResult {
        tool_references: Vec<ToolReference>,
    },
    ToolSearchToolResultError {
        error_code: &'static str,
        error_message: String,
    },
}

#[derive(Debug, Serialize)]
struct ToolReference {
    #[serde(rename = "type")]
    kind: &'static str,
    tool_name: String,
}

/// Writes JSON text (valid by construction: the markup parser validates it) as a nested value.
fn raw_object<S: Serializer>(json: &str, serializer: S) -> Result<S::Ok, S::Error> {
    let mut compact = String::with_capacity(json.len());
    minify(json, &mut compact);
    if compact.is_empty() {
        compact.push_str("{}");
    }
    match serde_json::value::RawValue::from_string(compact) {
        Ok(raw) => raw.serialize(serializer),
        Err(_) => serializer
            .serialize_map(Some(0))
            .and_then(serde::ser::SerializeMap::end),
    }
}

/// The reference for `write_str_delta`, and the compaction's delta.
#[derive(Serialize)]
#[serde(tag = "type")]
enum Delta<'a> {
    #[serde(rename = "text_delta")]
    #[cfg_attr(not(test), expect(dead_code))]
    Text { text: &'a str },
    #[serde(rename = "thinking_delta")]
    #[cfg_attr(not(test), expect(dead_code))]
    Thinking { thinking: &'a str },
    #[serde(rename = "input_json_delta")]
    #[cfg_attr(not(test), expect(dead_code))]
    InputJson { partial_json: &'a str },
    #[serde(rename = "signature_delta")]
    #[cfg_attr(not(test), expect(dead_code))]
    Signature { signature: &'a str },
    #[serde(rename = "compaction_delta")]
    Compaction { content: &'a str },
}

#[derive(Serialize)]
struct StopInfo<'a> {
    stop_reason: Option<&'a str>,
    stop_sequence: Option<&'a str>,
}

/// `message_delta`'s usage: the output, and the input again where the prompt turned out to reuse
/// more than `message_start` said (another prompt's prefill it waited for): the delta's usage is
/// cumulative, and the SDKs take its input fields over `message_start`'s.
#[derive(Serialize)]
struct OutputUsage {
    #[serde(skip_serializing_if = "Option::is_none")]
    input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<u64>,
    output_tokens: u64,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::tool_search::{Deferred, SearchKind};
    use crate::events::Protocol;

    fn params(stream: bool) -> AnthropicParams {
        AnthropicParams {
            model: "smol".into(),
            message_id: "msg_1".into(),
            stream,
            compaction: false,
            compacted: None,
            applied_edits: None,
            tool_search: None,
        }
    }

    fn stream(stream: bool) -> AnthropicStream {
        let usage = PromptUsage {
            prompt_tokens: 7,
            cached_tokens: 2,
        };
        AnthropicStream::new(params(stream), usage)
    }

    fn frames(out: &[u8]) -> Vec<String> {
        let text = std::str::from_utf8(out).unwrap();
        text.split_terminator("\n\n").map(str::to_owned).collect()
    }

    #[test]
    fn streaming_sequence() {
        let mut s = stream(true);
        let mut out = Vec::new();
        s.start(&mut out);
        s.text("", &mut out);
        s.text("Hi", &mut out);
        s.text(" \"you\"", &mut out);
        s.finish(Finish::StopSequence("\n"), 3, &mut out);
        assert_eq!(
            frames(&out),
            [
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"smol\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":5,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":2,\"output_tokens\":0}}}",
                "event: ping\ndata: {\"type\":\"ping\"}",
                "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" \\\"you\\\"\"}}",
                "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":\"\\n\"},\"usage\":{\"output_tokens\":3}}",
                "event: message_stop\ndata: {\"type\":\"message_stop\"}",
            ]
        );
    }

    #[test]
    fn a_prompt_that_reused_more_after_message_start_says_so_in_message_delta() {
        let mut s = stream(true);
        let mut out = Vec::new();
        s.start(&mut out);
        s.usage.cached_tokens = 6; // Protocol::cached: another prompt's prefill waited for
        s.text("Hi", &mut out);
        s.finish(Finish::EndTurn, 1, &mut out);
        let frames = frames(&out);
        assert!(frames[0].contains("\"cache_read_input_tokens\":2"));
        assert!(frames[frames.len() - 2].ends_with(
            "\"usage\":{\"input_tokens\":1,\"cache_read_input_tokens\":6,\"output_tokens\":1}}"
        ));
    }

    #[test]
    fn a_compaction_is_one_block_sent_whole_and_kept_as_the_result() {
        let mut s = stream(true);
        s.params.compaction = true;
        s.params.applied_edits = Some(r#"[{"type":"clear_tool_uses_20250919"}]"#.into());
        let mut out = Vec::new();
        s.start(&mut out);
        s.thinking("hmm", &mut out);
        s.text("The user ", &mut out);
        s.tool_start("Bash", &mut out);
        s.tool_end(&mut out);
        s.text("said hi.", &mut out);
        s.finish(Finish::EndTurn, 4, &mut out);
        let frames = frames(&out);
        let data: Vec<serde_json::Value> = frames
            .iter()
            .map(|f| serde_json::from_str(f.split_once("data: ").unwrap().1).unwrap())
            .collect();
        assert_eq!(data[2]["content_block"]["type"], "compaction");
        assert_eq!(data[3]["delta"]["type"], "compaction_delta");
        assert_eq!(data[3]["delta"]["content"], "The user said hi.");
        assert_eq!(data[4]["type"], "content_block_stop");
        assert_eq!(data[5]["delta"]["stop_reason"], "compaction");
        assert_eq!(
            data[5]["context_management"]["applied_edits"][0]["type"],
            "clear_tool_uses_20250919"
        );
        assert_eq!(
            s.take_result().as_deref(),
            Some(b"The user said hi.".as_slice())
        );

        // A compaction made before the answer comes first, then the answer as usual.
        let mut s = stream(false);
        s.params.compacted = Some("Earlier: hi.".into());
        let mut out = Vec::new();
        s.start(&mut out);
        s.text("Hello.", &mut out);
        s.finish(Finish::EndTurn, 2, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(body["content"][0]["type"], "compaction");
        assert_eq!(body["content"][0]["content"], "Earlier: hi.");
        assert_eq!(body["content"][1]["text"], "Hello.");
        assert_eq!(body["stop_reason"], "end_turn");
        assert!(body.get("context_management").is_none());
    }

    #[test]
    fn hand_written_delta_matches_serde() {
        let texts = [
            "",
            "plain",
            "q\"uo\\te",
            "\n\r\t\u{1}\u{1f}\u{7f}",
            "😀 你好 \u{2028}",
            "</x>",
        ];
        for index in [0, 7, 4_000_000_000] {
            for text in texts {
                for (prefix, delta) in [
                    (TEXT_DELTA, Delta::Text { text }),
                    (THINKING_DELTA, Delta::Thinking { thinking: text }),
                    (INPUT_JSON_DELTA, Delta::InputJson { partial_json: text }),
                    (SIGNATURE_DELTA, Delta::Signature { signature: text }),
                ] {
                    let mut hand = Vec::new();
                    write_str_delta(&mut hand, index, prefix, text);
                    let mut derived = Vec::new();
                    write(&mut derived, &Event::ContentBlockDelta { index, delta });
                    assert_eq!(
                        String::from_utf8(hand).unwrap(),
                        String::from_utf8(derived).unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn streaming_without_text_has_no_block() {
        let mut s = stream(true);
        let mut out = Vec::new();
        s.finish(Finish::EndTurn, 1, &mut out);
        let frames = frames(&out);
        assert_eq!(frames.len(), 2);
        assert!(frames[0].starts_with("event: message_delta\n"));
    }

    #[test]
    fn non_streaming_body() {
        let mut s = stream(false);
        let mut out = Vec::new();
        s.start(&mut out);
        s.text("Hel", &mut out);
        s.text("lo", &mut out);
        assert!(out.is_empty());
        s.finish(Finish::MaxTokens, 2, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"smol\",\"content\":[{\"type\":\"text\",\"text\":\"Hello\"}],\"stop_reason\":\"max_tokens\",\"stop_sequence\":null,\"usage\":{\"input_tokens\":5,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":2,\"output_tokens\":2}}"
        );
    }

    fn searching(stream: bool) -> AnthropicStream {
        let search = ToolSearch {
            name: "tool_search_tool_regex".into(),
            kind: SearchKind::Regex,
            deferred: vec![Deferred {
                name: "get_weather".into(),
                document: "get_weather\nGet the weather.".into(),
            }],
        };
        let params = AnthropicParams {
            tool_search: Some(Arc::new(search)),
            ..params(stream)
        };
        AnthropicStream::new(params, PromptUsage::default())
    }

    fn call(s: &mut AnthropicStream, name: &str, input: &str, out: &mut Vec<u8>) {
        s.tool_start(name, out);
        for fragment in [&input[..3], &input[3..]] {
            s.tool_args(fragment, out);
        }
        s.tool_end(out);
    }

    #[test]
    fn a_tool_search_call_is_answered_in_the_stream_and_pauses_the_turn() {
        let mut s = searching(true);
        let mut out = Vec::new();
        call(
            &mut s,
            "tool_search_tool_regex",
            r#"{"query": "weather"}"#,
            &mut out,
        );
        s.finish(Finish::ToolUse, 9, &mut out);
        let frames = frames(&out);
        assert!(
            frames[0].contains(r#""content_block":{"type":"server_tool_use","id":"srvtoolu_"#),
            "{frames:?}"
        );
        assert!(frames[0].ends_with(r#""name":"tool_search_tool_regex","input":{}}}"#));
        assert!(
            frames[1].contains(r#""partial_json":"{\"q"}"#),
            "{frames:?}"
        );
        let id = &frames[0][frames[0].find("srvtoolu_").unwrap()..][..33];
        assert_eq!(
            frames[4],
            format!(
                "event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":1,\"content_block\":{{\"type\":\"tool_search_tool_result\",\"tool_use_id\":\"{id}\",\"content\":{{\"type\":\"tool_search_tool_search_result\",\"tool_references\":[{{\"type\":\"tool_reference\",\"tool_name\":\"get_weather\"}}]}}}}}}"
            )
        );
        assert!(
            frames[5].starts_with("event: content_block_stop")
                && frames[5].contains(r#""index":1"#)
        );
        assert!(
            frames[6].contains(r#""stop_reason":"pause_turn""#),
            "{frames:?}"
        );
    }

    #[test]
    fn a_bad_search_is_an_error_result_and_a_client_call_is_tool_use() {
        let mut s = searching(false);
        let mut out = Vec::new();
        call(
            &mut s,
            "tool_search_tool_regex",
            r#"{"query": "(x"}"#,
            &mut out,
        );
        call(&mut s, "get_weather", r#"{"city": "Paris"}"#, &mut out);
        s.finish(Finish::ToolUse, 9, &mut out);
        let body: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let content = body["content"].as_array().unwrap();
        assert_eq!(content[0]["type"], "server_tool_use");
        assert_eq!(content[0]["input"], serde_json::json!({"query": "(x"}));
        assert_eq!(content[1]["tool_use_id"], content[0]["id"]);
        let error = &content[1]["content"];
        assert_eq!(error["type"], "tool_search_tool_result_error");
        assert_eq!(error["error_code"], "invalid_tool_input");
        assert!(error["error_message"]
            .as_str()
            .unwrap()
            .contains("regular expression"));
        assert_eq!(content[2]["type"], "tool_use");
        assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));
        assert_eq!(body["stop_reason"], "tool_use");
    }

    #[test]
    fn non_streaming_empty_content_and_error() {
        let mut s = stream(false);
        let mut out = Vec::new();
        s.finish(Finish::EndTurn, 1, &mut out);
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .contains("\"content\":[],"));
        let mut s = Protocol::Anthropic(Box::new(stream(false)));
        let mut out = Vec::new();
        s.text("partial", &mut out);
        assert_eq!(s.error(ErrorKind::Overloaded, "Overloaded", &mut out), 529);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}"
        );
    }
}
