//! placeholder
use super::{Opener, ToolSyntax};
pub(super) static SYNTAX: ToolSyntax = ToolSyntax {
    name: "mistral_v11",
    opener: Opener::Tag("<mistral_v11>"),
    tags: &[],
    region: |_| (super::hermes::SYNTAX.region)(&std::sync::Arc::default()),
};
