//! Mistral tool calls from tokenizer v11 (Devstral, Magistral, Mistral Small 3.2): `[TOOL_CALLS]NAME[ARGS]{…}`, repeated per call.

use std::sync::Arc;

use super::json_args::{ArgsStatus, JsonArgs};
use super::schema::ToolSchemas;
use super::tags::push_capped;
use super::tags::{find_first, prefix, ws_len, Prefix};
use super::{mistral, Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "mistral_v11",
    opener: Opener::Tag("[TOOL_CALLS]"),
    tags: &["[TOOL_CALLS]", ARGS, CALL_ID],
    region: |tools| Box::new(MistralV11::new(tools)),
};

const ARGS: &str = "[ARGS]";
/// Some versions write a call id between the name and the arguments.
const CALL_ID: &str = "[CALL_ID]";

#[derive(Debug)]
enum State {
    Name,
    CallId,
    Args,
    /// The pre-v11 array (`[TOOL_CALLS][{…}]`), which the same models sometimes still write.
    Legacy(Box<dyn ToolRegion>),
}

#[derive(Debug)]
struct MistralV11 {
    tools: Arc<ToolSchemas>,
    state: State,
    name: String,
    args: JsonArgs,
}

impl MistralV11 {
    fn new(tools: &Arc<ToolSchemas>) -> Self {
        Self {
            tools: tools.clone(),
            state: State::Name,
            name: String::new(),
            args: JsonArgs::default(),
        }
    }

    fn start(&mut self, out: &mut ToolOut<'_>) -> bool {
        let name = self.name.trim();
        if name.is_empty() {
            return false;
        }
        out.start(name);
        self.state = State::Args;
        true
    }
}

impl ToolRegion for MistralV11 {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match &mut self.state {
                State::Legacy(region) => return region.feed(rest, out).after(pos),
                State::Name => {
                    if self.name.is_empty() {
                        pos += ws_len(rest);
                        let body = &input[pos..];
                        if body.is_empty() {
                            return Step::More(pos);
                        }
                        if body.starts_with(['[', '{']) && !ARGS.starts_with(body) {
                            let legacy = (mistral::SYNTAX.region)(&self.tools);
                            self.state = State::Legacy(legacy);
                            continue;
                        }
                    }
                    let rest = &input[pos..];
                    let Some(at) = rest.find(['[', '\n']) else {
                        push_capped(&mut self.name, rest);
                        return Step::More(input.len());
                    };
                    push_capped(&mut self.name, &rest[..at]);
                    if rest.as_bytes()[at] == b'\n' {
                        return Step::Invalid(pos + at);
                    }
                    pos += at;
                    match prefix(&input[pos..], &[ARGS, CALL_ID]) {
                        Prefix::Tag(0) => {
                            pos += ARGS.len();
                            if !self.start(out) {
                                return Step::Invalid(pos);
                            }
                        }
                        Prefix::Tag(_) => {
                            pos += CALL_ID.len();
                            self.state = State::CallId;
                        }
                        Prefix::Partial => return Step::More(pos),
                        Prefix::None => return Step::Invalid(pos),
                    }
                }
                State::CallId => match find_first(rest, &[ARGS]) {
                    Some((at, _)) => {
                        pos += at + ARGS.len();
                        if !self.start(out) {
                            return Step::Invalid(pos);
                        }
                    }
                    None if rest.len() > 64 => return Step::Invalid(pos),
                    None => return Step::More(pos),
                },
                State::Args => {
                    let (used, status) = self.args.feed(rest, out);
                    pos += used;
                    return match status {
                        ArgsStatus::Open => Step::More(pos),
                        ArgsStatus::Done => {
                            out.end(true);
                            Step::End(pos)
                        }
                        ArgsStatus::Invalid => Step::Invalid(pos),
                    };
                }
            }
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        match &mut self.state {
            State::Legacy(region) => region.finish(out),
            State::Args => self.args.end_call(out),
            State::Name | State::CallId => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::tests::{check_calls_any_split, p, run};
    use crate::markup::MarkupSpec;
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    fn spec() -> Arc<MarkupSpec> {
        let think = Some(("[THINK]".to_owned(), "[/THINK]".to_owned()));
        Arc::new(MarkupSpec::new(think, Some("mistral_v11")).unwrap())
    }

    #[test]
    fn mistral_v11_calls_any_split() {
        let text = "[THINK]Two files [a].[/THINK]Reading both.[TOOL_CALLS]read_file[ARGS]{\"path\": \"a [1].txt\", \"opts\": {\"n\": [1]}}[TOOL_CALLS]read_file[CALL_ID]abc123XYZ[ARGS]{\"path\": \"b\"}";
        let want = vec![
            p(Thinking, "Two files [a]."),
            p(Text, "Reading both."),
            p(ToolStart, "read_file"),
            p(
                ToolArgs,
                "{\"path\": \"a [1].txt\", \"opts\": {\"n\": [1]}}",
            ),
            p(ToolEnd, ""),
            p(ToolStart, "read_file"),
            p(ToolArgs, "{\"path\": \"b\"}"),
            p(ToolEnd, ""),
        ];
        check_calls_any_split(&spec(), &Arc::default(), text, 20, &want, 2);
    }

    #[test]
    fn mistral_v11_legacy_array_and_broken() {
        let (got, _) = run(
            spec(),
            "",
            &["[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]"],
        );
        assert_eq!(
            got,
            vec![p(ToolStart, "a"), p(ToolArgs, "{}"), p(ToolEnd, "")]
        );
        let (got, parser) = run(spec(), "", &["x [TOOL_CALLS]not a call\nok"]);
        assert_eq!(got, vec![p(Text, "x [TOOL_CALLS]not a call\nok")]);
        assert_eq!(parser.tool_calls(), 0);
    }
}
