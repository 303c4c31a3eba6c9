//! Protocol event state machines, one module per API dialect, driven by the router through `Protocol`.

pub mod anthropic;
pub mod openai;

/// Why a message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish<'a> {
    EndTurn,
    MaxTokens,
    StopSequence(&'a str),
    /// The generation ended after at least one complete tool call.
    ToolUse,
}

/// The dialect state of one stream.
#[derive(Debug)]
pub enum Protocol {
    Anthropic(anthropic::AnthropicStream),
    /// Boxed so plain Anthropic streams keep the smaller footprint.
    OpenAi(Box<openai::OpenAiStream>),
}

macro_rules! dispatch {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            Self::Anthropic($s) => $call,
            Self::OpenAi($s) => $call,
        }
    };
}

impl Protocol {
    /// Frames sent as soon as the stream opens, before any token.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.start(out))
    }

    /// A keep-alive frame; nothing for non-streaming responses.
    pub fn ping(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.ping(out))
    }

    #[inline]
    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.text(text, out))
    }

    pub fn thinking(&mut self, text: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.thinking(text, out))
    }

    /// A tool call named `name` begins; its arguments follow as `tool_args` fragments.
    pub fn tool_start(&mut self, name: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_start(name, out))
    }

    pub fn tool_args(&mut self, fragment: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_args(fragment, out))
    }

    pub fn tool_end(&mut self, out: &mut Vec<u8>) {
        dispatch!(self, s => s.tool_end(out))
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        dispatch!(self, s => s.finish(finish, output_tokens, out))
    }

    pub fn error(&mut self, error_type: &str, message: &str, out: &mut Vec<u8>) {
        dispatch!(self, s => s.error(error_type, message, out))
    }

    /// False for dialects that carry plain text only (legacy completions).
    pub fn supports_markup(&self) -> bool {
        match self {
            Self::Anthropic(_) => true,
            Self::OpenAi(s) => s.supports_markup(),
        }
    }
}

/// Appends a deterministic tool-call id: `prefix` and 24 base62 chars hashed from the message id
/// and the call's position, so transcripts are reproducible.
pub fn tool_call_id(prefix: &str, message_id: &str, index: u32, out: &mut String) {
    const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    // FNV-1a over the id, then splitmix64 as a stream of digits.
    let mut state = message_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    out.push_str(prefix);
    for _ in 0..3 {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        for _ in 0..8 {
            out.push(char::from(ALPHABET[(z % 62) as usize]));
            z /= 62;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_ids_are_stable_and_distinct() {
        let id = |m: &str, i| {
            let mut out = String::new();
            tool_call_id("toolu_", m, i, &mut out);
            out
        };
        assert_eq!(id("msg_1", 0), id("msg_1", 0));
        assert_ne!(id("msg_1", 0), id("msg_1", 1));
        assert_ne!(id("msg_1", 0), id("msg_2", 0));
        let a = id("msg_1", 0);
        assert_eq!(a.len(), 6 + 24);
        assert!(a[6..].bytes().all(|b| b.is_ascii_alphanumeric()));
    }
}
