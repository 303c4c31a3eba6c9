//! GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>`, one call per tag.

use std::sync::Arc;

use super::schema::ToolSchemas;
use super::tags::{find_first, prefix, push_capped, safe_len, unquote, ws_len, Prefix};
use super::xml_params::{ValueEnd, XmlArgs};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "glm",
    opener: Opener::Tag("<tool_call>"),
    tags: &["<tool_call>", CLOSE, KEY, KEY_END, VALUE, VALUE_END],
    region: |tools| Box::new(Glm::new(tools)),
};

const CLOSE: &str = "</tool_call>";
const KEY: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The name, up to a newline or the first tag (GLM-4.7 writes none).
    Name,
    Body,
    Key,
    /// After a key, expecting its value.
    AfterKey,
    Value,
}

#[derive(Debug)]
struct Glm {
    tools: Arc<ToolSchemas>,
    state: State,
    name: String,
    key: String,
    args: XmlArgs,
}

impl Glm {
    fn new(tools: &Arc<ToolSchemas>) -> Self {
        Self {
            tools: tools.clone(),
            state: State::Name,
            name: String::new(),
            key: String::new(),
            args: XmlArgs::default(),
        }
    }
}

impl ToolRegion for Glm {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match self.state {
                State::Name => {
                    let rest = if self.name.is_empty() {
                        pos += ws_len(rest);
                        &input[pos..]
                    } else {
                        rest
                    };
                    let Some(at) = rest.find(['\n', '<']) else {
                        push_capped(&mut self.name, rest);
                        return Step::More(input.len());
                    };
                    if rest.as_bytes()[at] == b'<' {
                        match prefix(&rest[at..], &[KEY, CLOSE]) {
                            Prefix::Tag(_) => {}
                            Prefix::Partial => {
                                push_capped(&mut self.name, &rest[..at]);
                                return Step::More(pos + at);
                            }
                            Prefix::None => return Step::Invalid(pos + at),
                        }
                    }
                    push_capped(&mut self.name, &rest[..at]);
                    let name = unquote(&self.name);
                    if name.is_empty() {
                        return Step::Invalid(pos + at);
                    }
                    out.start(name);
                    self.name = name.to_owned();
                    pos += at;
                    self.state = State::Body;
                }
                State::Body | State::AfterKey => {
                    let Some(at) = rest.find('<') else {
                        return Step::More(input.len());
                    };
                    pos += at;
                    match prefix(&input[pos..], &[KEY, CLOSE, VALUE]) {
                        Prefix::Tag(0) => {
                            pos += KEY.len();
                            self.key.clear();
                            self.state = State::Key;
                        }
                        Prefix::Tag(1) => {
                            self.args.end_call(true, out);
                            return Step::End(pos + CLOSE.len());
                        }
                        Prefix::Tag(_) if self.state == State::AfterKey => {
                            pos += VALUE.len();
                            let key = unquote(&self.key);
                            self.args.key(key, self.tools.param(&self.name, key), out);
                            self.state = State::Value;
                        }
                        Prefix::Partial => return Step::More(pos),
                        Prefix::Tag(_) | Prefix::None => pos += 1,
                    }
                }
                State::Key => match find_first(rest, &[KEY_END]) {
                    Some((at, _)) => {
                        push_capped(&mut self.key, &rest[..at]);
                        pos += at + KEY_END.len();
                        self.state = State::AfterKey;
                    }
                    None => {
                        let safe = safe_len(rest, &[KEY_END]);
                        push_capped(&mut self.key, &rest[..safe]);
                        return Step::More(pos + safe);
                    }
                },
                State::Value => match self.args.value_until(rest, &[VALUE_END, KEY, CLOSE], out) {
                    ValueEnd::Tag { at, index } => {
                        pos += at;
                        if index == 0 {
                            pos += VALUE_END.len();
                        }
                        self.state = State::Body;
                    }
                    ValueEnd::More(taken) => return Step::More(pos + taken),
                },
            }
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        match self.state {
            State::Name => {}
            State::Body => self.args.end_call(true, out),
            State::Key | State::AfterKey | State::Value => self.args.end_call(false, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::schema::ToolSchemas;
    use crate::markup::tests::{check_calls_any_split, p, run, spec};
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    fn tools() -> Arc<ToolSchemas> {
        Arc::new(ToolSchemas::new(&[(
            "Write",
            r#"{"properties":{"path":{"type":"string"},"lines":{"type":"integer"},"meta":{"type":"object"},"tags":{"type":"array"},"dry":{"type":"boolean"}}}"#,
        )]))
    }

    #[test]
    fn glm_calls_typed_any_split() {
        // GLM-4.5/4.6 write newlines between the tags, GLM-4.7 none.
        let text = "<think>ok</think>Writing.\n<tool_call>Write\n<arg_key>path</arg_key>\n<arg_value>/tmp/a <b>.txt</arg_value>\n<arg_key>lines</arg_key>\n<arg_value>12</arg_value>\n<arg_key>meta</arg_key>\n<arg_value>{\"k\": [\"v\", 1]}</arg_value>\n</tool_call>\n<tool_call>Write<arg_key>tags</arg_key><arg_value>[\"a\",\"ü\"]</arg_value><arg_key>dry</arg_key><arg_value>false</arg_value></tool_call>";
        let want = vec![
            p(Thinking, "ok"),
            p(Text, "Writing."),
            p(ToolStart, "Write"),
            p(
                ToolArgs,
                r#"{"path":"/tmp/a <b>.txt","lines":12,"meta":{"k":["v",1]}}"#,
            ),
            p(ToolEnd, ""),
            p(ToolStart, "Write"),
            p(ToolArgs, r#"{"tags":["a","ü"],"dry":false}"#),
            p(ToolEnd, ""),
        ];
        check_calls_any_split(&spec(true, Some("glm")), &tools(), text, 24, &want, 2);
    }

    #[test]
    fn glm_no_arguments_and_broken_name() {
        let (got, _) = run(
            spec(false, Some("glm")),
            "",
            &["<tool_call>ls\n</tool_call>"],
        );
        assert_eq!(
            got,
            vec![p(ToolStart, "ls"), p(ToolArgs, "{}"), p(ToolEnd, "")]
        );
        let (got, parser) = run(spec(false, Some("glm")), "", &["a <tool_call><b>x"]);
        assert_eq!(got, vec![p(Text, "a <tool_call><b>x")]);
        assert_eq!(parser.tool_calls(), 0);
    }
}
