//! A bare arguments object `{…}` after a call's name (harmony, mistral_v11, kimi_k2, deepseek_v3), streamed as written; the call's end after it (harmony, kimi_k2, deepseek_v3).

use super::ToolOut;
use crate::jsonscan::{JsonScan, Scan};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArgsStatus {
    /// All input consumed; the object is still open (or not begun).
    Open,
    /// The object closed at the returned position.
    Done,
    /// The byte at the returned position cannot continue the object.
    Invalid,
}

/// One call's arguments object. Leading whitespace and a Markdown fence (```` ```json ````, as
/// DeepSeek V3 writes) are skipped; every byte of the object is written as it arrives.
#[derive(Debug, Clone, Default)]
pub(super) struct JsonArgs {
    scan: JsonScan,
    /// Bytes of an opening fence seen.
    fence: u8,
    state: State,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    #[default]
    Before,
    In,
    Done,
}

const FENCE: &[u8] = b"```json";

impl JsonArgs {
    pub(super) fn feed(&mut self, s: &str, out: &mut ToolOut<'_>) -> (usize, ArgsStatus) {
        let bytes = s.as_bytes();
        let mut i = 0;
        if self.state == State::Before {
            while i < bytes.len() {
                let b = bytes[i];
                if usize::from(self.fence) < FENCE.len() && b == FENCE[usize::from(self.fence)] {
                    self.fence += 1;
                } else if b == b'{' {
                    self.state = State::In;
                    break;
                } else if !b.is_ascii_whitespace() {
                    return (i, ArgsStatus::Invalid);
                }
                i += 1;
            }
            if self.state == State::Before {
                return (i, ArgsStatus::Open);
            }
        }
        if self.state == State::Done {
            return (0, ArgsStatus::Done);
        }
        let mark = i;
        while i < bytes.len() {
            match self.scan.push(bytes[i]) {
                Scan::More => i += 1,
                Scan::Done => {
                    out.args(&s[mark..=i]);
                    self.state = State::Done;
                    return (i + 1, ArgsStatus::Done);
                }
                Scan::DoneBefore | Scan::Invalid => {
                    out.args(&s[mark..i]);
                    return (i, ArgsStatus::Invalid);
                }
            }
        }
        out.args(&s[mark..]);
        (i, ArgsStatus::Open)
    }

    /// Ends the object early: writes the shortest valid close (`{}` if it never began). Returns
    /// true if the object was already complete.
    pub(super) fn close(&mut self, out: &mut ToolOut<'_>) -> bool {
        let state = std::mem::replace(&mut self.state, State::Done);
        match state {
            State::Before => out.args("{}"),
            State::In => out.args_with(|buf| self.scan.complete(buf)),
            State::Done => {}
        }
        state == State::Done
    }

    /// Ends the call: closes the object if it is still open (the call is then cut short).
    pub(super) fn end_call(&mut self, out: &mut ToolOut<'_>) {
        let complete = self.close(out);
        out.end(complete);
    }
}

/// A call's arguments object where a tag of the markup's own ends the call after it (harmony's
/// message end, kimi_k2's and deepseek_v3's call end): the call ends at that tag, or at once, cut
/// short, where the object breaks.
#[derive(Debug, Clone, Default)]
pub(super) struct CallArgs {
    args: JsonArgs,
    ended: bool,
}

impl CallArgs {
    /// Reads the object: the bytes used, and whether it is over (if not, all of `s` is used).
    pub(super) fn feed(&mut self, s: &str, out: &mut ToolOut<'_>) -> (usize, bool) {
        let (used, status) = self.args.feed(s, out);
        match status {
            ArgsStatus::Open => return (used, false),
            ArgsStatus::Done => {}
            ArgsStatus::Invalid => self.end(out),
        }
        (used, true)
    }

    /// The call's end tag, or the end of generation: ends the call, unless broken arguments
    /// already ended it.
    pub(super) fn end(&mut self, out: &mut ToolOut<'_>) {
        if !std::mem::replace(&mut self.ended, true) {
            self.args.end_call(out);
        }
    }
}
