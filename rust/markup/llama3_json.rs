//! Llama 3.1+ JSON tool calls: a reply that starts with `{"name": …, "parameters": {…}}`, more after `;`.

use super::json_call::{CallParser, CallStatus};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "llama3_json",
    opener: Opener::ReplyStart(b'{'),
    tags: &[],
    region: |_| Box::<Llama3Json>::default(),
};

#[derive(Debug, Default)]
struct Llama3Json {
    state: State,
    call: CallParser,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    #[default]
    Call,
    /// After a call, expecting `;` and another object, or the end.
    Next,
    /// After `;`, expecting `{`.
    Open,
}

impl ToolRegion for Llama3Json {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            if self.state == State::Call {
                let (used, status) = self.call.feed(rest, out);
                pos += used;
                match status {
                    CallStatus::Open => return Step::More(pos),
                    CallStatus::Complete => self.state = State::Next,
                    CallStatus::Invalid => return Step::Invalid(pos),
                }
                continue;
            }
            let body = rest.trim_start();
            pos += rest.len() - body.len();
            match (self.state, body.as_bytes().first()) {
                (_, None) => return Step::More(pos),
                (State::Next, Some(b';')) => {
                    pos += 1;
                    self.state = State::Open;
                }
                (State::Open, Some(b'{')) => {
                    self.state = State::Call;
                    self.call = CallParser::default();
                    return Step::CallStart(pos);
                }
                _ => return Step::End(pos),
            }
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        if self.state == State::Call && self.call.committed() {
            self.call.abort(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::markup::tests::{all_splits, p, run, spec};
    use crate::markup::PieceKind::{Text, ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn llama3_json_only_at_reply_start() {
        let text = " {\"name\": \"get\", \"parameters\": {\"city\": \"Paris\"}}";
        for chunks in all_splits(text, 5) {
            let (got, _) = run(spec(false, Some("llama3_json")), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "get"),
                    p(ToolArgs, "{\"city\": \"Paris\"}"),
                    p(ToolEnd, "")
                ]
            );
        }
        let (got, parser) = run(spec(false, Some("llama3_json")), "", &["Use {\"name\": 1}"]);
        assert_eq!(got, vec![p(Text, "Use {\"name\": 1}")]);
        assert_eq!(parser.tool_calls(), 0);
        let (got, _) = run(spec(false, Some("llama3_json")), "", &["{not json"]);
        assert_eq!(got, vec![p(Text, "{not json")]);
    }
}
