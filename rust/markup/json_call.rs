//! The JSON call object `{"name": …, "arguments"|"parameters": {…}}`: one in hermes's tags, a list of them in json_list (mistral, llama3_json).

use super::ToolOut;
use crate::jsonscan::{is_valid, JsonScan, Scan};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CallStatus {
    /// All input consumed; the object is still open.
    Open,
    /// The object closed at the returned position.
    Complete,
    /// The byte at the returned position cannot continue the call.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Name,
    /// An arguments object, passed through as written.
    Args,
    /// Arguments written as a JSON string holding the object.
    ArgsString,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Obj {
    Open,
    KeyOrClose,
    Key,
    InKey,
    Colon,
    Value,
    InValue(Slot),
    CommaOrClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArgsState {
    None,
    Partial,
    Done,
}

/// One call object `{"name": …, "arguments"|"parameters": {…}}`. The call is committed (its
/// start emitted) once the name is known; arguments stream from then on, buffered before.
#[derive(Debug, Clone)]
pub(super) struct CallParser {
    obj: Obj,
    scan: JsonScan,
    /// The raw text of the current key, name or string-encoded arguments.
    buf: String,
    key: String,
    /// Arguments seen before the name (or decoded from a string).
    args: String,
    args_state: ArgsState,
    committed: bool,
}

impl Default for CallParser {
    fn default() -> Self {
        Self {
            obj: Obj::Open,
            scan: JsonScan::new(),
            buf: String::new(),
            key: String::new(),
            args: String::new(),
            args_state: ArgsState::None,
            committed: false,
        }
    }
}

impl CallParser {
    /// True once the name is known and emitted.
    pub(super) fn committed(&self) -> bool {
        self.committed
    }

    fn accumulating(&self) -> bool {
        matches!(
            self.obj,
            Obj::InKey | Obj::InValue(Slot::Name | Slot::ArgsString | Slot::Args)
        )
    }

    fn flush(&mut self, part: &str, out: &mut ToolOut<'_>) {
        match self.obj {
            Obj::InValue(Slot::Args) if self.committed => out.args(part),
            Obj::InValue(Slot::Args) => self.args.push_str(part),
            Obj::InKey | Obj::InValue(Slot::Name | Slot::ArgsString) => self.buf.push_str(part),
            _ => {}
        }
    }

    pub(super) fn feed(&mut self, s: &str, out: &mut ToolOut<'_>) -> (usize, CallStatus) {
        let bytes = s.as_bytes();
        let mut mark = 0;
        let mut i = 0;
        let mut status = CallStatus::Open;
        while i < bytes.len() {
            let b = bytes[i];
            let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
            match self.obj {
                Obj::InKey | Obj::InValue(_) => {
                    let scan = self.scan.push(b);
                    match scan {
                        Scan::More => {}
                        Scan::Done | Scan::DoneBefore => {
                            let end = if scan == Scan::Done { i + 1 } else { i };
                            self.flush(&s[mark..end], out);
                            if !self.value_done(out) {
                                status = CallStatus::Invalid;
                                break;
                            }
                            i = end;
                            continue;
                        }
                        Scan::Invalid => {
                            status = CallStatus::Invalid;
                            break;
                        }
                    }
                }
                _ if ws => {}
                Obj::Open if b == b'{' => self.obj = Obj::KeyOrClose,
                Obj::KeyOrClose | Obj::CommaOrClose if b == b'}' => {
                    if !self.close(out) {
                        status = CallStatus::Invalid;
                        break;
                    }
                    i += 1;
                    status = CallStatus::Complete;
                    break;
                }
                Obj::KeyOrClose | Obj::Key if b == b'"' => {
                    self.buf.clear();
                    self.scan.reset();
                    self.scan.push(b);
                    self.obj = Obj::InKey;
                    mark = i;
                }
                Obj::Colon if b == b':' => self.obj = Obj::Value,
                Obj::CommaOrClose if b == b',' => self.obj = Obj::Key,
                Obj::Value => {
                    let slot = match self.key.as_str() {
                        "name" if !self.committed => Slot::Name,
                        "arguments" | "parameters" if self.args_state == ArgsState::None => {
                            if b == b'"' {
                                Slot::ArgsString
                            } else {
                                Slot::Args
                            }
                        }
                        _ => Slot::Other,
                    };
                    let ok = match slot {
                        Slot::Name | Slot::ArgsString => b == b'"',
                        Slot::Args => b == b'{',
                        Slot::Other => true,
                    };
                    self.scan.reset();
                    if !ok || self.scan.push(b) != Scan::More {
                        status = CallStatus::Invalid;
                        break;
                    }
                    if slot != Slot::Other {
                        self.args_state = match slot {
                            Slot::Args | Slot::ArgsString => ArgsState::Partial,
                            _ => self.args_state,
                        };
                        self.buf.clear();
                        mark = i;
                    }
                    self.obj = Obj::InValue(slot);
                }
                _ => {
                    status = CallStatus::Invalid;
                    break;
                }
            }
            i += 1;
        }
        if self.accumulating() {
            self.flush(&s[mark..i], out);
        }
        (i, status)
    }

    /// The key or value being scanned ended (its text flushed). False if the call is malformed.
    fn value_done(&mut self, out: &mut ToolOut<'_>) -> bool {
        let obj = self.obj;
        self.obj = Obj::CommaOrClose;
        match obj {
            Obj::InKey => match serde_json::from_str::<String>(&self.buf) {
                Ok(key) => {
                    self.key = key;
                    self.obj = Obj::Colon;
                }
                Err(_) => return false,
            },
            Obj::InValue(Slot::Name) => {
                let Ok(name) = serde_json::from_str::<String>(&self.buf) else {
                    return false;
                };
                if name.is_empty() {
                    return false;
                }
                self.committed = true;
                out.start(&name);
                out.args(&self.args);
                self.args.clear();
            }
            Obj::InValue(Slot::ArgsString) => {
                let Ok(args) = serde_json::from_str::<String>(&self.buf) else {
                    return false;
                };
                let args = args.trim();
                if !args.starts_with('{') || !is_valid(args) {
                    return false;
                }
                self.args_state = ArgsState::Done;
                if self.committed {
                    out.args(args);
                } else {
                    self.args.push_str(args);
                }
            }
            Obj::InValue(Slot::Args) => self.args_state = ArgsState::Done,
            _ => {}
        }
        true
    }

    /// The object closed. False if it never named a tool.
    fn close(&mut self, out: &mut ToolOut<'_>) -> bool {
        if !self.committed {
            return false;
        }
        if self.args_state == ArgsState::None {
            out.args("{}");
        }
        out.end(true);
        true
    }

    /// Ends a committed call early, closing its arguments JSON validly.
    pub(super) fn abort(&mut self, out: &mut ToolOut<'_>) {
        match (self.args_state, self.obj) {
            (ArgsState::Partial, Obj::InValue(Slot::Args)) => {
                out.args_with(|buf| self.scan.complete(buf));
            }
            (ArgsState::Done, _) => {}
            _ => out.args("{}"),
        }
        out.end(self.args_state == ArgsState::Done);
    }
}

#[cfg(test)]
mod tests {
    use crate::markup::tests::{all_splits, p, pieces_by_chunk, run, spec};
    use crate::markup::PieceKind::{ToolArgs, ToolEnd, ToolStart};

    #[test]
    fn args_stream_as_tokens_arrive() {
        let mut parser = crate::markup::tests::parser(spec(false, Some("hermes")));
        let seen = pieces_by_chunk(
            &mut parser,
            &[
                "<tool_call>{\"name\":\"f\",",
                "\"arguments\":{\"a\"",
                ": [1, 2",
                "]}}",
            ],
        );
        assert_eq!(
            seen,
            [
                "ToolStart:f",
                "ToolArgs:{\"a\"",
                "ToolArgs:: [1, 2",
                "ToolArgs:]} ToolEnd:"
            ]
        );
    }

    #[test]
    fn name_after_arguments_and_parameters_synonym() {
        let text = "<tool_call>{\"parameters\": {\"q\": \"x\"}, \"id\": 3, \"name\": \"Search\"}</tool_call>";
        for chunks in all_splits(text, 5) {
            let (got, _) = run(spec(false, Some("hermes")), "", &chunks);
            assert_eq!(
                got,
                vec![
                    p(ToolStart, "Search"),
                    p(ToolArgs, "{\"q\": \"x\"}"),
                    p(ToolEnd, "")
                ]
            );
        }
    }

    #[test]
    fn string_encoded_arguments() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": \\\"\\\\u00e9\\\"}\"}</tool_call>";
        let (got, _) = run(spec(false, Some("hermes")), "", &[text]);
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"a\": \"\\u00e9\"}"),
                p(ToolEnd, "")
            ]
        );
    }

    #[test]
    fn truncated_call_at_finish() {
        let (got, parser) = run(
            spec(false, Some("hermes")),
            "",
            &["<tool_call>{\"name\": \"f\", \"arguments\": {\"cmd\": \"ec"],
        );
        assert_eq!(
            got,
            vec![
                p(ToolStart, "f"),
                p(ToolArgs, "{\"cmd\": \"ec\"}"),
                p(ToolEnd, "")
            ]
        );
        assert_eq!((parser.tool_calls(), parser.truncated()), (1, true));
        let (got, parser) = run(
            spec(false, Some("hermes")),
            "",
            &["<tool_call>{\"name\": \"f\"}"],
        );
        assert_eq!(
            got,
            vec![p(ToolStart, "f"), p(ToolArgs, "{}"), p(ToolEnd, "")]
        );
        assert!(!parser.truncated());
    }
}
