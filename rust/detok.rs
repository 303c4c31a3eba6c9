//! Incremental detokenizer: token bytes in, longest valid UTF-8 text out, incomplete chars held back.

/// Per-stream UTF-8 assembly state. Output equals `String::from_utf8_lossy` of all bytes pushed,
/// however they were split into tokens.
#[derive(Debug, Default, Clone)]
pub struct Detok {
    /// The bytes of an incomplete char (at most 3), or scratch while completing one.
    pending: Vec<u8>,
    trim_leading_space: bool,
}

impl Detok {
    pub fn new(trim_leading_space: bool) -> Self {
        Self {
            pending: Vec::new(),
            trim_leading_space,
        }
    }

    /// Appends the text that `bytes` completes to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut String) {
        let start = out.len();
        if self.pending.is_empty() {
            let used = decode_lossy(bytes, out);
            self.pending.extend_from_slice(&bytes[used..]);
        } else {
            self.pending.extend_from_slice(bytes);
            let used = decode_lossy(&self.pending, out);
            self.pending.drain(..used);
        }
        self.trim(start, out);
    }

    /// End of stream: a held incomplete char becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            let start = out.len();
            out.push(char::REPLACEMENT_CHARACTER);
            self.pending.clear();
            self.trim(start, out);
        }
    }

    fn trim(&mut self, start: usize, out: &mut String) {
        if self.trim_leading_space && out.len() > start {
            self.trim_leading_space = false;
            if out.as_bytes()[start] == b' ' {
                out.remove(start);
            }
        }
    }
}

/// Decodes `bytes` into `out`, invalid sequences as U+FFFD; returns how many bytes were used.
/// The unused rest is an incomplete but so far valid char at the end.
fn decode_lossy(mut bytes: &[u8], out: &mut String) -> usize {
    let total = bytes.len();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(text) => {
                out.push_str(text);
                return total;
            }
            Err(err) => {
                let valid = err.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[..valid]).unwrap_or_default());
                match err.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes = &bytes[valid + bad..];
                    }
                    None => return total - (bytes.len() - valid),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> (Vec<String>, String) {
        let mut detok = Detok::new(false);
        let mut pieces = Vec::new();
        for chunk in chunks {
            let mut out = String::new();
            detok.push(chunk, &mut out);
            pieces.push(out);
        }
        let mut tail = String::new();
        detok.finish(&mut tail);
        (pieces, tail)
    }

    #[test]
    fn emoji_split_over_four_tokens() {
        let e = "😀".as_bytes();
        let (pieces, tail) = run(&[b"hi ", &e[..1], &e[1..2], &e[2..3], &e[3..], b"!"]);
        assert_eq!(pieces, ["hi ", "", "", "", "😀", "!"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn cjk_split_mid_char_with_text_after() {
        let b = "你好".as_bytes();
        let (pieces, _) = run(&[&b[..2], &b[2..4], &b[4..]]);
        assert_eq!(pieces, ["", "你", "好"]);
    }

    #[test]
    fn invalid_bytes_become_replacement_without_hanging() {
        let (pieces, tail) = run(&[b"a\xff", b"b", b"\xe4\xbd", b"c"]);
        assert_eq!(pieces, ["a\u{fffd}", "b", "", "\u{fffd}c"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn incomplete_tail_flushed_at_finish() {
        let (pieces, tail) = run(&[b"ok", b"\xf0\x9f"]);
        assert_eq!(pieces, ["ok", ""]);
        assert_eq!(tail, "\u{fffd}");
    }

    #[test]
    fn trims_one_leading_space_once() {
        let mut detok = Detok::new(true);
        let mut out = String::new();
        detok.push(b"", &mut out);
        detok.push(b"  Hi", &mut out);
        detok.push(b" there", &mut out);
        assert_eq!(out, " Hi there");
    }

    #[test]
    fn matches_lossy_decode_for_any_split() {
        let samples: [&[u8]; 4] = [
            "naïve café 😀 你好 𝄞".as_bytes(),
            b"\xf0\x9f\x98\x80\xff\xfe\xe4\xbd\xa0\xc3",
            b"\xed\xa0\x80 surrogate \xc0\xaf overlong",
            b"\xf4\x90\x80\x80 too high \xe2\x82",
        ];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for sample in samples {
            for _ in 0..200 {
                let mut detok = Detok::new(false);
                let mut out = String::new();
                let mut rest = sample;
                while !rest.is_empty() {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let n = 1 + (seed % 4) as usize;
                    let (chunk, tail) = rest.split_at(n.min(rest.len()));
                    detok.push(chunk, &mut out);
                    rest = tail;
                }
                detok.finish(&mut out);
                assert_eq!(out, String::from_utf8_lossy(sample));
            }
        }
    }
}
