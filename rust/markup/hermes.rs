//! Hermes (Qwen) tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one call per tag.

use super::json_call::{CallParser, CallStatus};
use super::{Opener, Step, ToolOut, ToolRegion, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "hermes",
    opener: Opener::Tag("<tool_call>"),
    tags: &["<tool_call>", "</tool_call>"],
    region: |_| Box::<Hermes>::default(),
};

const CLOSE: &str = "</tool_call>";

#[derive(Debug, Default)]
struct Hermes {
    call: CallParser,
    /// The call ended; expecting `</tool_call>`.
    after_call: bool,
}

impl ToolRegion for Hermes {
    fn feed(&mut self, input: &str, out: &mut ToolOut<'_>) -> Step {
        let mut pos = 0;
        if !self.after_call {
            let (used, status) = self.call.feed(input, out);
            match status {
                CallStatus::Open => return Step::More(used),
                CallStatus::Complete => {}
                // Small models often forget the call object's own closing brace; a `</tool_call>`
                // right after the arguments still ends the call rather than leaking into the text.
                CallStatus::Invalid if self.call.committed() => self.call.abort(out),
                CallStatus::Invalid => return Step::Invalid(used),
            }
            self.after_call = true;
            pos = used;
        }
        let rest = &input[pos..];
        let body = rest.trim_start();
        pos += rest.len() - body.len();
        if body.starts_with(CLOSE) {
            Step::End(pos + CLOSE.len())
        } else if CLOSE.starts_with(body) {
            Step::More(pos)
        } else {
            Step::End(pos)
        }
    }

    fn finish(&mut self, out: &mut ToolOut<'_>) {
        if !self.after_call && self.call.committed() {
            self.call.abort(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::markup::tests::{all_splits, p, run, spec};
    use crate::markup::PieceKind::{Text, ToolArgs, ToolEnd, ToolStart};

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
            let (got, parser) = run(spec(true, Some("hermes")), "", &chunks);
            assert_eq!(got, want, "{chunks:?}");
            assert_eq!((parser.tool_calls(), parser.truncated()), (1, false));
        }
    }

    #[test]
    fn two_consecutive_calls() {
        let text = "<tool_call>\n{\"name\": \"A\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"B\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        for chunks in all_splits(text, 7) {
            let (got, parser) = run(spec(false, Some("hermes")), "", &chunks);
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
    fn malformed_after_name_closes_arguments_validly() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, }}</tool_call>";
        let (got, parser) = run(spec(false, Some("hermes")), "", &[text]);
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
    fn hermes_call_missing_its_closing_brace_still_ends_at_the_tag() {
        let (got, parser) = run(
            spec(false, Some("hermes")),
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
}
