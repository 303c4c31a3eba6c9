//! Incremental JSON validator: takes one byte at a time and rejects the first byte no valid JSON could follow with.

/// Result of [`JsonScan::push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// Consumed; the value is not complete yet.
    More,
    /// Consumed, and it completed the value.
    Done,
    /// Not consumed: the value (a number) had ended just before this byte.
    DoneBefore,
    /// Not consumed: no JSON value can continue with this byte.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Value,
    ValueOrClose,
    KeyOrClose,
    Key,
    Colon,
    CommaOrClose,
    Str { key: bool },
    Escape { key: bool },
    Unicode { key: bool, left: u8 },
    Num(Num),
    Lit(&'static [u8]),
    End,
}

/// Nesting deeper than this is treated as invalid (bounds the stack a model can make us grow).
const MAX_DEPTH: usize = 128;

/// Validates one JSON value (leading whitespace allowed, nothing after it). Every prefix it
/// accepts is the prefix of some valid JSON text; [`JsonScan::complete`] writes a shortest tail.
#[derive(Debug, Clone)]
pub struct JsonScan {
    state: State,
    /// Open containers, `{` or `[`.
    stack: Vec<u8>,
}

impl Default for JsonScan {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonScan {
    pub fn new() -> Self {
        Self {
            state: State::Value,
            stack: Vec::new(),
        }
    }

    pub fn reset(&mut self) {
        self.state = State::Value;
        self.stack.clear();
    }

    /// True once the first byte of the value has been consumed.
    pub fn started(&self) -> bool {
        self.state != State::Value || !self.stack.is_empty()
    }

    pub fn push(&mut self, b: u8) -> Scan {
        loop {
            let (state, scan) = self.step(b);
            match scan {
                // A number ended at a structural byte inside a container: reprocess it there.
                Step::Again => self.state = state,
                Step::Scan(scan) => {
                    self.state = state;
                    return scan;
                }
            }
        }
    }

    fn after_value(&self) -> (State, Scan) {
        if self.stack.is_empty() {
            (State::End, Scan::Done)
        } else {
            (State::CommaOrClose, Scan::More)
        }
    }

    fn open(&mut self, b: u8) -> (State, Step) {
        if self.stack.len() >= MAX_DEPTH {
            return (self.state, Step::Scan(Scan::Invalid));
        }
        self.stack.push(b);
        let state = if b == b'{' {
            State::KeyOrClose
        } else {
            State::ValueOrClose
        };
        (state, Step::Scan(Scan::More))
    }

    fn close(&mut self, b: u8) -> (State, Step) {
        let want = if b == b'}' { b'{' } else { b'[' };
        if self.stack.last() != Some(&want) {
            return (self.state, Step::Scan(Scan::Invalid));
        }
        self.stack.pop();
        let (state, scan) = self.after_value();
        (state, Step::Scan(scan))
    }

    fn value_start(&mut self, b: u8) -> (State, Step) {
        let more = Step::Scan(Scan::More);
        match b {
            b'{' | b'[' => self.open(b),
            b'"' => (State::Str { key: false }, more),
            b'-' => (State::Num(Num::Minus), more),
            b'0' => (State::Num(Num::Zero), more),
            b'1'..=b'9' => (State::Num(Num::Int), more),
            b't' => (State::Lit(b"rue"), more),
            b'f' => (State::Lit(b"alse"), more),
            b'n' => (State::Lit(b"ull"), more),
            _ => (self.state, Step::Scan(Scan::Invalid)),
        }
    }

    fn step(&mut self, b: u8) -> (State, Step) {
        let more = Step::Scan(Scan::More);
        let invalid = (self.state, Step::Scan(Scan::Invalid));
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.state {
            State::Value
            | State::ValueOrClose
            | State::KeyOrClose
            | State::Key
            | State::Colon
            | State::CommaOrClose
                if ws =>
            {
                (self.state, more)
            }
            State::Value => self.value_start(b),
            State::ValueOrClose if b == b']' => self.close(b),
            State::ValueOrClose => self.value_start(b),
            State::KeyOrClose if b == b'}' => self.close(b),
            State::KeyOrClose | State::Key if b == b'"' => (State::Str { key: true }, more),
            State::KeyOrClose | State::Key => invalid,
            State::Colon if b == b':' => (State::Value, more),
            State::Colon => invalid,
            State::CommaOrClose => match (b, self.stack.last()) {
                (b',', Some(b'{')) => (State::Key, more),
                (b',', _) => (State::Value, more),
                (b'}' | b']', _) => self.close(b),
                _ => invalid,
            },
            State::Str { key } => match b {
                b'"' if key => (State::Colon, more),
                b'"' => {
                    let (state, scan) = self.after_value();
                    (state, Step::Scan(scan))
                }
                b'\\' => (State::Escape { key }, more),
                0..=0x1f => invalid,
                _ => (self.state, more),
            },
            State::Escape { key } => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    (State::Str { key }, more)
                }
                b'u' => (State::Unicode { key, left: 4 }, more),
                _ => invalid,
            },
            State::Unicode { key, left } if b.is_ascii_hexdigit() => {
                if left == 1 {
                    (State::Str { key }, more)
                } else {
                    (
                        State::Unicode {
                            key,
                            left: left - 1,
                        },
                        more,
                    )
                }
            }
            State::Unicode { .. } => invalid,
            State::Num(num) => {
                let next = match (num, b) {
                    (Num::Minus, b'0') => Some(Num::Zero),
                    (Num::Minus, b'1'..=b'9') => Some(Num::Int),
                    (Num::Int, b'0'..=b'9') => Some(Num::Int),
                    (Num::Zero | Num::Int, b'.') => Some(Num::Dot),
                    (Num::Dot | Num::Frac, b'0'..=b'9') => Some(Num::Frac),
                    (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Some(Num::E),
                    (Num::E, b'+' | b'-') => Some(Num::ESign),
                    (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Some(Num::Exp),
                    _ => None,
                };
                match next {
                    Some(num) => (State::Num(num), more),
                    None if matches!(num, Num::Zero | Num::Int | Num::Frac | Num::Exp) => {
                        if self.stack.is_empty() {
                            (State::End, Step::Scan(Scan::DoneBefore))
                        } else {
                            (State::CommaOrClose, Step::Again)
                        }
                    }
                    None => invalid,
                }
            }
            State::Lit(rest) => match rest.split_first() {
                Some((&want, tail)) if want == b => {
                    if tail.is_empty() {
                        let (state, scan) = self.after_value();
                        (state, Step::Scan(scan))
                    } else {
                        (State::Lit(tail), more)
                    }
                }
                _ => invalid,
            },
            State::End => invalid,
        }
    }

    /// True when the bytes so far form a complete value (a number may still grow).
    pub fn is_complete(&self) -> bool {
        self.state == State::End
            || (self.stack.is_empty()
                && matches!(
                    self.state,
                    State::Num(Num::Zero | Num::Int | Num::Frac | Num::Exp)
                ))
    }

    /// Appends a shortest text that makes the bytes so far one complete value (`null` if nothing
    /// was pushed). A dangling key gets `null` for its value; a trailing comma gets a filler item.
    pub fn complete(&self, out: &mut String) {
        match self.state {
            State::Value => out.push_str("null"),
            State::Key => out.push_str("\"\":null"),
            State::Colon => out.push_str(":null"),
            State::Str { key } => {
                out.push('"');
                if key {
                    out.push_str(":null");
                }
            }
            State::Escape { key } => {
                out.push_str("\\\"");
                if key {
                    out.push_str(":null");
                }
            }
            State::Unicode { key, left } => {
                out.extend(std::iter::repeat_n('0', usize::from(left)));
                out.push('"');
                if key {
                    out.push_str(":null");
                }
            }
            State::Num(Num::Minus | Num::Dot | Num::E | Num::ESign) => out.push('0'),
            State::Lit(rest) => out.extend(rest.iter().map(|&b| char::from(b))),
            State::Num(_)
            | State::ValueOrClose
            | State::KeyOrClose
            | State::CommaOrClose
            | State::End => {}
        }
        for &open in self.stack.iter().rev() {
            out.push(if open == b'{' { '}' } else { ']' });
        }
    }
}

enum Step {
    Scan(Scan),
    Again,
}

/// True if `text` is exactly one JSON value (surrounding whitespace allowed).
pub fn is_valid(text: &str) -> bool {
    let mut scan = JsonScan::new();
    text.trim_matches([' ', '\t', '\n', '\r']) // JSON's whitespace: no form feed
        .bytes()
        .all(|b| matches!(scan.push(b), Scan::More | Scan::Done))
        && scan.is_complete()
}

/// Appends `json` without the whitespace between tokens (string contents are kept as written).
pub fn minify(json: &str, out: &mut String) {
    let mut in_string = false;
    let mut escaped = false;
    let mut from = 0;
    for (i, b) in json.bytes().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
        } else if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            out.push_str(&json[from..i]);
            from = i + 1;
        }
    }
    out.push_str(&json[from..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_all(text: &str) -> Result<bool, usize> {
        let mut scan = JsonScan::new();
        for (i, &b) in text.as_bytes().iter().enumerate() {
            match scan.push(b) {
                Scan::More | Scan::Done => {}
                Scan::DoneBefore | Scan::Invalid => return Err(i),
            }
        }
        Ok(scan.is_complete())
    }

    #[test]
    fn accepts_valid_values() {
        for text in [
            "{}",
            "[]",
            " {\"a\": [1, -0.5e+3, true, false, null, \"x\\\"\\\\\\u00e9\"], \"b\": {}}",
            "\"é😀\"",
            "0",
            "[[[]]]",
            "{\"k\":{\"k\":[{\"k\":\"v\"}]}}",
        ] {
            assert_eq!(scan_all(text), Ok(true), "{text}");
            assert!(is_valid(text), "{text}");
        }
    }

    #[test]
    fn only_json_whitespace_surrounds_a_value() {
        assert!(is_valid(" \t\r\n1\n"));
        assert!(!is_valid("\n1\u{c}")); // form feed (found by fuzz/jsonscan)
    }

    #[test]
    fn rejects_at_first_bad_byte() {
        for (text, at) in [
            ("{\"a\" 1}", 5),
            ("{\"a\":}", 5),
            ("[1,]", 3),
            ("{,}", 1),
            ("tru e", 3),
            ("01", 1),
            ("\"a\nb\"", 2),
            ("\"\\x\"", 2),
            ("\"\\u00g\"", 5),
            ("{\"a\":1]", 6),
            ("{} x", 2),
            ("-a", 1),
            ("1.e", 2),
        ] {
            assert_eq!(scan_all(text), Err(at), "{text}");
            assert!(!is_valid(text), "{text}");
        }
        assert!(is_valid(" 12 "));
        assert!(!is_valid("{"));
        assert!(!is_valid(""));
    }

    #[test]
    fn every_prefix_completes_to_valid_json() {
        let text = "{\"cmd\": \"a\\\"b\\\\c\\u00e9\", \"n\": -1.5e-3, \"l\": [true, null, {\"x\": false}], \"\u{e9}\": 0}";
        for end in 0..=text.len() {
            if !text.is_char_boundary(end) {
                continue;
            }
            let mut scan = JsonScan::new();
            for &b in &text.as_bytes()[..end] {
                assert!(matches!(scan.push(b), Scan::More | Scan::Done));
            }
            let mut done = text[..end].to_string();
            scan.complete(&mut done);
            let parsed: Result<serde_json::Value, _> = serde_json::from_str(&done);
            assert!(parsed.is_ok(), "{done}");
        }
    }

    #[test]
    fn dangling_key_and_comma_complete() {
        for (text, tail) in [
            ("{\"a\"", ":null}"),
            ("{\"a\":1,", "\"\":null}"),
            ("[1,", "null]"),
            ("{\"a\":\"x\\", "\\\"}"),
            ("[tr", "ue]"),
        ] {
            let mut scan = JsonScan::new();
            text.bytes().for_each(|b| {
                scan.push(b);
            });
            let mut out = String::new();
            scan.complete(&mut out);
            assert_eq!(out, tail, "{text}");
        }
    }

    #[test]
    fn number_end_is_reported_before_the_next_byte() {
        let mut scan = JsonScan::new();
        assert_eq!(scan.push(b'4'), Scan::More);
        assert!(scan.is_complete());
        assert_eq!(scan.push(b'}'), Scan::DoneBefore);
        let mut scan = JsonScan::new();
        for b in *b"[4" {
            scan.push(b);
        }
        assert_eq!(scan.push(b']'), Scan::Done);
    }

    #[test]
    fn depth_is_bounded() {
        let mut scan = JsonScan::new();
        let results: Vec<Scan> = (0..200).map(|_| scan.push(b'[')).collect();
        assert_eq!(results[MAX_DEPTH - 1], Scan::More);
        assert_eq!(results[MAX_DEPTH], Scan::Invalid);
    }

    #[test]
    fn minify_keeps_strings() {
        let mut out = String::new();
        minify("{ \"a b\" : [1, \"x \\\" y\"],\n \"c\": {} }", &mut out);
        assert_eq!(out, "{\"a b\":[1,\"x \\\" y\"],\"c\":{}}");
    }
}
