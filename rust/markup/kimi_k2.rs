//! Kimi K2 tool calls: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; the section parser deepseek_v3 shares.

use super::json_args::CallArgs;
use super::tags::push_capped;
use super::tags::{find_first, prefix, safe_len, ws_len, Prefix};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "kimi_k2",
    opener: Opener::Tag("<|tool_calls_section_begin|>"),
    tags: &[
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
    region: |_| Box::new(Sectioned::new(&TAGS)),
};

static TAGS: SectionTags = SectionTags {
    call: "<|tool_call_begin|>",
    sep: "<|tool_call_argument_begin|>",
    call_end: "<|tool_call_end|>",
    section_end: "<|tool_calls_section_end|>",
    name: kimi_name,
    fenced: false,
};

/// `functions.NAME:IDX` to `NAME`.
fn kimi_name(id: &str) -> &str {
    let name = id.strip_prefix("functions.").unwrap_or(id);
    match name.rsplit_once(':') {
        Some((name, index)) if index.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => name,
    }
}

/// The tags of a section of calls, each `CALL name SEP {arguments} CALL_END`.
#[derive(Debug)]
pub(super) struct SectionTags {
    pub call: &'static str,
    pub sep: &'static str,
    pub call_end: &'static str,
    pub section_end: &'static str,
    /// The tool's name from what the model wrote before `sep`.
    pub name: fn(&str) -> &str,
    /// DeepSeek V3's older form: `function SEP NAME\n```json\n{…}\n``` CALL_END`.
    pub fenced: bool,
}

/// Names longer than this are not names.
const MAX_NAME: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Between calls: another call, or the section's end.
    Section,
    /// At a call's opening tag (a new call was reported).
    CallOpen,
    Name,
    /// DeepSeek V3: after `function` and the separator, the name or (V3.1) the arguments.
    FencedPeek,
    FencedName,
    Args,
    /// After the arguments (broken ones ended the call), up to the call's end (a closing fence
    /// is skipped).
    ArgsDone,
}

#[derive(Debug)]
pub(super) struct Sectioned {
    tags: &'static SectionTags,
    state: State,
    name: String,
    args: CallArgs,
}

impl Sectioned {
    pub(super) fn new(tags: &'static SectionTags) -> Self {
        Self {
            tags,
            state: State::Section,
            name: String::new(),
            args: CallArgs::default(),
        }
    }

    fn start(&mut self, name: &str, out: &mut ToolOut<'_>) -> bool {
        if name.is_empty() {
            return false;
        }
        out.start(name);
        self.args = CallArgs::default();
        self.state = State::Args;
        true
    }
}

impl ToolRegion for Sectioned {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let tags = self.tags;
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match self.state {
                State::Section => {
                    pos += ws_len(rest);
                    let body = &input[pos..];
                    if body.is_empty() {
                        return Step::More(pos);
                    }
                    return match prefix(body, &[tags.call, tags.section_end]) {
                        Prefix::Tag(0) => {
                            self.state = State::CallOpen;
                            Step::CallStart(pos)
                        }
                        Prefix::Tag(_) => Step::End(pos + tags.section_end.len()),
                        Prefix::Partial => Step::More(pos),
                        Prefix::None => Step::End(pos),
                    };
                }
                State::CallOpen => {
                    pos += tags.call.len();
                    self.name.clear();
                    self.state = State::Name;
                }
                State::Name => {
                    let (at, found) = match find_first(rest, &[tags.sep]) {
                        Some((at, _)) => (at, true),
                        None => (safe_len(rest, &[tags.sep]), false),
                    };
                    if self.name.len() + at > MAX_NAME {
                        return Step::Invalid(pos);
                    }
                    self.name.push_str(&rest[..at]);
                    pos += at;
                    if !found {
                        return Step::More(pos);
                    }
                    pos += tags.sep.len();
                    let raw = self.name.trim();
                    if tags.fenced && raw == "function" {
                        self.state = State::FencedPeek;
                        continue;
                    }
                    let name = (tags.name)(raw).to_owned();
                    if !self.start(&name, out) {
                        return Step::Invalid(pos);
                    }
                }
                State::FencedPeek => {
                    pos += ws_len(rest);
                    let body = &input[pos..];
                    if body.is_empty() {
                        return Step::More(pos);
                    }
                    if body.starts_with('{') {
                        self.start("function", out);
                    } else {
                        self.name.clear();
                        self.state = State::FencedName;
                    }
                }
                State::FencedName => {
                    let Some(at) = rest.find(['\n', '<']) else {
                        push_capped(&mut self.name, rest);
                        return Step::More(input.len());
                    };
                    push_capped(&mut self.name, &rest[..at]);
                    let name = self.name.trim().to_owned();
                    if rest.as_bytes()[at] == b'<' || !self.start(&name, out) {
                        return Step::Invalid(pos + at);
                    }
                    pos += at;
                }
                State::Args => {
                    let (used, over) = self.args.feed(rest, out);
                    pos += used;
                    if !over {
                        return Step::More(pos);
                    }
                    self.state = State::ArgsDone;
                }
                State::ArgsDone => {
                    let ends = [tags.call_end, tags.section_end];
                    let Some((at, index)) = find_first(rest, &ends) else {
                        return Step::More(pos + safe_len(rest, &ends));
                    };
                    self.args.end(out);
                    pos += at;
                    if index == 0 {
                        pos += tags.call_end.len();
                        self.state = State::Section;
                    } else {
                        self.state = State::Section;
                        return Step::End(pos + tags.section_end.len());
                    }
                }
            }
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        if matches!(self.state, State::Args | State::ArgsDone) {
            self.args.end(out);
        }
        self.state = State::Section;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::tests::{check_calls_any_split, p, run, spec};
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn kimi_k2_section_of_calls_any_split() {
        let text = "<think>Both.</think>Let me look. <|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"北京 <|x\"}<|tool_call_end|>\n<|tool_call_begin|>functions.web.search:1 <|tool_call_argument_begin|> {\"q\": {\"a\": [true]}} <|tool_call_end|><|tool_calls_section_end|>";
        let want = vec![
            p(Thinking, "Both."),
            p(Text, "Let me look."),
            p(ToolStart, "get_weather"),
            p(ToolArgs, "{\"city\": \"北京 <|x\"}"),
            p(ToolEnd, ""),
            p(ToolStart, "web.search"),
            p(ToolArgs, "{\"q\": {\"a\": [true]}}"),
            p(ToolEnd, ""),
        ];
        let spec = spec(true, Some("kimi_k2"));
        check_calls_any_split(&spec, &Arc::default(), text, 30, &want, 2);
    }

    #[test]
    fn kimi_k2_broken_arguments_end_the_call() {
        let text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1,, 2}<|tool_call_end|><|tool_calls_section_end|>after";
        let (got, parser) = run(spec(false, Some("kimi_k2")), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"a\": 1,\"\":null}"),
                p(ToolEnd, ""),
                p(Text, "after")
            ]
        );
        assert!(parser.truncated());
    }
}
