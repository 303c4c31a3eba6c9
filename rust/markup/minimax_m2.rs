//! MiniMax-M2 tool calls: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n</invoke>\n</minimax:tool_call>`, several invokes per block.

use super::qwen3_coder::{FunctionXml, XmlTags};
use super::{Opener, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "minimax_m2",
    opener: Opener::Tag("<minimax:tool_call>"),
    tags: &["<minimax:tool_call>", "</minimax:tool_call>"],
    region: |tools| Box::new(FunctionXml::new(&TAGS, tools)),
};

static TAGS: XmlTags = XmlTags {
    call: "<invoke name=",
    call_end: "</invoke>",
    param: "<parameter name=",
    param_end: "</parameter>",
    close: "</minimax:tool_call>",
    json_fallback: false,
};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::schema::ToolSchemas;
    use crate::markup::tests::{all_splits, check_splits_and_truncation, p, run_with, spec};
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn minimax_m2_several_invokes_typed() {
        let tools = Arc::new(ToolSchemas::new(&[
            (
                "search",
                r#"{"properties":{"query":{"type":"string"},"limit":{"type":"integer"},"filters":{"type":"object"}}}"#,
            ),
            ("ls", r#"{"properties":{"all":{"type":"boolean"}}}"#),
        ]));
        let text = "<think>two calls</think>\n\nOn it.\n<minimax:tool_call>\n<invoke name=\"search\">\n<parameter name=\"query\">a </parameter b\"</parameter>\n<parameter name=\"limit\">5</parameter>\n<parameter name=\"filters\">{\"lang\": \"日本語\"}</parameter>\n</invoke>\n<invoke name=\"ls\">\n<parameter name=\"all\">true</parameter>\n</invoke>\n</minimax:tool_call>";
        for chunks in all_splits(text, 30) {
            let (got, parser) = run_with(spec(true, Some("minimax_m2")), &tools, "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(Thinking, "two calls"),
                    p(Text, "On it."),
                    p(ToolStart, "search"),
                    p(
                        ToolArgs,
                        r#"{"query":"a </parameter b\"","limit":5,"filters":{"lang":"日本語"}}"#
                    ),
                    p(ToolEnd, ""),
                    p(ToolStart, "ls"),
                    p(ToolArgs, r#"{"all":true}"#),
                    p(ToolEnd, ""),
                ],
                "{chunks:?}"
            );
            assert_eq!(parser.tool_calls(), 2);
        }
        check_splits_and_truncation(&spec(true, Some("minimax_m2")), &tools, text);
    }
}
