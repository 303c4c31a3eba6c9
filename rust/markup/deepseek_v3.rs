//! placeholder
use super::{Opener, ToolSyntax};
pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "deepseek_v3",
    opener: Opener::Tag("<deepseek_v3>"),
    tags: &[],
    region: |_| (super::hermes::SYNTAX.region)(&std::sync::Arc::default()),
};
