//! Streaming markup parser: splits model text into visible text, thinking and tool calls, holding back split tags.

use std::str::FromStr;
use std::sync::Arc;

use crate::error::CoreError;
use crate::jsonscan::{is_valid, JsonScan, Scan};
use crate::stop::find;

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, possibly several (Qwen, Hermes).
    Hermes,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (Mistral before tokenizer v11).
    Mistral,
    /// A reply that starts with `{"name": …, "parameters": {…}}` (Llama 3.1+ JSON tool calling).
    Llama3Json,
}

impl ToolFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Mistral => "mistral",
            Self::Llama3Json => "llama3_json",
        }
    }
}

impl FromStr for ToolFormat {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "mistral" => Ok(Self::Mistral),
            "llama3_json" => Ok(Self::Llama3Json),
            _ => Err(CoreError::UnknownToolFormat(s.to_owned())),
        }
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Think,
    Hermes,
    Mistral,
}

/// A model's markup, configured once per model and shared by its streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkupSpec {
    think: Option<(String, String)>,
    tool_call: Option<ToolFormat>,
    /// Tags that open markup in visible text.
    open_tags: Vec<(String, Tag)>,
    /// Their first bytes: text without any of them cannot hold (part of) a tag.
    tag_starts: Vec<u8>,
}

impl MarkupSpec {
    pub fn new(
        think: Option<(String, String)>,
        tool_call: Option<ToolFormat>,
    ) -> Result<Self, CoreError> {
        let mut open_tags = Vec::new();
        if let Some((open, close)) = &think {
            if open.is_empty() || close.is_empty() {
                return Err(CoreError::EmptyThinkTag);
            }
            open_tags.push((open.clone(), Tag::Think));
        }
        match tool_call {
            Some(ToolFormat::Hermes) => open_tags.push((HERMES_OPEN.to_owned(), Tag::Hermes)),
            Some(ToolFormat::Mistral) => open_tags.push((MISTRAL_OPEN.to_owned(), Tag::Mistral)),
            Some(ToolFormat::Llama3Json) | None => {}
        }
        let mut tag_starts: Vec<u8> = open_tags.iter().map(|(tag, _)| tag.as_bytes()[0]).collect();
        tag_starts.sort_unstable();
        tag_starts.dedup();
        Ok(Self {
            think,
            tool_call,
            open_tags,
            tag_starts,
        })
    }

    pub fn think(&self) -> Option<(&str, &str)> {
        self.think.as_ref().map(|(o, c)| (o.as_str(), c.as_str()))
    }

    pub fn tool_call(&self) -> Option<ToolFormat> {
        self.tool_call
    }
}

/// What a piece of parser output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceKind {
    Text,
    Thinking,
    /// A tool call begins; the piece is its name.
    ToolStart,
    /// A fragment of the call's arguments JSON, as the model wrote it.
    ToolArgs,
    ToolEnd,
}

/// An ordered list of pieces over one text buffer, reused across tokens.
#[derive(Debug, Default, Clone)]
pub struct Pieces {
    text: String,
    items: Vec<(PieceKind, u32, u32)>,
}

impl Pieces {
    pub fn clear(&mut self) {
        self.text.clear();
        self.items.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Appends a piece; text-like pieces merge with a preceding piece of the same kind and empty
    /// ones are dropped.
    pub fn push(&mut self, kind: PieceKind, text: &str) {
        self.push_with(kind, |buf| buf.push_str(text));
    }

    /// Appends whatever `f` writes into the buffer as a piece of `kind`.
    pub fn push_with<R>(&mut self, kind: PieceKind, f: impl FnOnce(&mut String) -> R) -> R {
        let start = self.text.len();
        let result = f(&mut self.text);
        let end = self.text.len();
        let mergeable = matches!(
            kind,
            PieceKind::Text | PieceKind::Thinking | PieceKind::ToolArgs
        );
        if mergeable && end == start {
            return result;
        }
        match self.items.last_mut() {
            Some((last, _, last_end))
                if mergeable && *last == kind && *last_end as usize == start =>
            {
                *last_end = end as u32;
            }
            _ => self.items.push((kind, start as u32, end as u32)),
        }
        result
    }

    pub fn iter(&self) -> impl Iterator<Item = (PieceKind, &str)> + '_ {
        self.items
            .iter()
            .map(|&(kind, start, end)| (kind, &self.text[start as usize..end as usize]))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Think,
    Call,
    /// Hermes: after a call's object, expecting `</tool_call>`.
    AfterCall,
    /// Mistral: after `[TOOL_CALLS]`, expecting `[` (or a bare object).
    ArrayOpen,
    /// Mistral: after a call inside the array, expecting `,` or `]`.
    ArrayNext,
    /// Llama 3: after a call, expecting `;` and another object, or the end.
    Llama3Next,
    /// Llama 3: after `;`, expecting `{`.
    Llama3Open,
}

/// Per-stream markup state.
///
/// Whitespace is trimmed where markup meets text: leading whitespace of each text or thinking run
/// after markup, and trailing whitespace of a run that markup ends (so `text\n\n<tool_call>` gives
/// the text block `text`). Thinking also drops its leading whitespace.
#[derive(Debug, Clone)]
pub struct MarkupParser {
    spec: Arc<MarkupSpec>,
    mode: Mode,
    /// Input not yet consumed: a possible partial tag.
    carry: String,
    /// The markup of a call not yet committed (name unknown), emitted as text if it goes bad.
    raw: String,
    call: CallParser,
    in_array: bool,
    held_ws: String,
    skip_ws: bool,
    /// Llama 3: nothing visible yet, so a `{` starts a call.
    at_start: bool,
    calls: u32,
    truncated: bool,
}

impl MarkupParser {
    pub fn new(spec: Arc<MarkupSpec>) -> Self {
        let llama3 = spec.tool_call == Some(ToolFormat::Llama3Json);
        Self {
            spec,
            mode: Mode::Text,
            carry: String::new(),
            raw: String::new(),
            call: CallParser::default(),
            in_array: false,
            held_ws: String::new(),
            skip_ws: llama3,
            at_start: llama3,
            calls: 0,
            truncated: false,
        }
    }

    /// Tool calls started so far (complete or not).
    pub fn tool_calls(&self) -> u32 {
        self.calls
    }

    /// True if some call's arguments had to be completed artificially (generation cut it short).
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Consumes text the prompt already holds (e.g. an opened `<think>` or a forced
    /// `<tool_call>`). Only tool pieces are kept in `out`: prefill text is never shown.
    pub fn prefill(&mut self, text: &str, out: &mut Pieces) {
        let mut all = Pieces::default();
        self.push(text, &mut all);
        for (kind, piece) in all.iter() {
            if !matches!(kind, PieceKind::Text | PieceKind::Thinking) {
                out.push(kind, piece);
            }
        }
        self.held_ws.clear();
    }

    pub fn push(&mut self, text: &str, out: &mut Pieces) {
        if text.is_empty() {
            return;
        }
        if self.carry.is_empty() {
            let used = self.process(text, out);
            self.carry.push_str(&text[used..]);
            return;
        }
        self.carry.push_str(text);
        let carry = std::mem::take(&mut self.carry);
        let used = self.process(&carry, out);
        self.carry = carry;
        self.carry.drain(..used);
    }

    /// End of generation: releases held text, closes an open thinking run or tool call.
    pub fn finish(&mut self, out: &mut Pieces) {
        let carry = std::mem::take(&mut self.carry);
        match self.mode {
            Mode::Text => self.visible(&carry, out),
            Mode::Think => {
                self.visible(&carry, out);
                self.held_ws.clear();
            }
            Mode::Call if self.call.committed => {
                self.calls += 1;
                if !self.call.abort(out) {
                    self.truncated = true;
                }
            }
            Mode::Call | Mode::ArrayOpen => {
                self.mode = Mode::Text;
                let raw = std::mem::take(&mut self.raw);
                self.visible(&raw, out);
                self.visible(&carry, out);
            }
            Mode::AfterCall | Mode::ArrayNext | Mode::Llama3Next | Mode::Llama3Open => {}
        }
        if self.mode == Mode::Text && !self.held_ws.is_empty() {
            out.push(PieceKind::Text, &self.held_ws);
            self.held_ws.clear();
        }
    }

    /// Returns how many bytes of `input` were consumed; the rest is a possible partial tag.
    fn process(&mut self, input: &str, out: &mut Pieces) -> usize {
        let mut pos = 0;
        while pos < input.len() {
            let rest = &input[pos..];
            match self.mode {
                Mode::Text => {
                    if self.at_start {
                        let body = rest.trim_start();
                        pos += rest.len() - body.len();
                        if body.is_empty() {
                            break;
                        }
                        self.at_start = false;
                        if body.starts_with('{') {
                            self.begin_call("");
                        }
                        continue;
                    }
                    // NOTE: the common token has no `<` or `[`: skip tag matching entirely.
                    let starts = &self.spec.tag_starts;
                    if !rest.bytes().any(|b| starts.contains(&b)) {
                        self.visible(rest, out);
                        pos = input.len();
                        break;
                    }
                    match self.find_tag(rest) {
                        Some((at, len, tag)) => {
                            self.visible(&rest[..at], out);
                            pos += at + len;
                            self.enter(tag, &rest[at..at + len]);
                        }
                        None => {
                            let keep = self.partial_tag_len(rest);
                            self.visible(&rest[..rest.len() - keep], out);
                            pos += rest.len() - keep;
                            break;
                        }
                    }
                }
                Mode::Think => {
                    let close = self.spec.think().map_or("", |(_, close)| close);
                    let (shown, used, closed) = if !rest.bytes().any(|b| b == close.as_bytes()[0]) {
                        (rest.len(), rest.len(), false)
                    } else if let Some(at) = find(rest.as_bytes(), close.as_bytes()) {
                        (at, at + close.len(), true)
                    } else {
                        let end = rest.len() - partial_len(rest, close);
                        (end, end, false)
                    };
                    self.visible(&rest[..shown], out);
                    pos += used;
                    if !closed {
                        break;
                    }
                    self.end_run();
                    self.mode = Mode::Text;
                }
                Mode::Call => {
                    let (used, status) = self.call.feed(rest, out);
                    if self.call.committed {
                        self.raw.clear();
                    } else {
                        self.raw.push_str(&rest[..used]);
                    }
                    pos += used;
                    match status {
                        CallStatus::Open => {}
                        CallStatus::Complete => {
                            self.calls += 1;
                            self.raw.clear();
                            self.mode = match self.spec.tool_call {
                                Some(ToolFormat::Hermes) => Mode::AfterCall,
                                Some(ToolFormat::Mistral) if self.in_array => Mode::ArrayNext,
                                Some(ToolFormat::Llama3Json) => Mode::Llama3Next,
                                _ => {
                                    self.end_run();
                                    Mode::Text
                                }
                            };
                        }
                        CallStatus::Invalid => self.call_failed(out),
                    }
                }
                Mode::AfterCall => {
                    let body = rest.trim_start();
                    pos += rest.len() - body.len();
                    if body.is_empty() {
                        break;
                    }
                    if body.starts_with(HERMES_CLOSE) {
                        pos += HERMES_CLOSE.len();
                    } else if HERMES_CLOSE.starts_with(body) {
                        break;
                    }
                    self.end_run();
                    self.mode = Mode::Text;
                }
                Mode::ArrayOpen => {
                    let body = rest.trim_start();
                    self.raw.push_str(&rest[..rest.len() - body.len()]);
                    pos += rest.len() - body.len();
                    match body.as_bytes().first() {
                        None => break,
                        Some(b'[') => {
                            pos += 1;
                            self.in_array = true;
                            self.raw.clear();
                            self.begin_call("");
                        }
                        Some(b'{') => {
                            self.in_array = false;
                            self.raw.clear();
                            self.begin_call("");
                        }
                        Some(_) => self.call_failed(out),
                    }
                }
                Mode::ArrayNext | Mode::Llama3Next | Mode::Llama3Open => {
                    let body = rest.trim_start();
                    pos += rest.len() - body.len();
                    let next = match (self.mode, body.as_bytes().first()) {
                        (_, None) => break,
                        (Mode::ArrayNext, Some(b',')) | (Mode::Llama3Next, Some(b';')) => {
                            pos += 1;
                            if self.mode == Mode::ArrayNext {
                                self.begin_call("");
                                continue;
                            }
                            Mode::Llama3Open
                        }
                        (Mode::ArrayNext, Some(b']')) => {
                            pos += 1;
                            Mode::Text
                        }
                        (Mode::Llama3Open, Some(b'{')) => {
                            self.begin_call("");
                            continue;
                        }
                        _ => Mode::Text,
                    };
                    if next == Mode::Text {
                        self.end_run();
                    }
                    self.mode = next;
                }
            }
        }
        pos
    }

    fn begin_call(&mut self, tag: &str) {
        self.raw.clear();
        self.raw.push_str(tag);
        self.call = CallParser::default();
        self.mode = Mode::Call;
    }

    fn enter(&mut self, tag: Tag, text: &str) {
        // Whitespace before a tool call comes back with its markup if the call turns out bad.
        let held = std::mem::take(&mut self.held_ws);
        self.end_run();
        match tag {
            Tag::Think => self.mode = Mode::Think,
            Tag::Hermes => self.begin_call(text),
            Tag::Mistral => {
                self.call = CallParser::default();
                self.raw.clear();
                self.raw.push_str(text);
                self.mode = Mode::ArrayOpen;
            }
        }
        if tag != Tag::Think {
            self.raw.insert_str(0, &held);
        }
        self.held_ws = held;
        self.held_ws.clear();
    }

    /// A call turned out malformed at the current input position. Before its name was known it
    /// becomes plain text; after, its arguments are closed validly and the rest is text.
    fn call_failed(&mut self, out: &mut Pieces) {
        self.mode = Mode::Text;
        if self.call.committed {
            self.calls += 1;
            if !self.call.abort(out) {
                self.truncated = true;
            }
            self.end_run();
            self.skip_ws = false;
            // Small models often forget the call object's own closing brace; a `</tool_call>`
            // right after the arguments still ends the call rather than leaking into the text.
            if self.spec.tool_call == Some(ToolFormat::Hermes) {
                self.mode = Mode::AfterCall;
            }
        } else {
            self.skip_ws = false;
            let raw = std::mem::take(&mut self.raw);
            self.visible(&raw, out);
        }
    }

    /// Ends a text or thinking run at markup: its held trailing whitespace is dropped and the
    /// next run's leading whitespace skipped.
    fn end_run(&mut self) {
        self.held_ws.clear();
        self.skip_ws = true;
    }

    /// Emits run text, holding back trailing whitespace until more text follows.
    fn visible(&mut self, text: &str, out: &mut Pieces) {
        let kind = if self.mode == Mode::Think {
            PieceKind::Thinking
        } else {
            PieceKind::Text
        };
        let mut text = text;
        if self.skip_ws {
            text = text.trim_start();
            if text.is_empty() {
                return;
            }
            self.skip_ws = false;
        }
        let body = text.trim_end();
        if !body.is_empty() {
            self.at_start = false;
            if !self.held_ws.is_empty() {
                out.push(kind, &self.held_ws);
                self.held_ws.clear();
            }
            out.push(kind, body);
        }
        self.held_ws.push_str(&text[body.len()..]);
    }

    /// The earliest open tag in `text`: (position, length, tag).
    fn find_tag(&self, text: &str) -> Option<(usize, usize, Tag)> {
        let mut best: Option<(usize, usize, Tag)> = None;
        for (tag_text, tag) in &self.spec.open_tags {
            if let Some(at) = find(text.as_bytes(), tag_text.as_bytes()) {
                if best.is_none_or(|(best_at, _, _)| at < best_at) {
                    best = Some((at, tag_text.len(), *tag));
                }
            }
        }
        best
    }

    fn partial_tag_len(&self, text: &str) -> usize {
        self.spec
            .open_tags
            .iter()
            .map(|(tag, _)| partial_len(text, tag))
            .max()
            .unwrap_or(0)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_len(text: &str, tag: &str) -> usize {
    let (text, tag) = (text.as_bytes(), tag.as_bytes());
    let from = text.len() - (tag.len().saturating_sub(1)).min(text.len());
    (from..text.len())
        .find(|&at| text[at] == tag[0] && tag.starts_with(&text[at..]))
        .map_or(0, |at| text.len() - at)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallStatus {
    /// All input consumed; the object is still open.
    Open,
    /// The object closed at the returned position.
    Complete,
    /// The byte at the returned position cannot continue the call.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Name,
    /// An arguments object, passed through as written.
    Args,
    /// Arguments written as a JSON string holding the object.
    ArgsString,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Obj {
    Open,
    KeyOrClose,
    Key,
    InKey,
    Colon,
    Value,
    InValue(Slot),
    CommaOrClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArgsState {
    None,
    Partial,
    Done,
}

/// One call object `{"name": …, "arguments"|"parameters": {…}}`. The call is committed (its
/// start emitted) once the name is known; arguments stream from then on, buffered before.
#[derive(Debug, Clone)]
struct CallParser {
    obj: Obj,
    scan: JsonScan,
    /// The raw text of the current key, name or string-encoded arguments.
    buf: String,
    key: String,
    /// Arguments seen before the name (or decoded from a string).
    args: String,
    args_state: ArgsState,
    committed: bool,
}

impl Default for CallParser {
    fn default() -> Self {
        Self {
            obj: Obj::Open,
            scan: JsonScan::new(),
            buf: String::new(),
            key: String::new(),
            args: String::new(),
            args_state: ArgsState::None,
            committed: false,
        }
    }
}

impl CallParser {
    fn accumulating(&self) -> bool {
        matches!(
            self.obj,
            Obj::InKey | Obj::InValue(Slot::Name | Slot::ArgsString | Slot::Args)
        )
    }

    fn flush(&mut self, part: &str, out: &mut Pieces) {
        match self.obj {
            Obj::InValue(Slot::Args) if self.committed => out.push(PieceKind::ToolArgs, part),
            Obj::InValue(Slot::Args) => self.args.push_str(part),
            Obj::InKey | Obj::InValue(Slot::Name | Slot::ArgsString) => self.buf.push_str(part),
            _ => {}
        }
    }

    fn feed(&mut self, s: &str, out: &mut Pieces) -> (usize, CallStatus) {
        let bytes = s.as_bytes();
        let mut mark = 0;
        let mut i = 0;
        let mut status = CallStatus::Open;
        while i < bytes.len() {
            let b = bytes[i];
            let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
            match self.obj {
                Obj::InKey | Obj::InValue(_) => {
                    let scan = self.scan.push(b);
                    match scan {
                        Scan::More => {}
                        Scan::Done | Scan::DoneBefore => {
                            let end = if scan == Scan::Done { i + 1 } else { i };
                            self.flush(&s[mark..end], out);
                            if !self.value_done(out) {
                                status = CallStatus::Invalid;
                                break;
                            }
                            i = end;
                            continue;
                        }
                        Scan::Invalid => {
                            status = CallStatus::Invalid;
                            break;
                        }
                    }
                }
                _ if ws => {}
                Obj::Open if b == b'{' => self.obj = Obj::KeyOrClose,
                Obj::KeyOrClose | Obj::CommaOrClose if b == b'}' => {
                    if !self.close(out) {
                        status = CallStatus::Invalid;
                        break;
                    }
                    i += 1;
                    status = CallStatus::Complete;
                    break;
                }
                Obj::KeyOrClose | Obj::Key if b == b'"' => {
                    self.buf.clear();
                    self.scan.reset();
                    self.scan.push(b);
                    self.obj = Obj::InKey;
                    mark = i;
                }
                Obj::Colon if b == b':' => self.obj = Obj::Value,
                Obj::CommaOrClose if b == b',' => self.obj = Obj::Key,
                Obj::Value => {
                    let slot = match self.key.as_str() {
                        "name" if !self.committed => Slot::Name,
                        "arguments" | "parameters" if self.args_state == ArgsState::None => {
                            if b == b'"' {
                                Slot::ArgsString
                            } else {
                                Slot::Args
                            }
                        }
                        _ => Slot::Other,
                    };
                    let ok = match slot {
                        Slot::Name | Slot::ArgsString => b == b'"',
                        Slot::Args => b == b'{',
                        Slot::Other => true,
                    };
                    self.scan.reset();
                    if !ok || self.scan.push(b) != Scan::More {
                        status = CallStatus::Invalid;
                        break;
                    }
                    if slot != Slot::Other {
                        self.args_state = match slot {
                            Slot::Args | Slot::ArgsString => ArgsState::Partial,
                            _ => self.args_state,
                        };
                        self.buf.clear();
                        mark = i;
                    }
                    self.obj = Obj::InValue(slot);
                }
                _ => {
                    status = CallStatus::Invalid;
                    break;
                }
            }
            i += 1;
        }
        if self.accumulating() {
            self.flush(&s[mark..i], out);
        }
        (i, status)
    }

    /// The key or value being scanned ended (its text flushed). False if the call is malformed.
    fn value_done(&mut self, out: &mut Pieces) -> bool {
        let obj = self.obj;
        self.obj = Obj::CommaOrClose;
        match obj {
            Obj::InKey => match serde_json::from_str::<String>(&self.buf) {
                Ok(key) => {
                    self.key = key;
                    self.obj = Obj::Colon;
                }
                Err(_) => return false,
            },
            Obj::InValue(Slot::Name) => {
                let Ok(name) = serde_json::from_str::<String>(&self.buf) else {
                    return false;
                };
                if name.is_empty() {
                    return false;
                }
                self.committed = true;
                out.push(PieceKind::ToolStart, &name);
                out.push(PieceKind::ToolArgs, &self.args);
                self.args.clear();
            }
            Obj::InValue(Slot::ArgsString) => {
                let Ok(args) = serde_json::from_str::<String>(&self.buf) else {
                    return false;
                };
                let args = args.trim();
                if !args.starts_with('{') || !is_valid(args) {
                    return false;
                }
                self.args_state = ArgsState::Done;
                if self.committed {
                    out.push(PieceKind::ToolArgs, args);
                } else {
                    self.args.push_str(args);
                }
            }
            Obj::InValue(Slot::Args) => self.args_state = ArgsState::Done,
            _ => {}
        }
        true
    }

    /// The object closed. False if it never named a tool.
    fn close(&mut self, out: &mut Pieces) -> bool {
        if !self.committed {
            return false;
        }
        if self.args_state == ArgsState::None {
            out.push(PieceKind::ToolArgs, "{}");
        }
        out.push(PieceKind::ToolEnd, "");
        true
    }

    /// Ends a committed call early, closing its arguments JSON validly. True if the arguments
    /// were already complete.
    fn abort(&mut self, out: &mut Pieces) -> bool {
        let complete = self.args_state == ArgsState::Done;
        match (self.args_state, self.obj) {
            (ArgsState::Partial, Obj::InValue(Slot::Args)) => {
                out.push_with(PieceKind::ToolArgs, |buf| self.scan.complete(buf));
            }
            (ArgsState::Done, _) => {}
            _ => out.push(PieceKind::ToolArgs, "{}"),
        }
        out.push(PieceKind::ToolEnd, "");
        complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(think: bool, tool: Option<ToolFormat>) -> Arc<MarkupSpec> {
        let think = think.then(|| ("<think>".to_owned(), "</think>".to_owned()));
        Arc::new(MarkupSpec::new(think, tool).unwrap())
    }

    /// Feeds chunks; returns the pieces (merged across chunks) as (kind, text) pairs.
    fn run(
        spec: Arc<MarkupSpec>,
        prefill: &str,
        chunks: &[&str],
    ) -> (Vec<(PieceKind, String)>, MarkupParser) {
        let mut parser = MarkupParser::new(spec);
        let mut all = Pieces::default();
        parser.prefill(prefill, &mut all);
        for chunk in chunks {
            let mut out = Pieces::default();
            parser.push(chunk, &mut out);
            for (kind, text) in out.iter() {
                all.push(kind, text);
            }
        }
        let mut out = Pieces::default();
        parser.finish(&mut out);
        for (kind, text) in out.iter() {
            all.push(kind, text);
        }
        let pieces = all.iter().map(|(k, t)| (k, t.to_owned())).collect();
        (pieces, parser)
    }

    /// Splits into chunks of every size 1..=n to check the result does not depend on splits.
    fn all_splits(text: &str, n: usize) -> Vec<Vec<&str>> {
        (1..=n)
            .map(|size| {
                let mut chunks = Vec::new();
                let mut rest = text;
                while !rest.is_empty() {
                    let mut at = size.min(rest.len());
                    while !rest.is_char_boundary(at) {
                        at += 1;
                    }
                    let (a, b) = rest.split_at(at);
                    chunks.push(a);
                    rest = b;
                }
                chunks
            })
            .collect()
    }

    use PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    fn p(kind: PieceKind, text: &str) -> (PieceKind, String) {
        (kind, text.to_owned())
    }

    #[test]
    fn hermes_call_any_split() {
        let text = "Let me look.\n\n<tool_call>\n{\"name\": \"Bash\", \"arguments\": {\"command\": \"echo \\\"hi\\\" \\\\ \\u00e9 é😀\"}}\n</tool_call>\nDone.";
        let want = vec![
            p(Text, "Let me look."),
            p(ToolStart, "Bash"),
            p(
                ToolArgs,
                "{\"command\": \"echo \\\"hi\\\" \\\\ \\u00e9 é😀\"}",
            ),
            p(ToolEnd, ""),
            p(Text, "Done."),
        ];
        for chunks in all_splits(text, 13) {
            let (got, parser) = run(spec(true, Some(ToolFormat::Hermes)), "", &chunks);
            assert_eq!(got, want, "{chunks:?}");
            assert_eq!((parser.tool_calls(), parser.truncated()), (1, false));
        }
    }

    #[test]
    fn args_stream_as_tokens_arrive() {
        let mut parser = MarkupParser::new(spec(false, Some(ToolFormat::Hermes)));
        let mut seen = Vec::new();
        for chunk in [
            "<tool_call>{\"name\":\"f\",",
            "\"arguments\":{\"a\"",
            ": [1, 2",
            "]}}",
        ] {
            let mut out = Pieces::default();
            parser.push(chunk, &mut out);
            seen.push(
                out.iter()
                    .map(|(k, t)| format!("{k:?}:{t}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        assert_eq!(
            seen,
            [
                "ToolStart:f",
                "ToolArgs:{\"a\"",
                "ToolArgs:: [1, 2",
                "ToolArgs:]} ToolEnd:"
            ]
        );
    }

    #[test]
    fn two_consecutive_calls() {
        let text = "<tool_call>\n{\"name\": \"A\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"B\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        for chunks in all_splits(text, 7) {
            let (got, parser) = run(spec(false, Some(ToolFormat::Hermes)), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "A"),
                    p(ToolArgs, "{}"),
                    p(ToolEnd, ""),
                    p(ToolStart, "B"),
                    p(ToolArgs, "{\"x\": 1}"),
                    p(ToolEnd, ""),
                ]
            );
            assert_eq!(parser.tool_calls(), 2);
        }
    }

    #[test]
    fn name_after_arguments_and_parameters_synonym() {
        let text = "<tool_call>{\"parameters\": {\"q\": \"x\"}, \"id\": 3, \"name\": \"Search\"}</tool_call>";
        for chunks in all_splits(text, 5) {
            let (got, _) = run(spec(false, Some(ToolFormat::Hermes)), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "Search"),
                    p(ToolArgs, "{\"q\": \"x\"}"),
                    p(ToolEnd, "")
                ]
            );
        }
    }

    #[test]
    fn string_encoded_arguments() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": \\\"\\\\u00e9\\\"}\"}</tool_call>";
        let (got, _) = run(spec(false, Some(ToolFormat::Hermes)), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"a\": \"\\u00e9\"}"),
                p(ToolEnd, "")
            ]
        );
    }

    #[test]
    fn malformed_before_name_falls_back_to_text() {
        for text in [
            "Hi <tool_call>\n{\"arguments\": {}, \"nam\": 1}</tool_call> ok",
            "Hi <tool_call>not json</tool_call> ok",
            "Hi <tool_call>{\"name\": 12}</tool_call> ok",
            "Hi <tool_call>{\"arguments\": {\"a\": tru}, \"name\": \"f\"}",
        ] {
            for chunks in all_splits(text, 4) {
                let (got, parser) = run(spec(false, Some(ToolFormat::Hermes)), "", &chunks);
                let joined: String = got
                    .iter()
                    .map(|(k, t)| {
                        assert_eq!(*k, Text);
                        t.as_str()
                    })
                    .collect();
                assert_eq!(joined, text, "{chunks:?}");
                assert_eq!(parser.tool_calls(), 0);
            }
        }
    }

    #[test]
    fn malformed_after_name_closes_arguments_validly() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, }}</tool_call>";
        let (got, parser) = run(spec(false, Some(ToolFormat::Hermes)), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"a\": [1, null]}"),
                p(ToolEnd, ""),
                p(Text, "}}</tool_call>"),
            ]
        );
        assert!(parser.truncated());
    }

    #[test]
    fn truncated_call_at_finish() {
        let (got, parser) = run(
            spec(false, Some(ToolFormat::Hermes)),
            "",
            &["<tool_call>{\"name\": \"f\", \"arguments\": {\"cmd\": \"ec"],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"cmd\": \"ec\"}"),
                p(ToolEnd, "")
            ]
        );
        assert_eq!((parser.tool_calls(), parser.truncated()), (1, true));
        let (got, parser) = run(
            spec(false, Some(ToolFormat::Hermes)),
            "",
            &["<tool_call>{\"name\": \"f\"}"],
        );
        assert_eq!(
            got,
            vec![p(ToolStart, "f"), p(ToolArgs, "{}"), p(ToolEnd, "")]
        );
        assert!(!parser.truncated());
    }

    #[test]
    fn thinking_tags_split_across_tokens() {
        let text = "<think>\nHmm, 1 < 2.\n</think>\n\nAnswer: <b>4</b>";
        for chunks in all_splits(text, 9) {
            let (got, _) = run(spec(true, None), "", &chunks);
            assert_eq!(
                got,
                vec![p(Thinking, "Hmm, 1 < 2."), p(Text, "Answer: <b>4</b>")],
                "{chunks:?}"
            );
        }
    }

    #[test]
    fn partial_tag_released_at_finish_and_mid_text() {
        let (got, _) = run(
            spec(true, Some(ToolFormat::Hermes)),
            "",
            &["a <thin", "k about <tool", "_"],
        );
        assert_eq!(got, vec![p(Text, "a <think about <tool_")]);
    }

    #[test]
    fn prefill_forced_tool_call() {
        let (got, parser) = run(
            spec(false, Some(ToolFormat::Hermes)),
            "<tool_call>\n{\"name\": \"Bash\", \"arguments\": ",
            &["{\"command\"", ": \"ls\"}", "}\n</tool_call>"],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "Bash"),
                p(ToolArgs, "{\"command\": \"ls\"}"),
                p(ToolEnd, "")
            ]
        );
        assert_eq!(parser.tool_calls(), 1);
    }

    #[test]
    fn hermes_call_missing_its_closing_brace_still_ends_at_the_tag() {
        let (got, parser) = run(
            spec(false, Some(ToolFormat::Hermes)),
            "<tool_call>\n{\"name\": \"Bash\", \"arguments\": ",
            &[
                "\n{\"a\": {\"b\"",
                ": 1}",
                "}",
                "\n</",
                "tool_call>",
                "\n\nDone.",
            ],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "Bash"),
                p(ToolArgs, "{\"a\": {\"b\": 1}}"),
                p(ToolEnd, ""),
                p(Text, "Done.")
            ]
        );
        assert_eq!(parser.tool_calls(), 1);
    }

    #[test]
    fn prefill_opened_think() {
        let (got, _) = run(
            spec(true, None),
            "<think>\n",
            &["Plan", ".\n</think>\n\nHi"],
        );
        assert_eq!(got, vec![p(Thinking, "Plan."), p(Text, "Hi")]);
        let (got, _) = run(spec(true, None), "<think>\n\n</think>\n\n", &["Hi"]);
        assert_eq!(got, vec![p(Text, "Hi")]);
    }

    #[test]
    fn mistral_array() {
        let text = "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        for chunks in all_splits(text, 6) {
            let (got, parser) = run(spec(false, Some(ToolFormat::Mistral)), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "a"),
                    p(ToolArgs, "{\"x\": 1}"),
                    p(ToolEnd, ""),
                    p(ToolStart, "b"),
                    p(ToolArgs, "{}"),
                    p(ToolEnd, ""),
                ]
            );
            assert_eq!(parser.tool_calls(), 2);
        }
    }

    #[test]
    fn llama3_json_only_at_reply_start() {
        let text = " {\"name\": \"get\", \"parameters\": {\"city\": \"Paris\"}}";
        for chunks in all_splits(text, 5) {
            let (got, _) = run(spec(false, Some(ToolFormat::Llama3Json)), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "get"),
                    p(ToolArgs, "{\"city\": \"Paris\"}"),
                    p(ToolEnd, "")
                ]
            );
        }
        let (got, parser) = run(
            spec(false, Some(ToolFormat::Llama3Json)),
            "",
            &["Use {\"name\": 1}"],
        );
        assert_eq!(got, vec![p(Text, "Use {\"name\": 1}")]);
        assert_eq!(parser.tool_calls(), 0);
        let (got, _) = run(
            spec(false, Some(ToolFormat::Llama3Json)),
            "",
            &["{not json"],
        );
        assert_eq!(got, vec![p(Text, "{not json")]);
    }

    #[test]
    fn tool_markup_inside_thinking_is_thinking() {
        let (got, parser) = run(
            spec(true, Some(ToolFormat::Hermes)),
            "",
            &["<think>maybe <tool_call>{}</tool_call></think>ok"],
        );
        assert_eq!(
            got,
            vec![
                p(Thinking, "maybe <tool_call>{}</tool_call>"),
                p(Text, "ok")
            ]
        );
        assert_eq!(parser.tool_calls(), 0);
    }

    #[test]
    fn random_markup_is_split_independent_and_args_always_parse() {
        let atoms = [
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
            "[TOOL_CALLS]",
            "{\"name\": \"f\", ",
            "\"arguments\": ",
            "\"parameters\": ",
            "{",
            "}",
            "[",
            "]",
            "\"",
            "\\",
            "\\u00e9",
            ",",
            ":",
            " ",
            "\n",
            "1",
            "-",
            "true",
            "x",
            "é",
            "😀",
            "\"a\"",
            "<",
            "/",
        ];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Mistral,
            ToolFormat::Llama3Json,
        ] {
            let spec = spec(true, Some(format));
            let mut calls = 0;
            for _ in 0..2000 {
                let mut soup = |n: u64| -> String {
                    (0..(next() % n))
                        .map(|_| atoms[(next() % atoms.len() as u64) as usize])
                        .collect()
                };
                // Mostly a plausible call with random arguments, sometimes pure soup.
                let opener = match format {
                    ToolFormat::Hermes => "<tool_call>\n",
                    ToolFormat::Mistral => "[TOOL_CALLS][",
                    ToolFormat::Llama3Json => "",
                };
                let lead = if format == ToolFormat::Llama3Json {
                    String::new()
                } else {
                    soup(4)
                };
                let args = soup(14);
                let tail = soup(6);
                let text = match next() % 4 {
                    0 => format!("{lead}{opener}{{\"name\": \"f\", \"arguments\": {{{args}"),
                    1 => format!(
                        "{lead}{opener}{{\"arguments\": {{{args}}}, \"name\": \"g\"}}{tail}"
                    ),
                    2 => format!(
                        "{lead}{opener}{{\"name\": \"f\", \"arguments\": {{\"a\": {args}}}}}{tail}"
                    ),
                    _ => format!("{lead}{args}{tail}"),
                };
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
                let mut chunks = Vec::new();
                let mut rest = text.as_str();
                while !rest.is_empty() {
                    let mut at = (1 + (next() % 7) as usize).min(rest.len());
                    while !rest.is_char_boundary(at) {
                        at += 1;
                    }
                    let (a, b) = rest.split_at(at);
                    chunks.push(a);
                    rest = b;
                }
                let (a, pa) = run(spec.clone(), "", &by_char);
                let (b, pb) = run(spec.clone(), "", &chunks);
                assert_eq!(a, b, "{text:?} {chunks:?}");
                assert_eq!(
                    (pa.tool_calls(), pa.truncated()),
                    (pb.tool_calls(), pb.truncated())
                );
                calls += pa.tool_calls();
                let mut args: Option<String> = None;
                for (kind, piece) in &a {
                    match kind {
                        ToolStart => args = Some(String::new()),
                        ToolArgs => args.as_mut().expect("args inside a call").push_str(piece),
                        ToolEnd => {
                            let json = args.take().expect("end inside a call");
                            let value: serde_json::Value = serde_json::from_str(&json)
                                .unwrap_or_else(|e| panic!("{text:?}: {json:?}: {e}"));
                            assert!(value.is_object(), "{text:?}: {json:?}");
                        }
                        Text | Thinking => assert!(args.is_none(), "{text:?}"),
                    }
                }
                assert!(args.is_none(), "every call ends: {text:?}");
            }
            assert!(calls > 50, "{format:?}: the soup must make calls ({calls})");
        }
    }

    #[test]
    fn partial_len_finds_longest_tag_prefix() {
        assert_eq!(partial_len("ab<too", "<tool_call>"), 4);
        assert_eq!(partial_len("<", "<tool_call>"), 1);
        assert_eq!(partial_len("x", "<tool_call>"), 0);
        assert_eq!(partial_len("<tool_call>", "<tool_call>"), 0);
    }
}
