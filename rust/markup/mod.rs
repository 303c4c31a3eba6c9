//! Streaming markup parser: splits model text into visible text, thinking and tool calls, holding back split tags.

use std::fmt;
use std::sync::Arc;

use crate::error::CoreError;
use crate::stop::find;

mod deepseek_v3;
mod glm;
mod harmony;
mod hermes;
mod json_args;
mod json_call;
mod json_list;
mod kimi_k2;
mod llama3_json;
mod minimax_m2;
mod mistral;
mod mistral_v11;
mod qwen3_coder;
mod schema;
mod seed_oss;
mod tags;
mod xml_params;

pub use schema::{ToolSchemas, Types};

/// Every tool-call format, by the name a model is configured with: the one list of them (the
/// prompt side, `python/mlxgate/formats/<name>.py`, is found by these names). A new format is a
/// module above and one line here.
///
/// In the order chat templates are matched against them: the specific markers first (GLM,
/// Qwen3-Coder and Hermes templates all contain `<tool_call>`, Mistral v11 and older Mistral
/// templates `[TOOL_CALLS]`, Seed-OSS and Qwen3-Coder `<function=`), Hermes, the fallback, last.
static FORMATS: &[&ToolSyntax] = &[
    &harmony::SYNTAX,
    &kimi_k2::SYNTAX,
    &deepseek_v3::SYNTAX,
    &minimax_m2::SYNTAX,
    &seed_oss::SYNTAX,
    &mistral_v11::SYNTAX,
    &mistral::SYNTAX,
    &glm::SYNTAX,
    &qwen3_coder::SYNTAX,
    &llama3_json::SYNTAX,
    &hermes::SYNTAX,
];

/// The names of the tool-call formats [`MarkupSpec::new`] accepts.
pub fn format_names() -> impl ExactSizeIterator<Item = &'static str> {
    FORMATS.iter().map(|syntax| syntax.name)
}

fn syntax_named(name: &str) -> Result<&'static ToolSyntax, CoreError> {
    FORMATS
        .iter()
        .copied()
        .find(|syntax| syntax.name == name)
        .ok_or_else(|| CoreError::UnknownToolFormat {
            name: name.to_owned(),
            known: format_names().collect(),
        })
}

/// A tool-call format: its name, where its markup starts, and the state that parses the markup.
#[derive(Debug)]
pub struct ToolSyntax {
    pub name: &'static str,
    pub opener: Opener,
    /// Every tag the format writes. Where the vocab has one as a special token (rendered to
    /// nothing elsewhere), streams with this markup render it so the parser sees it.
    pub tags: &'static [&'static str],
    /// A fresh state for one region of markup, entered just after the opener, typing parameters
    /// by the request's tool schemas.
    pub region: fn(&Arc<ToolSchemas>) -> Box<dyn ToolRegion>,
}

/// Where a format's tool markup starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opener {
    /// A tag anywhere in visible text; the region starts after it.
    Tag(&'static str),
    /// The reply's first non-whitespace byte, if it is this one; the region starts at it.
    ReplyStart(u8),
    /// The whole reply is one region (harmony's channels): it writes text and thinking too,
    /// never ends, and handles its own malformed markup.
    Whole,
}

/// The state of one region of tool-call markup in one stream, from its opener to its end: one
/// call, or several with [`Step::CallStart`] between them. The driver keeps the text fallback
/// and the call count; a region only parses and writes calls through [`ToolOut`].
pub trait ToolRegion: fmt::Debug + Send {
    /// Consumes markup from `input`, writing calls to `out`, until the driver must act.
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step;

    /// Generation ended, or the markup broke after a call committed: ends the call left open, if
    /// any, with valid arguments JSON.
    fn finish(&mut self, out: &mut ToolOut<'_>);
}

/// Where [`ToolRegion::feed`] stopped, as a byte position in its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Needs more input. The rest after the position, if any, is held back (a possible partial
    /// token) and fed again.
    More(usize),
    /// A new call starts here. The markup before it is spent: should this call break before its
    /// name, only its own markup comes back as text.
    CallStart(usize),
    /// The region ended here; text follows, its leading whitespace trimmed.
    End(usize),
    /// The markup cannot continue here. An uncommitted call's markup comes back as text, a
    /// committed one is ended by [`ToolRegion::finish`]; text follows as written.
    Invalid(usize),
}

impl Step {
    /// The same step in an input that starts `offset` bytes earlier: the step of a region nested
    /// in another (a format that reads another format's calls in its place), as the outer reports it.
    fn after(self, offset: usize) -> Step {
        match self {
            Step::More(n) => Step::More(offset + n),
            Step::CallStart(n) => Step::CallStart(offset + n),
            Step::End(n) => Step::End(offset + n),
            Step::Invalid(n) => Step::Invalid(offset + n),
        }
    }
}

/// Where a tool region writes its calls: the stream's pieces, with the parser's call count.
pub struct ToolOut<'a> {
    pieces: &'a mut Pieces,
    book: &'a mut CallBook,
}

impl ToolOut<'_> {
    /// A call begins. It is committed: its markup can no longer come back as text.
    pub fn start(&mut self, name: &str) {
        self.book.committed = true;
        self.pieces.push(PieceKind::ToolStart, name);
    }

    pub fn args(&mut self, fragment: &str) {
        self.pieces.push(PieceKind::ToolArgs, fragment);
    }

    pub fn args_with<R>(&mut self, f: impl FnOnce(&mut String) -> R) -> R {
        self.pieces.push_with(PieceKind::ToolArgs, f)
    }

    /// Visible text, for a region that spans the whole reply ([`Opener::Whole`]).
    pub fn text(&mut self, text: &str) {
        self.pieces.push(PieceKind::Text, text);
    }

    /// Reasoning, for a region that spans the whole reply ([`Opener::Whole`]).
    pub fn thinking(&mut self, text: &str) {
        self.pieces.push(PieceKind::Thinking, text);
    }

    /// The call ends; `args_complete` is false if its arguments had to be closed artificially.
    pub fn end(&mut self, args_complete: bool) {
        self.book.calls += 1;
        self.book.truncated |= !args_complete;
        self.pieces.push(PieceKind::ToolEnd, "");
    }
}

#[derive(Debug, Default)]
struct CallBook {
    calls: u32,
    truncated: bool,
    /// The current call (or the last one, between calls) has emitted its name.
    committed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Tag {
    Think,
    Tool(&'static ToolSyntax),
}

/// A model's markup, configured once per model and shared by its streams.
#[derive(Debug, Clone)]
pub struct MarkupSpec {
    think: Option<(String, String)>,
    tool_call: Option<&'static ToolSyntax>,
    /// Tags that open markup in visible text.
    open_tags: Vec<(String, Tag)>,
    /// Their first bytes: text without any of them cannot hold (part of) a tag.
    tag_starts: Vec<u8>,
    /// Every tag of the think pair and the tool format: special tokens with these texts render.
    tags: Vec<String>,
}

impl MarkupSpec {
    /// `tool_call` names a format from [`format_names`].
    pub fn new(
        think: Option<(String, String)>,
        tool_call: Option<&str>,
    ) -> Result<Self, CoreError> {
        let tool_call = tool_call.map(syntax_named).transpose()?;
        let mut open_tags = Vec::new();
        if let Some((open, close)) = &think {
            if open.is_empty() || close.is_empty() {
                return Err(CoreError::EmptyThinkTag);
            }
            open_tags.push((open.clone(), Tag::Think));
        }
        if let Some(syntax) = tool_call {
            if let Opener::Tag(tag) = syntax.opener {
                open_tags.push((tag.to_owned(), Tag::Tool(syntax)));
            }
        }
        let mut tag_starts: Vec<u8> = open_tags.iter().map(|(tag, _)| tag.as_bytes()[0]).collect();
        tag_starts.sort_unstable();
        tag_starts.dedup();
        let mut tags: Vec<String> = tool_call
            .iter()
            .flat_map(|syntax| syntax.tags.iter().map(|tag| (*tag).to_owned()))
            .collect();
        if let Some((open, close)) = &think {
            tags.extend([open.clone(), close.clone()]);
        }
        Ok(Self {
            think,
            tool_call,
            open_tags,
            tag_starts,
            tags,
        })
    }

    /// True if a special token with this text is one of the markup's tags, so it must reach the
    /// parser although the vocab renders special tokens to nothing.
    pub fn renders_special(&self, text: &[u8]) -> bool {
        self.tags.iter().any(|tag| tag.as_bytes() == text)
    }

    pub fn think(&self) -> Option<(&str, &str)> {
        self.think.as_ref().map(|(o, c)| (o.as_str(), c.as_str()))
    }

    /// The tool-call format's name.
    pub fn tool_call(&self) -> Option<&'static str> {
        self.tool_call.map(|syntax| syntax.name)
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

#[derive(Debug)]
enum Mode {
    Text,
    Think,
    Tool(Box<dyn ToolRegion>),
}

/// Per-stream markup state.
///
/// Whitespace is trimmed where markup meets text: leading whitespace of each text or thinking run
/// after markup, and trailing whitespace of a run that markup ends (so `text\n\n<tool_call>` gives
/// the text block `text`). Thinking also drops its leading whitespace.
#[derive(Debug)]
pub struct MarkupParser {
    spec: Arc<MarkupSpec>,
    tools: Arc<ToolSchemas>,
    mode: Mode,
    /// Input not yet consumed: a possible partial tag.
    carry: String,
    /// The markup of a call not yet committed (name unknown), emitted as text if it goes bad.
    raw: String,
    book: CallBook,
    held_ws: String,
    skip_ws: bool,
    /// Nothing visible yet, so a format that opens at the reply's start may still open.
    at_start: bool,
    /// The whole reply is the tool format's region ([`Opener::Whole`]).
    whole: bool,
}

impl MarkupParser {
    /// `tools` types the parameters of formats that write them as text (the XML formats).
    pub fn new(spec: Arc<MarkupSpec>, tools: Arc<ToolSchemas>) -> Self {
        let opener = spec.tool_call.map(|syntax| syntax.opener);
        let opens_at_start = matches!(opener, Some(Opener::ReplyStart(_)));
        let whole = opener == Some(Opener::Whole);
        let mode = match spec.tool_call {
            Some(syntax) if whole => Mode::Tool((syntax.region)(&tools)),
            _ => Mode::Text,
        };
        Self {
            spec,
            tools,
            mode,
            carry: String::new(),
            raw: String::new(),
            book: CallBook::default(),
            held_ws: String::new(),
            skip_ws: opens_at_start,
            at_start: opens_at_start,
            whole,
        }
    }

    pub fn spec(&self) -> &MarkupSpec {
        &self.spec
    }

    /// Tool calls started so far (complete or not).
    pub fn tool_calls(&self) -> u32 {
        self.book.calls
    }

    /// True if some call's arguments had to be completed artificially (generation cut it short).
    pub fn truncated(&self) -> bool {
        self.book.truncated
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
        match &mut self.mode {
            Mode::Text => self.visible(&carry, out),
            Mode::Think => {
                self.visible(&carry, out);
                self.held_ws.clear();
            }
            Mode::Tool(region) if self.book.committed || self.whole => {
                region.finish(&mut ToolOut {
                    pieces: out,
                    book: &mut self.book,
                })
            }
            Mode::Tool(_) => {
                self.mode = Mode::Text;
                let raw = std::mem::take(&mut self.raw);
                self.visible(&raw, out);
                self.visible(&carry, out);
            }
        }
        if matches!(self.mode, Mode::Text) && !self.held_ws.is_empty() {
            out.push(PieceKind::Text, &self.held_ws);
            self.held_ws.clear();
        }
    }

    /// Returns how many bytes of `input` were consumed; the rest is a possible partial tag.
    fn process(&mut self, input: &str, out: &mut Pieces) -> usize {
        let mut pos = 0;
        while pos < input.len() {
            let rest = &input[pos..];
            match &mut self.mode {
                Mode::Text => {
                    if self.at_start {
                        let body = rest.trim_start();
                        pos += rest.len() - body.len();
                        if body.is_empty() {
                            break;
                        }
                        self.at_start = false;
                        if let Some(syntax) = self.spec.tool_call {
                            if syntax.opener == Opener::ReplyStart(body.as_bytes()[0]) {
                                self.raw.clear();
                                self.open_region(syntax);
                            }
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
                Mode::Tool(region) => {
                    let step = region.feed(
                        rest,
                        &mut ToolOut {
                            pieces: out,
                            book: &mut self.book,
                        },
                    );
                    match step {
                        Step::More(used) => {
                            self.keep_raw(&rest[..used]);
                            pos += used;
                            if used < rest.len() {
                                break;
                            }
                        }
                        Step::CallStart(at) => {
                            self.raw.clear();
                            self.book.committed = false;
                            pos += at;
                        }
                        Step::End(at) => {
                            self.raw.clear();
                            pos += at;
                            self.end_run();
                            self.mode = Mode::Text;
                        }
                        Step::Invalid(at) => {
                            self.keep_raw(&rest[..at]);
                            pos += at;
                            self.markup_broke(out);
                        }
                    }
                }
            }
        }
        pos
    }

    fn open_region(&mut self, syntax: &ToolSyntax) {
        self.book.committed = false;
        self.mode = Mode::Tool((syntax.region)(&self.tools));
    }

    fn enter(&mut self, tag: Tag, text: &str) {
        // Whitespace before a tool call comes back with its markup if the call turns out bad.
        let held = std::mem::take(&mut self.held_ws);
        self.end_run();
        match tag {
            Tag::Think => self.mode = Mode::Think,
            Tag::Tool(syntax) => {
                self.raw.clear();
                self.raw.push_str(&held);
                self.raw.push_str(text);
                self.open_region(syntax);
            }
        }
        self.held_ws = held;
        self.held_ws.clear();
    }

    /// Keeps consumed markup for the text fallback while the call is uncommitted.
    fn keep_raw(&mut self, markup: &str) {
        if self.book.committed || self.whole {
            self.raw.clear();
        } else {
            self.raw.push_str(markup);
        }
    }

    /// The markup broke at the current input position. Before the call's name was known it
    /// becomes plain text; after, its arguments are closed validly. Text resumes as written.
    fn markup_broke(&mut self, out: &mut Pieces) {
        let mode = std::mem::replace(&mut self.mode, Mode::Text);
        if self.book.committed {
            if let Mode::Tool(mut region) = mode {
                region.finish(&mut ToolOut {
                    pieces: out,
                    book: &mut self.book,
                });
            }
            self.end_run();
            self.skip_ws = false;
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
        let kind = if matches!(self.mode, Mode::Think) {
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
pub(super) fn partial_len(text: &str, tag: &str) -> usize {
    let (text, tag) = (text.as_bytes(), tag.as_bytes());
    let from = text.len() - (tag.len().saturating_sub(1)).min(text.len());
    (from..text.len())
        .find(|&at| text[at] == tag[0] && tag.starts_with(&text[at..]))
        .map_or(0, |at| text.len() - at)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn spec(think: bool, tool: Option<&str>) -> Arc<MarkupSpec> {
        let think = think.then(|| ("<think>".to_owned(), "</think>".to_owned()));
        Arc::new(MarkupSpec::new(think, tool).unwrap())
    }

    /// A parser for `spec` with no tool schemas.
    pub(super) fn parser(spec: Arc<MarkupSpec>) -> MarkupParser {
        MarkupParser::new(spec, Arc::default())
    }

    /// Feeds chunks; returns the pieces (merged across chunks) as (kind, text) pairs.
    pub(super) fn run(
        spec: Arc<MarkupSpec>,
        prefill: &str,
        chunks: &[&str],
    ) -> (Vec<(PieceKind, String)>, MarkupParser) {
        run_with(spec, &Arc::default(), prefill, chunks)
    }

    /// As [`run`], with tool schemas.
    pub(super) fn run_with(
        spec: Arc<MarkupSpec>,
        tools: &Arc<ToolSchemas>,
        prefill: &str,
        chunks: &[&str],
    ) -> (Vec<(PieceKind, String)>, MarkupParser) {
        let mut parser = MarkupParser::new(spec, tools.clone());
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
    pub(super) fn all_splits(text: &str, n: usize) -> Vec<Vec<&str>> {
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

    /// Checks that `text` parses the same fed whole, one char at a time and split in two at
    /// every position, and that every prefix (generation cut anywhere) ends well-formed: each
    /// call closed, with arguments that parse as a JSON object.
    pub(super) fn check_splits_and_truncation(
        spec: &Arc<MarkupSpec>,
        tools: &Arc<ToolSchemas>,
        text: &str,
    ) {
        let (whole, _) = run_with(spec.clone(), tools, "", &[text]);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run_with(spec.clone(), tools, "", &by_char).0, whole);
        for (at, _) in text.char_indices().skip(1) {
            let (a, b) = text.split_at(at);
            let (got, _) = run_with(spec.clone(), tools, "", &[a, b]);
            assert_eq!(got, whole, "split at {at}: {a:?} | {b:?}");
            let (cut, _) = run_with(spec.clone(), tools, "", &[a]);
            assert_well_formed(&cut, a);
        }
        assert_well_formed(&whole, text);
    }

    /// Checks that `text` gives `want`, `calls` calls and none cut short, fed in chunks of every
    /// size up to `n`, and [`check_splits_and_truncation`].
    pub(super) fn check_calls_any_split(
        spec: &Arc<MarkupSpec>,
        tools: &Arc<ToolSchemas>,
        text: &str,
        n: usize,
        want: &[(PieceKind, String)],
        calls: u32,
    ) {
        for chunks in all_splits(text, n) {
            let (got, parser) = run_with(spec.clone(), tools, "", &chunks);
            assert_eq!(got, want, "{chunks:?}");
            assert_eq!((parser.tool_calls(), parser.truncated()), (calls, false));
        }
        check_splits_and_truncation(spec, tools, text);
    }

    pub(super) fn assert_well_formed(pieces: &[(PieceKind, String)], text: &str) {
        let mut args: Option<String> = None;
        for (kind, piece) in pieces {
            match kind {
                ToolStart => {
                    assert!(args.is_none(), "call inside a call: {text:?}");
                    assert!(!piece.is_empty());
                    args = Some(String::new());
                }
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

    /// Feeds `chunks` one at a time; for each, the pieces it gave as `Kind:text`, space-joined.
    pub(super) fn pieces_by_chunk(parser: &mut MarkupParser, chunks: &[&str]) -> Vec<String> {
        chunks
            .iter()
            .map(|chunk| {
                let mut out = Pieces::default();
                parser.push(chunk, &mut out);
                out.iter()
                    .map(|(k, t)| format!("{k:?}:{t}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    pub(super) fn p(kind: PieceKind, text: &str) -> (PieceKind, String) {
        (kind, text.to_owned())
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
            spec(true, Some("hermes")),
            "",
            &["a <thin", "k about <tool", "_"],
        );
        assert_eq!(got, vec![p(Text, "a <think about <tool_")]);
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
    fn prefill_forced_tool_call() {
        // The prompt ends with the call's opening (tool_choice); the reply continues it.
        let cases: [(&str, &str, &[&str]); 2] = [
            (
                "hermes",
                "<tool_call>\n{\"name\": \"Bash\", \"arguments\": ",
                &["{\"command\"", ": \"ls\"}", "}\n</tool_call>"],
            ),
            (
                "harmony",
                "<|channel|>commentary to=functions.Bash <|constrain|>json<|message|>",
                &["{\"command\"", ": \"ls\"}"],
            ),
        ];
        for (format, prefill, chunks) in cases {
            let (got, parser) = run(spec(false, Some(format)), prefill, chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "Bash"),
                    p(ToolArgs, "{\"command\": \"ls\"}"),
                    p(ToolEnd, "")
                ],
                "{format}"
            );
            assert_eq!(parser.tool_calls(), 1, "{format}");
        }
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
                let (got, parser) = run(spec(false, Some("hermes")), "", &chunks);
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
    fn tool_markup_inside_thinking_is_thinking() {
        let (got, parser) = run(
            spec(true, Some("hermes")),
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
        for (format, opener) in [
            ("hermes", "<tool_call>\n"),
            ("mistral", "[TOOL_CALLS]["),
            ("llama3_json", ""),
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
                let lead = if format == "llama3_json" {
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
                assert_well_formed(&a, &text);
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

    #[test]
    fn formats_come_from_the_registry() {
        let names: Vec<&str> = format_names().collect();
        assert_eq!(names.len(), 11);
        assert_eq!(
            names.last(),
            Some(&"hermes"),
            "the fallback is matched last"
        );
        for name in format_names() {
            let spec = MarkupSpec::new(None, Some(name)).unwrap();
            assert_eq!(spec.tool_call(), Some(name));
        }
        let err = MarkupSpec::new(None, Some("qwen")).unwrap_err().to_string();
        let listed = names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>();
        let (all_but_last, last) = listed.split_at(listed.len() - 1);
        assert_eq!(
            err,
            format!(
                "unknown tool call format \"qwen\" (expected {} or {})",
                all_but_last.join(", "),
                last[0]
            )
        );
    }
}
