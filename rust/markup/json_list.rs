//! A list of JSON call objects, the region llama3_json and mistral write: bare calls with a separator between them (`{…}; {…}`), or a JSON array of them (`[{…}, {…}]`) where one bare object is a call alone.

use super::json_call::{CallParser, CallStatus};
use super::{Step, ToolOut, ToolRegion};

/// How a format lists its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListForm {
    /// The calls stand bare from the region's start (its opener is the first call's `{`),
    /// `separator` between two; text may follow a separator.
    Bare { separator: u8 },
    /// After the opener, a JSON array of calls, or one bare call object in its place.
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// After an array's opener: its `[`, or one bare object.
    Start,
    Call,
    /// After a call: a separator (`,` in an array), the array's `]`, or the end.
    Next,
    /// After a bare list's separator: the next call's `{`, or the end.
    Separated,
}

/// One region of a list of JSON calls, each read by a [`CallParser`].
#[derive(Debug)]
pub(super) struct JsonCallList {
    form: ListForm,
    state: State,
    call: CallParser,
    in_array: bool,
}

impl JsonCallList {
    pub(super) fn new(form: ListForm) -> Self {
        let state = match form {
            ListForm::Bare { .. } => State::Call,
            ListForm::Array => State::Start,
        };
        Self {
            form,
            state,
            call: CallParser::default(),
            in_array: false,
        }
    }

    fn start_call(&mut self, at: usize) -> Step {
        self.state = State::Call;
        self.call = CallParser::default();
        Step::CallStart(at)
    }
}

impl ToolRegion for JsonCallList {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            if self.state == State::Call {
                let (used, status) = self.call.feed(rest, out);
                pos += used;
                match status {
                    CallStatus::Open => return Step::More(pos),
                    CallStatus::Complete if self.form == ListForm::Array && !self.in_array => {
                        return Step::End(pos)
                    }
                    CallStatus::Complete => self.state = State::Next,
                    CallStatus::Invalid => return Step::Invalid(pos),
                }
                continue;
            }
            let body = rest.trim_start();
            pos += rest.len() - body.len();
            let Some(&next) = body.as_bytes().first() else {
                return Step::More(pos);
            };
            match (self.state, self.form, next) {
                (State::Start, _, b'{') => return self.start_call(pos),
                (State::Start, _, b'[') => {
                    self.in_array = true;
                    return self.start_call(pos + 1);
                }
                (State::Start, _, _) => return Step::Invalid(pos),
                (State::Next, ListForm::Array, b',') => return self.start_call(pos + 1),
                (State::Next, ListForm::Array, b']') => return Step::End(pos + 1),
                (State::Next, ListForm::Bare { separator }, _) if next == separator => {
                    pos += 1;
                    self.state = State::Separated;
                }
                (State::Separated, _, b'{') => return self.start_call(pos),
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

    /// What follows a call, in either form, however the text is split.
    #[test]
    fn after_a_call() {
        let a = || vec![p(ToolStart, "a"), p(ToolArgs, "{}"), p(ToolEnd, "")];
        let with = |text: &str| [a(), vec![p(Text, text)]].concat();
        let cases = [
            // Bare: a separator and another call, or text (the separator spent).
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}} then",
                [
                    a(),
                    vec![
                        p(ToolStart, "b"),
                        p(ToolArgs, "{\"x\": 1}"),
                        p(ToolEnd, ""),
                        p(Text, "then"),
                    ],
                ]
                .concat(),
            ),
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {}} ;  done",
                with("done"),
            ),
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {}} {\"name\": \"b\"}",
                with("{\"name\": \"b\"}"),
            ),
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {}}; {oops",
                with("{oops"),
            ),
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {}}; {\"nam",
                with("{\"nam"),
            ),
            // Array: one bare object is the whole list; in the array, `,` starts a call.
            (
                "mistral",
                "[TOOL_CALLS]{\"name\": \"a\", \"arguments\": {}} after",
                with("after"),
            ),
            (
                "mistral",
                "[TOOL_CALLS] {\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\"}",
                with(", {\"name\": \"b\"}"),
            ),
            (
                "mistral",
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}] ok",
                with("ok"),
            ),
            (
                "mistral",
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, oops",
                with(" oops"),
            ),
            (
                "mistral",
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}} ; x",
                with("; x"),
            ),
            ("mistral", "[TOOL_CALLS][]", vec![p(Text, "]")]),
            ("mistral", "[TOOL_CALLS] x", vec![p(Text, "[TOOL_CALLS] x")]),
        ];
        for (format, text, want) in cases {
            for chunks in all_splits(text, 8) {
                let (got, parser) = run(spec(false, Some(format)), "", &chunks);
                assert_eq!(got, want, "{chunks:?}");
                assert!(!parser.truncated());
            }
        }
    }

    #[test]
    fn a_cut_call_closes_its_arguments() {
        let cases = [
            (
                "llama3_json",
                "{\"name\": \"a\", \"parameters\": {\"q\": [1",
                "{\"q\": [1]}",
            ),
            (
                "mistral",
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"q\": \"x",
                "{\"q\": \"x\"}",
            ),
        ];
        for (format, text, args) in cases {
            let (got, parser) = run(spec(false, Some(format)), "", &[text]);
            assert_eq!(
                got,
                vec![p(ToolStart, "a"), p(ToolArgs, args), p(ToolEnd, "")]
            );
            assert!(parser.truncated());
        }
    }
}
