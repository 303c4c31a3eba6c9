//! placeholder
use super::{Opener, ToolSyntax};
pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "kimi_k2",
    opener: Opener::Tag("<kimi_k2>"),
    tags: &[],
    region: |_| (super::hermes::SYNTAX.region)(&std::sync::Arc::default()),
};
