//! The raw text input of a custom (freeform) tool call, read out of the JSON arguments the
//! model's tool format writes.
//!
//! The prompt shows a custom tool as a function of one string parameter, `input` (see
//! `python/mlxgate/api/custom_tools.py`), so a call arrives as argument fragments of
//! `{"input": "..."}`. The encoders stream the string's decoded text as it comes
//! (`response.custom_tool_call_input.delta`, Chat's `custom.input`) and end with the whole input.

/// The parameter a custom tool's input is written in.
pub const INPUT: &str = "input";

#[derive(Debug, Default)]
enum State {
    /// Before the string's opening quote: the arguments so far are `{"input":` and spaces.
    #[default]
    Opening,
    /// Inside the string: `raw[decoded..]` is what is not yet decoded.
    Value { decoded: usize },
    /// The string closed, or the arguments are not `{"input": "...`: nothing more streams.
    Done,
}

/// One call's arguments as they come, and the input text decoded from them so far.
#[derive(Debug, Default)]
pub struct CustomInput {
    arguments: String,
    state: State,
    streamed: String,
}

impl CustomInput {
    /// Takes an argument fragment; returns the input text it completes (maybe empty).
    pub fn push(&mut self, fragment: &str) -> String {
        self.arguments.push_str(fragment);
        if let State::Opening = self.state {
            match value_start(&self.arguments) {
                Some(Some(start)) => self.state = State::Value { decoded: start },
                Some(None) => return String::new(),
                None => self.state = State::Done,
            }
        }
        let State::Value { decoded } = self.state else {
            return String::new();
        };
        let (cut, closed) = decodable(&self.arguments[decoded..]);
        let text = unescape(&self.arguments[decoded..decoded + cut]);
        self.state = if closed {
            State::Done
        } else {
            State::Value {
                decoded: decoded + cut,
            }
        };
        self.streamed.push_str(&text);
        text
    }

    /// The whole input once the call ended, and what of it was not streamed yet (a call whose
    /// arguments are not `{"input": "..."}` is sent whole at its end: its `input` string if it
    /// has one, else the arguments as written).
    pub fn finish(&self) -> (String, String) {
        let whole = match serde_json::from_str::<serde_json::Value>(&self.arguments) {
            Ok(serde_json::Value::Object(map)) => match map.get(INPUT) {
                Some(serde_json::Value::String(input)) => input.clone(),
                _ => self.arguments.clone(),
            },
            _ if self.streamed.is_empty() => self.arguments.clone(),
            _ => self.streamed.clone(), // cut short (max_tokens): what was written
        };
        let rest = whole
            .strip_prefix(self.streamed.as_str())
            .unwrap_or_default()
            .to_owned();
        (whole, rest)
    }
}

/// Where the input string's text starts: Some(Some(offset)) after `{"input": "`, Some(None) if
/// the arguments may still become that, None if they cannot.
fn value_start(arguments: &str) -> Option<Option<usize>> {
    let expected = ["{", "\"input\"", ":", "\""];
    let mut rest = arguments;
    for piece in expected {
        let trimmed = rest.trim_start();
        if trimmed.len() < piece.len() {
            return piece.starts_with(trimmed).then_some(None);
        }
        rest = trimmed.strip_prefix(piece)?;
    }
    Some(Some(arguments.len() - rest.len()))
}

/// How much of a JSON string's raw text (after its opening quote) decodes whole: up to an
/// escape not yet complete (a `\u` high surrogate waits for its low half), or to the closing
/// quote (then true).
fn decodable(raw: &str) -> (usize, bool) {
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return (i, true),
            b'\\' => {
                let Some(&kind) = bytes.get(i + 1) else {
                    return (i, false);
                };
                let length = if kind == b'u' {
                    match bytes.get(i + 2..i + 6) {
                        None => return (i, false),
                        Some(hex) if is_high_surrogate(hex) => 12,
                        Some(_) => 6,
                    }
                } else {
                    2
                };
                if i + length > bytes.len() {
                    return (i, false);
                }
                i += length;
            }
            _ => i += 1,
        }
    }
    (i, false)
}

fn is_high_surrogate(hex: &[u8]) -> bool {
    std::str::from_utf8(hex)
        .ok()
        .and_then(|hex| u16::from_str_radix(hex, 16).ok())
        .is_some_and(|unit| (0xD800..0xDC00).contains(&unit))
}

/// A JSON string's raw text decoded; what does not decode is kept as written.
fn unescape(raw: &str) -> String {
    if !raw.contains('\\') {
        return raw.to_owned();
    }
    let quoted = format!("\"{raw}\"");
    serde_json::from_str(&quoted).unwrap_or_else(|_| raw.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(fragments: &[&str]) -> (String, String) {
        let mut input = CustomInput::default();
        let text: String = fragments.iter().map(|f| input.push(f)).collect();
        let (whole, rest) = input.finish();
        assert_eq!(format!("{text}{rest}"), whole);
        (text, whole)
    }

    #[test]
    fn the_input_streams_decoded_as_it_comes() {
        let (text, whole) = streamed(&[
            "{\"in",
            "put\": \"*** Begin",
            " Patch\\",
            "n+\\u00e9\\ud83d",
            "\\ude00\\\"x\\\\\"",
            "}",
        ]);
        assert_eq!(text, "*** Begin Patch\n+é😀\"x\\");
        assert_eq!(whole, text);
    }

    #[test]
    fn arguments_of_another_shape_go_whole_at_the_end() {
        let (text, whole) = streamed(&["{\"patch\": \"a\", ", "\"input\": \"b\"}"]);
        assert_eq!((text.as_str(), whole.as_str()), ("", "b"));
        let (text, whole) = streamed(&["not json"]);
        assert_eq!((text.as_str(), whole.as_str()), ("", "not json"));
    }

    #[test]
    fn a_call_cut_short_keeps_what_was_written() {
        let (text, whole) = streamed(&["{\"input\": \"*** Begin Pa"]);
        assert_eq!(
            (text.as_str(), whole.as_str()),
            ("*** Begin Pa", "*** Begin Pa")
        );
    }
}
