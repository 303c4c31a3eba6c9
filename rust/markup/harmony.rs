//! gpt-oss harmony: the reply is channel messages; `analysis` is reasoning, `final` (and commentary without a recipient) is text, `to=functions.NAME` is a call.

use super::json_args::CallArgs;
use super::tags::{find_first, safe_len, ws_len};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "harmony",
    opener: Opener::Whole,
    tags: &[START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL, RETURN],
    region: |_| Box::<Harmony>::default(),
};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CONSTRAIN: &str = "<|constrain|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";

/// What ends a message body (`<|call|>` and `<|return|>` are usually EOS ids and never arrive;
/// a `<|start|>` right after a body stands for a missing `<|end|>`).
const BODY_ENDS: [&str; 4] = [END, CALL, RETURN, START];
const HEADER_OPENS: [&str; 2] = [START, CHANNEL];

/// A header longer than this is not one: what follows is read as text.
const MAX_HEADER: usize = 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Outside any message (the reply starts here: the prompt ends with `<|start|>assistant`).
    #[default]
    Between,
    /// A message header, up to `<|message|>`.
    Header,
    Text,
    Thinking,
    /// A call's arguments object.
    Args,
    /// After a call's arguments (broken ones ended the call), until the message ends.
    ArgsDone,
    /// The rest of a message nothing is shown of.
    Skip,
}

#[derive(Debug, Default)]
struct Harmony {
    state: State,
    head: String,
    args: CallArgs,
    /// Whitespace at the start of text between messages is dropped.
    text_started: bool,
}

impl Harmony {
    /// The header is complete: decides what the message is.
    fn open_body(&mut self, out: &mut ToolOut<'_>) {
        let head = &self.head;
        let word = |at: usize| {
            let rest = head[at..].trim_start();
            let end = rest
                .find(|c: char| c.is_whitespace() || c == '<')
                .unwrap_or(rest.len());
            &rest[..end]
        };
        let recipient = head.find("to=").map(|at| word(at + 3));
        let channel = head.find(CHANNEL).map(|at| word(at + CHANNEL.len()));
        self.state = match (recipient, channel) {
            (Some(recipient), _) => {
                let name = recipient.strip_prefix("functions.").unwrap_or(recipient);
                if name.is_empty() {
                    State::Skip
                } else {
                    out.start(name);
                    self.args = CallArgs::default();
                    State::Args
                }
            }
            (None, Some("analysis")) => State::Thinking,
            _ => State::Text,
        };
    }

    /// A message body ended at tag `index` of [`BODY_ENDS`].
    fn body_ended(&mut self, index: usize) -> usize {
        self.text_started = false;
        if BODY_ENDS[index] == START {
            self.head.clear();
            self.state = State::Header;
        } else {
            self.state = State::Between;
        }
        BODY_ENDS[index].len()
    }
}

impl ToolRegion for Harmony {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        while pos < input.len() {
            let rest = &input[pos..];
            match self.state {
                State::Between => {
                    let (shown, next) = match find_first(rest, &HEADER_OPENS) {
                        Some((at, index)) => (at, Some(index)),
                        None => (safe_len(rest, &HEADER_OPENS), None),
                    };
                    let mut text = &rest[..shown];
                    if !self.text_started {
                        text = &text[ws_len(text)..];
                        self.text_started = !text.is_empty();
                    }
                    out.text(text);
                    pos += shown;
                    let Some(index) = next else {
                        return Step::More(pos);
                    };
                    self.head.clear();
                    if HEADER_OPENS[index] == CHANNEL {
                        self.head.push_str(CHANNEL);
                    }
                    pos += HEADER_OPENS[index].len();
                    self.state = State::Header;
                }
                State::Header => {
                    let (used, done) = match find_first(rest, &[MESSAGE]) {
                        Some((at, _)) => (at, true),
                        None => (safe_len(rest, &[MESSAGE]), false),
                    };
                    self.head.push_str(&rest[..used]);
                    pos += used;
                    if self.head.len() > MAX_HEADER {
                        self.state = State::Text;
                        continue;
                    }
                    if !done {
                        return Step::More(pos);
                    }
                    pos += MESSAGE.len();
                    self.open_body(out);
                }
                State::Text | State::Thinking | State::Skip | State::ArgsDone => {
                    let found = if rest.contains('<') {
                        find_first(rest, &BODY_ENDS)
                    } else {
                        None
                    };
                    let shown = match found {
                        Some((at, _)) => at,
                        None if rest.contains('<') => safe_len(rest, &BODY_ENDS),
                        None => rest.len(),
                    };
                    match self.state {
                        State::Text => out.text(&rest[..shown]),
                        State::Thinking => out.thinking(&rest[..shown]),
                        _ => {}
                    }
                    pos += shown;
                    let Some((_, index)) = found else {
                        return Step::More(pos);
                    };
                    if self.state == State::ArgsDone {
                        self.args.end(out);
                    }
                    pos += self.body_ended(index);
                }
                State::Args => {
                    let (used, over) = self.args.feed(rest, out);
                    pos += used;
                    if over {
                        self.state = State::ArgsDone;
                    }
                }
            }
        }
        Step::More(pos)
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        if matches!(self.state, State::Args | State::ArgsDone) {
            self.args.end(out);
        }
        self.state = State::Between;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::tests::{
        all_splits, check_calls_any_split, check_splits_and_truncation, p, run, spec,
    };
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    const CALL: &str = "<|channel|>analysis<|message|>User wants weather. Use get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Tōkyō <|x|>\", \"units\": {\"c\": [1, 2]}}";

    #[test]
    fn harmony_analysis_then_call_any_split() {
        let want = vec![
            p(Thinking, "User wants weather. Use get_weather."),
            p(ToolStart, "get_weather"),
            p(
                ToolArgs,
                "{\"location\": \"Tōkyō <|x|>\", \"units\": {\"c\": [1, 2]}}",
            ),
            p(ToolEnd, ""),
        ];
        // `<|call|>` is an EOS id: the stream just ends after the arguments.
        let spec = spec(false, Some("harmony"));
        check_calls_any_split(&spec, &Arc::default(), CALL, 16, &want, 1);
    }

    #[test]
    fn harmony_final_answer_and_preamble() {
        let text = "<|channel|>analysis<|message|>Think <b>.<|end|>\n<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant to=functions.ls<|channel|>commentary json<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>Done: a < b.";
        for chunks in all_splits(text, 12) {
            let (got, parser) = run(spec(false, Some("harmony")), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(Thinking, "Think <b>."),
                    p(Text, "Checking now."),
                    p(ToolStart, "ls"),
                    p(ToolArgs, "{}"),
                    p(ToolEnd, ""),
                    p(Text, "Done: a < b."),
                ],
                "{chunks:?}"
            );
            assert_eq!(parser.tool_calls(), 1);
        }
        check_splits_and_truncation(&spec(false, Some("harmony")), &Arc::default(), text);
    }

    #[test]
    fn harmony_broken_arguments_and_plain_text() {
        let (got, parser) = run(
            spec(false, Some("harmony")),
            "",
            &["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": tru e}<|end|>",
              "<|start|>assistant<|channel|>final<|message|>ok"],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"a\": true}"),
                p(ToolEnd, ""),
                p(Text, "ok")
            ]
        );
        assert!(parser.truncated());
        let (got, _) = run(spec(false, Some("harmony")), "", &["  Just text."]);
        assert_eq!(got, vec![p(Text, "Just text.")]);
    }
}
