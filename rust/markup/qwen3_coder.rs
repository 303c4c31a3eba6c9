//! Qwen3-Coder / Qwen3.5 tool calls: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n</tool_call>`; the parser seed_oss and minimax_m2 share.

use std::sync::Arc;

use super::hermes;
use super::schema::ToolSchemas;
use super::tags::{prefix, push_capped, unquote, ws_len, Prefix};
use super::xml_params::{ValueEnd, XmlArgs};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "qwen3_coder",
    opener: Opener::Tag("<tool_call>"),
    tags: &["<tool_call>", "</tool_call>"],
    region: |tools| Box::new(FunctionXml::new(&TAGS, tools)),
};

pub(super) static TAGS: XmlTags = XmlTags {
    call: "<function=",
    call_end: "</function>",
    param: "<parameter=",
    param_end: "</parameter>",
    close: "</tool_call>",
    json_fallback: true,
};

/// The tags of one function/parameter XML dialect.
#[derive(Debug)]
pub(super) struct XmlTags {
    /// Opens a call; the name follows, up to `>` (quotes around it are dropped).
    pub call: &'static str,
    pub call_end: &'static str,
    /// Opens a parameter; the key follows, up to `>`.
    pub param: &'static str,
    pub param_end: &'static str,
    /// Ends the region.
    pub close: &'static str,
    /// A JSON object where a call should open is read as a Hermes call (Qwen models trained on
    /// both write either after `<tool_call>`).
    pub json_fallback: bool,
}

#[derive(Debug)]
enum State {
    /// Expecting a call's opening tag.
    Open,
    /// Reading the name up to `>`.
    Name,
    /// Between parameters.
    Body,
    /// Reading a parameter key up to `>`.
    Key,
    Value,
    /// After a call's end tag: the region's close, or another call.
    After,
    /// A Hermes JSON call in place of the XML one.
    Json(Box<dyn ToolRegion>),
}

/// A region of calls written as function/parameter XML, parameters typed by the tool schemas.
#[derive(Debug)]
pub(super) struct FunctionXml {
    tags: &'static XmlTags,
    tools: Arc<ToolSchemas>,
    state: State,
    /// The current call's name (being read, then kept for schema lookups).
    name: String,
    key: String,
    args: XmlArgs,
}

impl FunctionXml {
    pub(super) fn new(tags: &'static XmlTags, tools: &Arc<ToolSchemas>) -> Self {
        Self {
            tags,
            tools: tools.clone(),
            state: State::Open,
            name: String::new(),
            key: String::new(),
            args: XmlArgs::default(),
        }
    }

    fn end_call(&mut self, complete: bool, out: &mut ToolOut<'_>) {
        self.args.end_call(complete, out);
        self.state = State::After;
    }
}

impl ToolRegion for FunctionXml {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let tags = self.tags;
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match &mut self.state {
                State::Json(region) => return region.feed(rest, out).after(pos),
                State::Open => {
                    pos += ws_len(rest);
                    let body = &input[pos..];
                    if body.is_empty() {
                        return Step::More(pos);
                    }
                    match prefix(body, &[tags.call]) {
                        Prefix::Tag(_) => {
                            pos += tags.call.len();
                            self.name.clear();
                            self.state = State::Name;
                        }
                        Prefix::Partial => return Step::More(pos),
                        Prefix::None if tags.json_fallback && body.starts_with('{') => {
                            self.state = State::Json((hermes::SYNTAX.region)(&self.tools));
                        }
                        Prefix::None => return Step::Invalid(pos),
                    }
                }
                State::Name => {
                    let Some(at) = rest.find(['>', '<', '\n']) else {
                        push_capped(&mut self.name, rest);
                        return Step::More(input.len());
                    };
                    push_capped(&mut self.name, &rest[..at]);
                    let name = unquote(&self.name);
                    if rest.as_bytes()[at] != b'>' || name.is_empty() {
                        return Step::Invalid(pos + at);
                    }
                    pos += at + 1;
                    out.start(name);
                    self.name = name.to_owned();
                    self.state = State::Body;
                }
                State::Body => {
                    let Some(at) = rest.find('<') else {
                        // Whitespace (or stray text) between parameters is not part of the call.
                        return Step::More(input.len());
                    };
                    pos += at;
                    let body = &input[pos..];
                    match prefix(body, &[tags.param, tags.call_end, tags.close]) {
                        Prefix::Tag(0) => {
                            pos += tags.param.len();
                            self.key.clear();
                            self.state = State::Key;
                        }
                        Prefix::Tag(1) => {
                            pos += tags.call_end.len();
                            self.end_call(true, out);
                        }
                        Prefix::Tag(_) => {
                            // The call's end tag is missing: the region's close ends it too.
                            self.end_call(true, out);
                            return Step::End(pos + tags.close.len());
                        }
                        Prefix::Partial => return Step::More(pos),
                        Prefix::None => pos += 1,
                    }
                }
                State::Key => {
                    let Some(at) = rest.find('>') else {
                        push_capped(&mut self.key, rest);
                        return Step::More(input.len());
                    };
                    push_capped(&mut self.key, &rest[..at]);
                    pos += at + 1;
                    let key = unquote(&self.key);
                    self.args.key(key, self.tools.param(&self.name, key), out);
                    self.state = State::Value;
                }
                State::Value => {
                    // A missing parameter end tag is ended by the next parameter or the call's end.
                    let ends = [tags.param_end, tags.param, tags.call_end, tags.close];
                    match self.args.value_until(rest, &ends, out) {
                        ValueEnd::Tag { at, index } => {
                            pos += at;
                            if index == 0 {
                                pos += tags.param_end.len();
                            }
                            self.state = State::Body;
                        }
                        ValueEnd::More(taken) => return Step::More(pos + taken),
                    }
                }
                State::After => {
                    pos += ws_len(rest);
                    let body = &input[pos..];
                    if body.is_empty() {
                        return Step::More(pos);
                    }
                    return match prefix(body, &[tags.close, tags.call]) {
                        Prefix::Tag(0) => Step::End(pos + tags.close.len()),
                        Prefix::Tag(_) => {
                            self.state = State::Open;
                            Step::CallStart(pos)
                        }
                        Prefix::Partial => Step::More(pos),
                        Prefix::None => Step::End(pos),
                    };
                }
            }
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        match &mut self.state {
            State::Json(region) => region.finish(out),
            State::Body => self.end_call(true, out),
            State::Key | State::Value => self.end_call(false, out),
            State::Open | State::Name | State::After => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::schema::ToolSchemas;
    use crate::markup::tests::{
        all_splits, check_splits_and_truncation, p, pieces_by_chunk, run, run_with, spec,
    };
    use crate::markup::MarkupParser;
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    fn tools() -> Arc<ToolSchemas> {
        Arc::new(ToolSchemas::new(&[
            (
                "Bash",
                r#"{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"},"run_in_background":{"type":"boolean"}}}"#,
            ),
            (
                "Edit",
                r#"{"type":"object","properties":{"file_path":{"type":"string"},"edits":{"type":"array"},"count":{"type":"string"}}}"#,
            ),
        ]))
    }

    const TWO_CALLS: &str = "I'll check.\n\n<tool_call>\n<function=Bash>\n<parameter=command>\necho \"<b>\" </p> && ls é😀\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=Edit>\n<parameter=file_path>\n/a/b.rs\n</parameter>\n<parameter=edits>\n[{\"old\": \"x < y\", \"new\": {\"n\": [1, 2]}}]\n</parameter>\n<parameter=count>\n3\n</parameter>\n<parameter=extra>\nfree\ntext\n\n</parameter>\n</function>\n</tool_call>\nDone.";

    fn two_calls_want() -> Vec<(crate::markup::PieceKind, String)> {
        vec![
            p(Text, "I'll check."),
            p(ToolStart, "Bash"),
            p(
                ToolArgs,
                r#"{"command":"echo \"<b>\" </p> && ls é😀","timeout":30}"#,
            ),
            p(ToolEnd, ""),
            p(ToolStart, "Edit"),
            p(
                ToolArgs,
                r#"{"file_path":"/a/b.rs","edits":[{"old":"x < y","new":{"n":[1,2]}}],"count":"3","extra":"free\ntext\n"}"#,
            ),
            p(ToolEnd, ""),
            p(Text, "Done."),
        ]
    }

    #[test]
    fn qwen3_coder_calls_typed_by_schema_any_split() {
        let tools = tools();
        for chunks in all_splits(TWO_CALLS, 40) {
            let (got, parser) = run_with(spec(true, Some("qwen3_coder")), &tools, "", &chunks);
            assert_eq!(got, two_calls_want(), "{chunks:?}");
            assert_eq!((parser.tool_calls(), parser.truncated()), (2, false));
        }
    }

    #[test]
    fn qwen3_coder_every_split_and_truncation_is_well_formed() {
        check_splits_and_truncation(&spec(true, Some("qwen3_coder")), &tools(), TWO_CALLS);
    }

    #[test]
    fn qwen3_coder_without_schemas_writes_strings() {
        let text = "<tool_call>\n<function=Bash>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>";
        let (got, _) = run(spec(false, Some("qwen3_coder")), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "Bash"),
                p(ToolArgs, r#"{"timeout":"30"}"#),
                p(ToolEnd, "")
            ]
        );
    }

    #[test]
    fn qwen3_coder_string_values_stream_as_written() {
        let mut parser = MarkupParser::new(spec(false, Some("qwen3_coder")), tools());
        let seen = pieces_by_chunk(
            &mut parser,
            &[
                "<tool_call>\n<function=Bash>\n<parameter=command>\n",
                "echo 1",
                "\n",
                "echo 2 <",
                "/x> </para",
                "meter>\n</function>",
            ],
        );
        assert_eq!(
            seen,
            [
                "ToolStart:Bash ToolArgs:{\"command\":\"",
                "ToolArgs:echo 1",
                "",
                "ToolArgs:\\necho 2 ",
                "ToolArgs:</x> ",
                "ToolArgs:\"} ToolEnd:",
            ]
        );
    }

    #[test]
    fn qwen3_coder_missing_end_tags_and_think() {
        let text = "<think>plan</think>\n<tool_call>\n<function=Bash>\n<parameter=command>\nls\n<parameter=timeout>\n5\n</function>\n</tool_call>";
        for chunks in all_splits(text, 9) {
            let (got, _) = run_with(spec(true, Some("qwen3_coder")), &tools(), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(Thinking, "plan"),
                    p(ToolStart, "Bash"),
                    p(ToolArgs, r#"{"command":"ls","timeout":5}"#),
                    p(ToolEnd, "")
                ]
            );
        }
    }

    #[test]
    fn qwen3_coder_accepts_hermes_json() {
        let text =
            "<tool_call>\n{\"name\": \"Bash\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call>";
        let (got, _) = run(spec(false, Some("qwen3_coder")), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "Bash"),
                p(ToolArgs, r#"{"command": "ls"}"#),
                p(ToolEnd, "")
            ]
        );
    }

    #[test]
    fn qwen3_coder_prefilled_forced_call() {
        let (got, _) = run_with(
            spec(false, Some("qwen3_coder")),
            &tools(),
            "<tool_call>\n<function=Bash>\n",
            &["<parameter=timeout>\n", "7\n</parameter>\n</function>"],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "Bash"),
                p(ToolArgs, r#"{"timeout":7}"#),
                p(ToolEnd, "")
            ]
        );
    }

    #[test]
    fn qwen3_coder_broken_before_name_is_text() {
        for text in [
            "see <tool_call> here",
            "see <tool_call><function=a b\nc",
            "see <tool_call>\n<function=<x>",
        ] {
            for chunks in all_splits(text, 5) {
                let (got, parser) = run(spec(false, Some("qwen3_coder")), "", &chunks);
                assert_eq!(got, vec![p(Text, text)], "{chunks:?}");
                assert_eq!(parser.tool_calls(), 0);
            }
        }
    }
}
