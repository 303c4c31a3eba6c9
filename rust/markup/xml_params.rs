//! Parameters written as raw text (the XML formats) to arguments JSON, typed by the tool's schema and written as they arrive.

use super::schema::Types;
use super::tags::{find_first, safe_len};
use super::ToolOut;
use crate::jsonscan::{is_valid, minify};

/// Writes one call's arguments object from (key, raw value) parameters.
///
/// A value whose schema allows only strings (or says nothing) streams as a JSON string while it
/// is written; any other is buffered to its end and written as JSON when it reads as one of its
/// types (`3` for an integer, `true`, `null`, an object or array), else as a string. A string
/// drops one newline at each end (Qwen3-Coder writes `<parameter=k>\nvalue\n</parameter>`).
#[derive(Debug, Default)]
pub(super) struct XmlArgs {
    /// Parameters begun in this call.
    count: u32,
    value: Value,
    /// A typed value's text so far.
    buf: String,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Value {
    #[default]
    None,
    /// A string being streamed; `started` once its first byte was seen, `held_newline` while its
    /// text so far ends with a newline that the value's end would drop.
    Str {
        started: bool,
        held_newline: bool,
    },
    Typed(Types),
}

impl XmlArgs {
    /// A parameter begins: writes its key (and a string's opening quote).
    pub(super) fn key(&mut self, key: &str, types: Types, out: &mut ToolOut<'_>) {
        self.end_value(out);
        let first = self.count == 0;
        self.count += 1;
        self.value = if types.is_string() {
            Value::Str {
                started: false,
                held_newline: false,
            }
        } else {
            self.buf.clear();
            Value::Typed(types)
        };
        let string = matches!(self.value, Value::Str { .. });
        out.args_with(|buf| {
            buf.push(if first { '{' } else { ',' });
            write_str(key, buf);
            buf.push(':');
            if string {
                buf.push('"');
            }
        });
    }

    /// More of the current value's raw text.
    pub(super) fn value(&mut self, mut text: &str, out: &mut ToolOut<'_>) {
        match &mut self.value {
            Value::None => {}
            Value::Typed(_) => self.buf.push_str(text),
            Value::Str {
                started,
                held_newline,
            } => {
                if text.is_empty() {
                    return;
                }
                if !*started {
                    *started = true;
                    text = text.strip_prefix('\n').unwrap_or(text);
                }
                let body = text.strip_suffix('\n').unwrap_or(text);
                let held = std::mem::replace(held_newline, body.len() < text.len());
                if held || !body.is_empty() {
                    out.args_with(|buf| {
                        if held {
                            buf.push_str("\\n");
                        }
                        escape(body, buf);
                    });
                }
            }
        }
    }

    /// The current value ended: closes a string, writes a typed value.
    pub(super) fn end_value(&mut self, out: &mut ToolOut<'_>) {
        match std::mem::take(&mut self.value) {
            Value::None => {}
            Value::Str { .. } => out.args("\""),
            Value::Typed(types) => out.args_with(|buf| write_typed(&self.buf, types, buf)),
        }
    }

    /// True while a value is open.
    pub(super) fn in_value(&self) -> bool {
        self.value != Value::None
    }

    /// Closes the arguments object (ending an open value) and readies the writer for the next
    /// call.
    pub(super) fn finish(&mut self, out: &mut ToolOut<'_>) {
        self.end_value(out);
        out.args(if self.count == 0 { "{}" } else { "}" });
        self.count = 0;
    }

    /// Ends the call: its arguments closed, complete unless a value was cut off or the markup
    /// said otherwise (`complete`).
    pub(super) fn end_call(&mut self, complete: bool, out: &mut ToolOut<'_>) {
        let complete = complete && !self.in_value();
        self.finish(out);
        out.end(complete);
    }

    /// Writes value text from `rest` up to the first of `ends`, the tags that can end a value.
    pub(super) fn value_until(
        &mut self,
        rest: &str,
        ends: &[&str],
        out: &mut ToolOut<'_>,
    ) -> ValueEnd {
        if !rest.contains('<') {
            self.value(rest, out);
            return ValueEnd::More(rest.len());
        }
        match find_first(rest, ends) {
            Some((at, index)) => {
                self.value(&rest[..at], out);
                self.end_value(out);
                ValueEnd::Tag { at, index }
            }
            None => {
                let safe = safe_len(rest, ends);
                self.value(&rest[..safe], out);
                ValueEnd::More(safe)
            }
        }
    }
}

/// Where [`XmlArgs::value_until`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ValueEnd {
    /// The value ended where `ends[index]` begins, at byte `at`.
    Tag { at: usize, index: usize },
    /// All but the returned bytes' rest was value text; the rest may begin an end tag.
    More(usize),
}

/// Writes `raw` as the JSON value it reads as among `types`, else as a string.
fn write_typed(raw: &str, types: Types, out: &mut String) {
    let text = raw.trim();
    let literal = if types.has(Types::NULL) && text == "null" {
        Some("null")
    } else if types.has(Types::BOOLEAN) && matches!(text, "true" | "True") {
        Some("true")
    } else if types.has(Types::BOOLEAN) && matches!(text, "false" | "False") {
        Some("false")
    } else {
        None
    };
    if let Some(literal) = literal {
        out.push_str(literal);
        return;
    }
    let first = text.as_bytes().first().copied().unwrap_or(b' ');
    let json = match first {
        b'-' | b'0'..=b'9' if types.has(Types::NUMBER) => is_valid(text),
        b'-' | b'0'..=b'9' if types.has(Types::INTEGER) => {
            is_valid(text) && !text.contains(['.', 'e', 'E'])
        }
        b'{' if types.has(Types::OBJECT) => is_valid(text),
        b'[' if types.has(Types::ARRAY) => is_valid(text),
        _ => false,
    };
    if json {
        minify(text, out);
        return;
    }
    let text = raw.strip_prefix('\n').unwrap_or(raw);
    let text = text.strip_suffix('\n').unwrap_or(text);
    out.push('"');
    escape(text, out);
    out.push('"');
}

/// Writes `text` as a JSON string, quotes included.
pub(super) fn write_str(text: &str, out: &mut String) {
    out.push('"');
    escape(text, out);
    out.push('"');
}

/// Appends `text` JSON-escaped (no quotes).
pub(super) fn escape(text: &str, out: &mut String) {
    let bytes = text.as_bytes();
    let mut from = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0..=0x1f => "",
            _ => continue,
        };
        out.push_str(&text[from..i]);
        if escaped.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
        } else {
            out.push_str(escaped);
        }
        from = i + 1;
    }
    out.push_str(&text[from..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(raw: &str, types: Types) -> String {
        let mut out = String::new();
        write_typed(raw, types, &mut out);
        out
    }

    #[test]
    fn values_typed_by_schema() {
        assert_eq!(typed("\n3\n", Types::INTEGER), "3");
        assert_eq!(typed("3.5", Types::INTEGER), "\"3.5\"");
        assert_eq!(typed("3.5", Types::NUMBER), "3.5");
        assert_eq!(typed("-1e3", Types::NUMBER), "-1e3");
        assert_eq!(typed("three", Types::INTEGER), "\"three\"");
        assert_eq!(typed(" True ", Types::BOOLEAN), "true");
        assert_eq!(typed("false", Types::BOOLEAN), "false");
        assert_eq!(typed("yes", Types::BOOLEAN), "\"yes\"");
        assert_eq!(typed("null", Types::STRING | Types::NULL), "null");
        assert_eq!(typed("nul", Types::STRING | Types::NULL), "\"nul\"");
        assert_eq!(
            typed("\n[{\"a\": 1},\n {\"b\": \"x y\"}]\n", Types::ARRAY),
            "[{\"a\":1},{\"b\":\"x y\"}]"
        );
        assert_eq!(typed("{\"a\": ", Types::OBJECT), "\"{\\\"a\\\": \"");
        assert_eq!(typed("[1]", Types::OBJECT), "\"[1]\"");
        assert_eq!(typed("3", Types::STRING | Types::INTEGER), "3");
        assert_eq!(
            typed("\nline\n\n", Types::STRING | Types::INTEGER),
            "\"line\\n\""
        );
    }

    #[test]
    fn escapes_control_characters() {
        let mut out = String::new();
        write_str("a\"b\\c\nd\te\u{1}é😀</x>", &mut out);
        assert_eq!(out, "\"a\\\"b\\\\c\\nd\\te\\u0001é😀</x>\"");
        let back: String = serde_json::from_str(&out).unwrap();
        assert_eq!(back, "a\"b\\c\nd\te\u{1}é😀</x>");
    }
}
