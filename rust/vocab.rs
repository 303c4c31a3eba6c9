//! Token id to bytes table, built once per model from byte-level BPE, SentencePiece or raw bytes.

use std::str::FromStr;

use crate::error::CoreError;

/// How the token strings of a tokenizer vocabulary encode bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// GPT-2 style byte-level BPE: every byte is drawn as one printable char (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xAB>` is the raw byte 0xAB, anything else is UTF-8.
    SentencePiece,
}

impl FromStr for VocabKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "byte_level" => Ok(Self::ByteLevel),
            "sentencepiece" => Ok(Self::SentencePiece),
            other => Err(CoreError::UnknownVocabKind(other.to_owned())),
        }
    }
}

/// The bytes of every token, stored back to back.
#[derive(Debug, Clone)]
pub struct Vocab {
    data: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` is the token's slice of `data` (empty for special ids).
    offsets: Vec<u32>,
    /// The special tokens' own bytes, sorted by id: rendered only where a stream's markup asks.
    special: Vec<(u32, Box<[u8]>)>,
    trim_leading_space: bool,
}

impl Vocab {
    /// Builds the table from tokenizer vocabulary strings. Special ids render to nothing.
    pub fn from_token_strings<S: AsRef<str>>(
        tokens: &[S],
        kind: VocabKind,
        special_ids: &[u32],
    ) -> Result<Self, CoreError> {
        let table = match kind {
            VocabKind::ByteLevel => Some(byte_level_decoder()),
            VocabKind::SentencePiece => None,
        };
        let mut builder = Builder::with_capacity(tokens.len());
        for token in tokens {
            let token = token.as_ref();
            match &table {
                Some(table) => decode_byte_level(token, table, &mut builder.data),
                None => decode_sentencepiece(token, &mut builder.data),
            }
            builder.end_token();
        }
        builder.finish(special_ids)
    }

    /// Builds the table from the raw bytes of every token.
    pub fn from_token_bytes<B: AsRef<[u8]>>(
        tokens: &[B],
        special_ids: &[u32],
    ) -> Result<Self, CoreError> {
        let mut builder = Builder::with_capacity(tokens.len());
        for token in tokens {
            builder.data.extend_from_slice(token.as_ref());
            builder.end_token();
        }
        builder.finish(special_ids)
    }

    /// Drop one leading space from the first text of every stream (SentencePiece models whose
    /// tokenizer adds a dummy prefix, e.g. Llama 2 and Mistral; mlx-lm's `trim_space`).
    pub fn with_trim_leading_space(mut self, trim: bool) -> Self {
        self.trim_leading_space = trim;
        self
    }

    pub fn trim_leading_space(&self) -> bool {
        self.trim_leading_space
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of one token. Ids past the table (padded embedding rows) render to nothing.
    #[inline]
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let id = id as usize;
        match (self.offsets.get(id), self.offsets.get(id + 1)) {
            (Some(&start), Some(&end)) => &self.data[start as usize..end as usize],
            _ => &[],
        }
    }

    /// The bytes of a special token (which [`Vocab::token_bytes`] renders as nothing).
    pub fn special_bytes(&self, id: u32) -> Option<&[u8]> {
        self.special
            .binary_search_by_key(&id, |(special, _)| *special)
            .ok()
            .map(|at| &*self.special[at].1)
    }

    /// Whole-sequence decode, lossy like the streaming path.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        let text = String::from_utf8_lossy(&bytes);
        match text.strip_prefix(' ') {
            Some(rest) if self.trim_leading_space => rest.to_owned(),
            _ => text.into_owned(),
        }
    }
}

struct Builder {
    data: Vec<u8>,
    offsets: Vec<u32>,
}

impl Builder {
    fn with_capacity(n: usize) -> Self {
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        Self {
            data: Vec::with_capacity(n * 6),
            offsets,
        }
    }

    fn end_token(&mut self) {
        let end = u32::try_from(self.data.len()).expect("vocab bytes exceed 4 GiB");
        self.offsets.push(end);
    }

    fn finish(self, special_ids: &[u32]) -> Result<Vocab, CoreError> {
        let Builder { data, mut offsets } = self;
        let vocab_len = offsets.len() - 1;
        if let Some(&id) = special_ids.iter().find(|&&id| id as usize >= vocab_len) {
            return Err(CoreError::SpecialIdOutOfRange { id, vocab_len });
        }
        if special_ids.is_empty() {
            return Ok(Vocab {
                data,
                offsets,
                special: Vec::new(),
                trim_leading_space: false,
            });
        }
        // Rebuild without the special tokens' bytes so every id keeps a contiguous slice.
        let mut special = vec![false; vocab_len];
        for &id in special_ids {
            special[id as usize] = true;
        }
        let mut kept = Vec::with_capacity(data.len());
        let mut special_bytes = Vec::with_capacity(special_ids.len());
        let mut start = 0usize;
        for (id, is_special) in special.iter().enumerate() {
            let end = offsets[id + 1] as usize;
            if *is_special {
                special_bytes.push((id as u32, data[start..end].into()));
            } else {
                kept.extend_from_slice(&data[start..end]);
            }
            start = end;
            offsets[id + 1] = kept.len() as u32;
        }
        Ok(Vocab {
            data: kept,
            offsets,
            special: special_bytes,
            trim_leading_space: false,
        })
    }
}

/// Inverse of GPT-2's `bytes_to_unicode`: code point (< 324) to the byte it stands for.
fn byte_level_decoder() -> [Option<u8>; 324] {
    let mut table = [None; 324];
    let mut next_extra = 256usize;
    for b in 0u16..=255 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        if printable {
            table[b as usize] = Some(b as u8);
        } else {
            table[next_extra] = Some(b as u8);
            next_extra += 1;
        }
    }
    table
}

fn decode_byte_level(token: &str, table: &[Option<u8>; 324], out: &mut Vec<u8>) {
    for c in token.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            // Added tokens are stored as plain text, not byte-level encoded.
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

fn decode_sentencepiece(token: &str, out: &mut Vec<u8>) {
    if let Some(b) = parse_byte_fallback(token) {
        out.push(b);
        return;
    }
    for c in token.chars() {
        let c = if c == '\u{2581}' { ' ' } else { c };
        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
    }
}

/// `<0xAB>` to 0xAB.
fn parse_byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's `bytes_to_unicode`, forward direction, for building test vocabularies.
    pub(crate) fn byte_level_encode(bytes: &[u8]) -> String {
        let table = byte_level_decoder();
        bytes
            .iter()
            .map(|&b| {
                let cp = table.iter().position(|&x| x == Some(b)).unwrap();
                char::from_u32(cp as u32).unwrap()
            })
            .collect()
    }

    #[test]
    fn byte_level_maps_gpt2_chars() {
        let tokens = ["Hello", "\u{120}world", "\u{10a}", "!"];
        let vocab = Vocab::from_token_strings(&tokens, VocabKind::ByteLevel, &[]).unwrap();
        assert_eq!(vocab.token_bytes(1), b" world");
        assert_eq!(vocab.token_bytes(2), b"\n");
        assert_eq!(vocab.decode(&[0, 1, 3, 2]), "Hello world!\n");
    }

    #[test]
    fn byte_level_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        let token = byte_level_encode(&all);
        assert_eq!(token.chars().count(), 256);
        let vocab = Vocab::from_token_strings(&[token], VocabKind::ByteLevel, &[]).unwrap();
        assert_eq!(vocab.token_bytes(0), &all[..]);
    }

    #[test]
    fn byte_level_keeps_plain_added_tokens() {
        let vocab =
            Vocab::from_token_strings(&["<think>", "a b", "你好"], VocabKind::ByteLevel, &[])
                .unwrap();
        assert_eq!(vocab.token_bytes(0), b"<think>");
        assert_eq!(vocab.token_bytes(1), b"a b");
        assert_eq!(vocab.token_bytes(2), "你好".as_bytes());
    }

    #[test]
    fn sentencepiece_spaces_and_byte_fallback() {
        let tokens = [
            "<s>",
            "\u{2581}Hello",
            "<0xE4>",
            "<0xBD>",
            "<0xA0>",
            "<0x0A>",
            "<0xZZ>",
        ];
        let vocab = Vocab::from_token_strings(&tokens, VocabKind::SentencePiece, &[0]).unwrap();
        assert_eq!(vocab.token_bytes(0), b"");
        assert_eq!(vocab.token_bytes(1), b" Hello");
        assert_eq!(vocab.token_bytes(2), &[0xE4]);
        assert_eq!(vocab.token_bytes(5), b"\n");
        assert_eq!(vocab.token_bytes(6), b"<0xZZ>");
        assert_eq!(vocab.decode(&[0, 1, 2, 3, 4]), " Hello你");
        let trimmed = vocab.with_trim_leading_space(true);
        assert_eq!(trimmed.decode(&[0, 1, 2, 3, 4]), "Hello你");
    }

    #[test]
    fn special_ids_render_nothing_and_keep_neighbours() {
        let vocab =
            Vocab::from_token_bytes(&[&b"a"[..], b"<|end|>", b"b", b"<|x|>"], &[1, 3]).unwrap();
        assert_eq!(vocab.len(), 4);
        assert_eq!(vocab.token_bytes(0), b"a");
        assert_eq!(vocab.token_bytes(1), b"");
        assert_eq!(vocab.token_bytes(2), b"b");
        assert_eq!(vocab.token_bytes(3), b"");
        assert_eq!(vocab.token_bytes(4), b"");
        assert_eq!(vocab.token_bytes(u32::MAX), b"");
    }

    #[test]
    fn rejects_bad_kind_and_special_ids() {
        assert!(matches!(
            "bpe".parse::<VocabKind>(),
            Err(CoreError::UnknownVocabKind(_))
        ));
        assert_eq!(
            Vocab::from_token_bytes(&[b"a"], &[1]).unwrap_err(),
            CoreError::SpecialIdOutOfRange {
                id: 1,
                vocab_len: 1
            }
        );
    }
}
