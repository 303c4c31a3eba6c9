//! Mistral tool calls (before tokenizer v11): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, or one bare object.

use super::json_call::{CallParser, CallStatus};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "mistral",
    opener: Opener::Tag("[TOOL_CALLS]"),
    tags: &["[TOOL_CALLS]"],
    region: |_| Box::<Mistral>::default(),
};

#[derive(Debug, Default)]
struct Mistral {
    state: State,
    call: CallParser,
    in_array: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// After `[TOOL_CALLS]`, expecting `[` (or a bare object).
    #[default]
    ArrayOpen,
    Call,
    /// After a call inside the array, expecting `,` or `]`.
    ArrayNext,
}

impl ToolRegion for Mistral {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            if self.state == State::Call {
                let (used, status) = self.call.feed(rest, out);
                pos += used;
                match status {
                    CallStatus::Open => return Step::More(pos),
                    CallStatus::Complete if self.in_array => self.state = State::ArrayNext,
                    CallStatus::Complete => return Step::End(pos),
                    CallStatus::Invalid => return Step::Invalid(pos),
                }
                continue;
            }
            let body = rest.trim_start();
            pos += rest.len() - body.len();
            let Some(&next) = body.as_bytes().first() else {
                return Step::More(pos);
            };
            return match (self.state, next) {
                (State::ArrayOpen, b'{') => {
                    self.in_array = false;
                    self.start_call(pos)
                }
                (State::ArrayOpen, b'[') => {
                    self.in_array = true;
                    self.start_call(pos + 1)
                }
                (State::ArrayOpen, _) => Step::Invalid(pos),
                (_, b',') => self.start_call(pos + 1),
                (_, b']') => Step::End(pos + 1),
                _ => Step::End(pos),
            };
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        if self.state == State::Call && self.call.committed() {
            self.call.abort(out);
        }
    }
}

impl Mistral {
    fn start_call(&mut self, at: usize) -> Step {
        self.state = State::Call;
        self.call = CallParser::default();
        Step::CallStart(at)
    }
}

#[cfg(test)]
mod tests {
    use crate::markup::tests::{all_splits, p, run, spec};
    use crate::markup::PieceKind::{ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn mistral_array() {
        let text = "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        for chunks in all_splits(text, 6) {
            let (got, parser) = run(spec(false, Some("mistral")), "", &chunks);
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
}
