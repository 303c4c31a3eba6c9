//! placeholder
use super::{Opener, ToolSyntax};
pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "harmony",
    opener: Opener::Tag("<harmony>"),
    tags: &[],
    region: |_| (super::hermes::SYNTAX.region)(&std::sync::Arc::default()),
};
