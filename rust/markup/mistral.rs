//! Mistral tool calls (before tokenizer v11): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, or one bare object.

use super::json_list::{JsonCallList, ListForm};
use super::{Opener, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "mistral",
    opener: Opener::Tag("[TOOL_CALLS]"),
    tags: &["[TOOL_CALLS]"],
    region: |_| Box::new(JsonCallList::new(ListForm::Array)),
};

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
