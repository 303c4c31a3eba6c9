//! Seed-OSS tool calls: `<seed:tool_call>\n<function=NAME>\n<parameter=K>V</parameter>\n</function>\n</seed:tool_call>`.

use super::qwen3_coder::{self, FunctionXml, XmlTags};
use super::{Opener, ToolSyntax};

pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "seed_oss",
    opener: Opener::Tag("<seed:tool_call>"),
    tags: &["<seed:tool_call>", "</seed:tool_call>"],
    region: |tools| Box::new(FunctionXml::new(&TAGS, tools)),
};

/// Qwen3-Coder's function and parameter tags, in a block of Seed-OSS's own.
static TAGS: XmlTags = XmlTags {
    close: "</seed:tool_call>",
    json_fallback: false,
    ..qwen3_coder::TAGS
};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::markup::schema::ToolSchemas;
    use crate::markup::tests::{all_splits, check_splits_and_truncation, p, run_with};
    use crate::markup::MarkupSpec;
    use crate::markup::PieceKind::{Text, Thinking, ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn seed_oss_calls_and_seed_think() {
        let spec = Arc::new(
            MarkupSpec::new(
                Some(("<seed:think>".into(), "</seed:think>".into())),
                Some("seed_oss"),
            )
            .unwrap(),
        );
        let tools = Arc::new(ToolSchemas::new(&[(
            "get_weather",
            r#"{"properties":{"location":{"type":"string"},"days":{"type":"integer"}}}"#,
        )]));
        let text = "<seed:think>Need weather.<seed:cot_budget_reflect>x</seed:cot_budget_reflect></seed:think>Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=location>Paris <3</parameter>\n<parameter=days>2</parameter>\n</function>\n<function=get_weather>\n<parameter=location>Nice</parameter>\n</function>\n</seed:tool_call>";
        for chunks in all_splits(text, 24) {
            let (got, parser) = run_with(spec.clone(), &tools, "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(
                        Thinking,
                        "Need weather.<seed:cot_budget_reflect>x</seed:cot_budget_reflect>"
                    ),
                    p(Text, "Checking."),
                    p(ToolStart, "get_weather"),
                    p(ToolArgs, r#"{"location":"Paris <3","days":2}"#),
                    p(ToolEnd, ""),
                    p(ToolStart, "get_weather"),
                    p(ToolArgs, r#"{"location":"Nice"}"#),
                    p(ToolEnd, ""),
                ],
                "{chunks:?}"
            );
            assert_eq!(parser.tool_calls(), 2);
        }
        check_splits_and_truncation(&spec, &tools, text);
    }
}
