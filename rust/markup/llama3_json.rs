//! Llama 3.1+ JSON tool calls: a reply that starts with `{"name": …, "parameters": {…}}`, more after `;`.

use super::json_list::{JsonCallList, ListForm};
use super::{Opener, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "llama3_json",
    opener: Opener::ReplyStart(b'{'),
    tags: &[],
    region: |_| Box::new(JsonCallList::new(ListForm::Bare { separator: b';' })),
};

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
