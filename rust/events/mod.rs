//! Protocol event state machines, one module per API dialect, driven by the router through `Protocol`.

pub mod anthropic;

/// Why a message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish<'a> {
    EndTurn,
    MaxTokens,
    StopSequence(&'a str),
}

/// The dialect state of one stream. An OpenAI chat.completion.chunk machine becomes a second variant.
#[derive(Debug)]
pub enum Protocol {
    Anthropic(anthropic::AnthropicStream),
}

impl Protocol {
    /// Frames sent as soon as the stream opens, before any token.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic(s) => s.start(out),
        }
    }

    /// A keep-alive frame; nothing for non-streaming responses.
    pub fn ping(&mut self, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic(s) => s.ping(out),
        }
    }

    pub fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic(s) => s.text(text, out),
        }
    }

    pub fn finish(&mut self, finish: Finish<'_>, output_tokens: u64, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic(s) => s.finish(finish, output_tokens, out),
        }
    }

    pub fn error(&mut self, error_type: &str, message: &str, out: &mut Vec<u8>) {
        match self {
            Self::Anthropic(s) => s.error(error_type, message, out),
        }
    }
}
