//! Any token sequence through a stream of any dialect and tool-call format, in any step
//! sizes: no panic, and every frame the client gets is JSON (SSE `data:` lines, or the body).
//!
//! Input: [format, dialect and flags, stop length, stop bytes..., tokens (one byte each)...].
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use mlxgate::events::anthropic::AnthropicParams;
use mlxgate::events::openai::{CompletionKind, OpenAiParams};
use mlxgate::events::responses::ResponsesParams;
use mlxgate::events::{DialectParams, PromptUsage};
use mlxgate::markup::{format_names, MarkupSpec};
use mlxgate::router::{Router, StreamSpec};
use mlxgate::vocab::Vocab;

/// Pieces of every format's markup, JSON, XML and text, with broken UTF-8: 256 tokens at most.
fn vocab() -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    let pieces: &[&str] = &[
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<|channel|>",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|start|>",
        "analysis",
        "final",
        "commentary",
        " to=",
        "functions.",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "<invoke name=",
        "</invoke>",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "<seed:tool_call>",
        "</seed:tool_call>",
        "<|python_tag|>",
        "{\"name\": \"",
        "apply_patch",
        "{\"input\": \"",
        "\", \"arguments\": ",
        "{\"",
        "\":",
        "\"",
        "}",
        "{",
        "[",
        "]",
        ",",
        ":",
        "\\",
        "\\u00",
        "\\\"",
        "null",
        "true",
        "1",
        "-2.5e3",
        "\n",
        " ",
        "  ",
        "\t",
        "<",
        ">",
        "=",
        "/",
        "Bash",
        "command",
        "ls",
        "Hi",
        " there",
        "!",
        "stop",
        "STOP",
        "é",
        "😀",
    ];
    tokens.extend(pieces.iter().map(|p| p.as_bytes().to_vec()));
    let emoji = "😀".as_bytes();
    tokens.extend([
        emoji[..1].to_vec(),
        emoji[1..3].to_vec(),
        emoji[3..].to_vec(),
        vec![0xff],
        vec![0xc3],
        vec![0],
    ]);
    tokens
}

fn dialect(choice: u8) -> DialectParams {
    let stream = choice & 1 == 1;
    match (choice >> 1) % 4 {
        0 => DialectParams::Anthropic(AnthropicParams {
            model: "m".into(),
            message_id: "msg_f".into(),
            stream,
            compaction: false,
            compacted: None,
            applied_edits: None,
            tool_search: None,
        }),
        1 | 2 => DialectParams::OpenAi(OpenAiParams {
            model: "m".into(),
            completion_id: "chatcmpl-f".into(),
            created: 1,
            stream,
            include_usage: choice & 8 != 0,
            kind: if (choice >> 1) % 4 == 1 {
                CompletionKind::Chat
            } else {
                CompletionKind::Completion
            },
            custom_tools: vec!["apply_patch".into()],
        }),
        _ => DialectParams::Responses(ResponsesParams {
            model: "m".into(),
            response_id: "resp_f".into(),
            created_at: 1,
            stream,
            echo: "{}".into(),
            reasoning_summary: choice & 16 != 0,
            encrypted_reasoning: choice & 32 != 0,
            namespaced: Vec::new(),
            custom_tools: vec!["apply_patch".into()],
            compaction: None,
        }),
    }
}

fn assert_json_frames(bytes: &[u8], streamed: bool) {
    let text = std::str::from_utf8(bytes).expect("the client gets UTF-8");
    if !streamed {
        if !text.is_empty() {
            serde_json::from_str::<serde_json::Value>(text).expect("the body is JSON");
        }
        return;
    }
    for line in text.lines() {
        if let Some(data) = line.strip_prefix("data: ") {
            if data != "[DONE]" {
                serde_json::from_str::<serde_json::Value>(data).expect("a data line is JSON");
            }
        }
    }
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 3 {
        return;
    }
    let names: Vec<&str> = format_names().collect();
    let format = names
        .get(usize::from(input[0]) % (names.len() + 1))
        .copied();
    let flags = input[1];
    let think = (flags & 64 != 0).then(|| ("<think>".to_owned(), "</think>".to_owned()));
    let markup = MarkupSpec::new(think, format).ok().map(Arc::new);
    let stop_len = usize::from(input[2] % 4).min(input.len() - 3);
    let stop = String::from_utf8_lossy(&input[3..3 + stop_len]).into_owned();
    let tokens = vocab();
    let vocab = Arc::new(Vocab::from_token_bytes(&tokens, &[0]).unwrap());
    let mut router: Router<()> = Router::new(vocab, 1 << 20);
    let spec = StreamSpec {
        dialect: dialect(flags),
        stop_sequences: if stop.is_empty() {
            Vec::new()
        } else {
            vec![stop]
        },
        markup,
        prefill: String::new(),
        eos_ids: vec![0],
        tools: Arc::default(),
    };
    let streamed = flags & 1 == 1;
    let usage = PromptUsage {
        prompt_tokens: 5,
        cached_tokens: 1,
    };
    // A loop guard short enough for repeated input bytes to trip it.
    let channel = router.open(&[1], &spec, usage, 64, Some(16)).unwrap();
    let ids: Vec<u32> = input[3 + stop_len..]
        .iter()
        .map(|&b| u32::from(b) % tokens.len() as u32)
        .collect();
    let (mut ended, mut wake) = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    // Steps of 1, 2 or 3 tokens of the one stream (a verify pass feeds several).
    let mut at = 0;
    while at < ids.len() && ended.is_empty() {
        let n = 1 + at % 3;
        let step = &ids[at..(at + n).min(ids.len())];
        router
            .step(&vec![1; step.len()], step, &mut ended, &mut wake)
            .unwrap();
        while let Some(bytes) = channel.take_with(<[u8]>::to_vec) {
            if bytes.is_empty() {
                break;
            }
            out.extend(bytes);
        }
        at += n;
    }
    if ended.is_empty() {
        router.fail(
            1,
            mlxgate::events::ErrorKind::Unavailable,
            "shutting \"down\"",
        );
    }
    while let Some(bytes) = channel.take_with(<[u8]>::to_vec) {
        if bytes.is_empty() {
            break;
        }
        out.extend(bytes);
    }
    assert_json_frames(&out, streamed);
});
