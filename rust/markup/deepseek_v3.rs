//! DeepSeek V3.1 tool calls: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`, and V3's `function<｜tool▁sep｜>NAME\n```json …```` form.

use super::kimi_k2::{SectionTags, Sectioned};
use super::{Opener, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "deepseek_v3",
    opener: Opener::Tag("<｜tool▁calls▁begin｜>"),
    tags: &[
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
    ],
    region: |_| Box::new(Sectioned::new(&TAGS)),
};

static TAGS: SectionTags = SectionTags {
    call: "<｜tool▁call▁begin｜>",
    sep: "<｜tool▁sep｜>",
    call_end: "<｜tool▁call▁end｜>",
    section_end: "<｜tool▁calls▁end｜>",
    name: str::trim,
    fenced: true,
};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::tests::{
        all_splits, check_calls_any_split, check_splits_and_truncation, p, run, spec,
    };
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn deepseek_v31_calls_any_split() {
        let text = "<think>hm</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Hangzhou\", \"n\": [1, {\"x\": \"é\"}]}<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let want = vec![
            p(Thinking, "hm"),
            p(Text, "Sure."),
            p(ToolStart, "get_weather"),
            p(
                ToolArgs,
                "{\"location\": \"Hangzhou\", \"n\": [1, {\"x\": \"é\"}]}",
            ),
            p(ToolEnd, ""),
            p(ToolStart, "function"),
            p(ToolArgs, "{}"),
            p(ToolEnd, ""),
        ];
        let spec = spec(true, Some("deepseek_v3"));
        check_calls_any_split(&spec, &Arc::default(), text, 40, &want, 2);
    }

    #[test]
    fn deepseek_v3_fenced_form() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        for chunks in all_splits(text, 20) {
            let (got, _) = run(spec(false, Some("deepseek_v3")), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "get_weather"),
                    p(ToolArgs, "{\"location\": \"Tokyo\"}"),
                    p(ToolEnd, "")
                ],
                "{chunks:?}"
            );
        }
        check_splits_and_truncation(&spec(false, Some("deepseek_v3")), &Arc::default(), text);
    }
}
