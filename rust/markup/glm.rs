//! placeholder
use super::{Opener, ToolSyntax};
pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "glm",
    opener: Opener::Tag("<glm>"),
    tags: &[],
    region: |_| (super::hermes::SYNTAX.region)(&std::sync::Arc::default()),
};
