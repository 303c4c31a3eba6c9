//! The one error type of the core; rust/py/ turns it into `NativeError`.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    UnknownVocabKind(String),
    SpecialIdOutOfRange {
        id: u32,
        vocab_len: usize,
    },
    DuplicateStream(u64),
    /// A response opened with no stream, or with several in a dialect without `n`.
    Choices {
        dialect: &'static str,
        count: usize,
    },
    LengthMismatch {
        stream_ids: usize,
        token_ids: usize,
    },
    /// A tool-call format no parser has, and the names of those there are.
    UnknownToolFormat {
        name: String,
        known: Vec<&'static str>,
    },
    EmptyThinkTag,
    UnknownCompletionKind(String),
    UnknownErrorKind(String),
    UnknownCompaction(String),
    UnknownSearchKind(String),
    UnknownCacheTier(String),
    UnknownDrafter(String),
    /// `Router::guessed`'s per-stream counts do not match its stream ids.
    GuessedLengths {
        stream_ids: usize,
        guessed: usize,
        kept: usize,
    },
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownVocabKind(kind) => {
                write!(
                    f,
                    "unknown vocab kind {kind:?} (expected \"byte_level\" or \"sentencepiece\")"
                )
            }
            Self::SpecialIdOutOfRange { id, vocab_len } => {
                write!(
                    f,
                    "special token id {id} is out of range for a vocab of {vocab_len} tokens"
                )
            }
            Self::DuplicateStream(id) => write!(f, "stream {id} is already open"),
            Self::Choices { dialect, count } => {
                write!(f, "a {dialect} response cannot have {count} choices")
            }
            Self::LengthMismatch {
                stream_ids,
                token_ids,
            } => write!(
                f,
                "step arguments differ in length: {stream_ids} stream ids, {token_ids} token ids"
            ),
            Self::UnknownToolFormat { name, known } => {
                write!(f, "unknown tool call format {name:?} (expected ")?;
                let last = known.len().saturating_sub(1);
                for (i, name) in known.iter().enumerate() {
                    let sep = match i {
                        0 => "",
                        _ if i == last => " or ",
                        _ => ", ",
                    };
                    write!(f, "{sep}{name:?}")?;
                }
                write!(f, ")")
            }
            Self::EmptyThinkTag => write!(f, "think tags must not be empty"),
            Self::UnknownErrorKind(kind) => write!(f, "unknown error kind {kind:?}"),
            Self::UnknownDrafter(name) => write!(
                f,
                "unknown drafter {name:?} (expected \"prompt-lookup\" or \"draft-model\")"
            ),
            Self::GuessedLengths {
                stream_ids,
                guessed,
                kept,
            } => write!(
                f,
                "guessed arguments differ in length: {stream_ids} stream ids, {guessed} guessed, \
                 {kept} kept"
            ),
            Self::UnknownCacheTier(tier) => {
                write!(
                    f,
                    "unknown prefix cache tier {tier:?} (expected \"memory\", \"disk\" or \"in-flight\")"
                )
            }
            Self::UnknownSearchKind(kind) => {
                write!(
                    f,
                    "unknown tool search {kind:?} (expected \"regex\" or \"bm25\")"
                )
            }
            Self::UnknownCompletionKind(kind) => {
                write!(
                    f,
                    "unknown completion kind {kind:?} (expected \"chat\" or \"completion\")"
                )
            }
            Self::UnknownCompaction(kind) => {
                write!(
                    f,
                    "unknown compaction {kind:?} (expected \"item\" or \"endpoint\")"
                )
            }
        }
    }
}

impl std::error::Error for CoreError {}
