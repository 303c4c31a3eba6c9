//! Golden wire transcripts: tests/fixtures/<name>.json drives a router; output must equal <name>.sse or <name>.body.json.
//!
//! Vocab kind `raw` (test-only) takes each token string as the token's UTF-8 bytes, so markup
//! fixtures stay readable.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlxgate::channel::Channel;
use mlxgate::events::anthropic::AnthropicParams;
use mlxgate::events::openai::OpenAiParams;
use mlxgate::events::responses::{NamespacedTool, ResponsesParams};
use mlxgate::events::{DialectParams, ErrorKind, FinishReason, PromptUsage};
use mlxgate::markup::MarkupSpec;
use mlxgate::router::{Router, StreamSpec};
use mlxgate::vocab::{Vocab, VocabKind};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    vocab: VocabSpec,
    open: OpenSpec,
    steps: Vec<StepSpec>,
}

#[derive(Deserialize)]
struct VocabSpec {
    kind: String,
    tokens: Vec<String>,
    special_ids: Vec<u32>,
    #[serde(default)]
    trim_leading_space: bool,
}

#[derive(Deserialize)]
struct OpenSpec {
    stream_id: u64,
    /// `anthropic` (the default), `openai` or `responses`.
    #[serde(default)]
    dialect: Option<String>,
    model: String,
    #[serde(default)]
    message_id: String,
    #[serde(default)]
    completion_id: String,
    #[serde(default)]
    created: u64,
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    cached_tokens: u64,
    #[serde(default)]
    eos_ids: Vec<u32>,
    #[serde(default = "unlimited")]
    max_tokens: u64,
    #[serde(default)]
    include_usage: bool,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default = "yes")]
    stream: bool,
    #[serde(default)]
    markup: Option<MarkupJson>,
    #[serde(default)]
    prefill: String,
    #[serde(default)]
    response_id: String,
    #[serde(default)]
    created_at: u64,
    /// The Responses request settings echoed in every Response object (a JSON object, as text).
    #[serde(default)]
    echo: String,
    #[serde(default)]
    reasoning_summary: bool,
    #[serde(default)]
    encrypted_reasoning: bool,
    /// (flat name, namespace, name) of each namespaced function.
    #[serde(default)]
    namespaced: Vec<(String, String, String)>,
    /// Names of the request's custom (freeform) tools.
    #[serde(default)]
    custom_tools: Vec<String>,
}

#[derive(Deserialize)]
struct MarkupJson {
    think: Option<(String, String)>,
    tool_call: Option<String>,
}

fn yes() -> bool {
    true
}

fn unlimited() -> u64 {
    u64::MAX
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StepSpec {
    Token {
        token: u32,
        /// Why the stream ends at this token (`end_turn`, `max_tokens`, `stop_sequence`,
        /// `tool_use`); absent while it runs.
        #[serde(default)]
        ends: Option<String>,
    },
    Fail {
        fail: FailSpec,
    },
}

#[derive(Deserialize)]
struct FailSpec {
    kind: String,
    message: String,
}

fn reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::EndTurn => "end_turn",
        FinishReason::MaxTokens => "max_tokens",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::ToolUse => "tool_use",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Repetition => "repetition",
    }
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Runs one fixture, reading after every step the way the server does; returns all bytes read.
fn run(fixture: &Fixture) -> Vec<u8> {
    let spec = &fixture.vocab;
    let vocab = if spec.kind == "raw" {
        let tokens: Vec<&[u8]> = spec.tokens.iter().map(|t| t.as_bytes()).collect();
        Vocab::from_token_bytes(&tokens, &spec.special_ids).unwrap()
    } else {
        let kind: VocabKind = spec.kind.parse().unwrap();
        Vocab::from_token_strings(&spec.tokens, kind, &spec.special_ids).unwrap()
    }
    .with_trim_leading_space(spec.trim_leading_space);
    let mut router: Router<()> = Router::new(Arc::new(vocab), 1 << 20);
    let open = &fixture.open;
    let dialect = match open.dialect.as_deref().unwrap_or("anthropic") {
        "anthropic" => DialectParams::Anthropic(AnthropicParams {
            model: open.model.clone(),
            message_id: open.message_id.clone(),
            stream: open.stream,
            compaction: false,
            compacted: None,
            applied_edits: None,
            tool_search: None,
        }),
        "openai" => DialectParams::OpenAi(OpenAiParams {
            model: open.model.clone(),
            completion_id: open.completion_id.clone(),
            created: open.created,
            stream: open.stream,
            include_usage: open.include_usage,
            kind: open.kind.as_deref().unwrap_or("chat").parse().unwrap(),
            custom_tools: open.custom_tools.clone(),
        }),
        "responses" => DialectParams::Responses(ResponsesParams {
            model: open.model.clone(),
            response_id: open.response_id.clone(),
            created_at: open.created_at,
            stream: open.stream,
            echo: open.echo.clone(),
            reasoning_summary: open.reasoning_summary,
            encrypted_reasoning: open.encrypted_reasoning,
            namespaced: open
                .namespaced
                .iter()
                .map(|(flat_name, namespace, name)| NamespacedTool {
                    flat_name: flat_name.clone(),
                    namespace: namespace.clone(),
                    name: name.clone(),
                })
                .collect(),
            custom_tools: open.custom_tools.clone(),
            compaction: None,
        }),
        other => panic!("unknown dialect {other:?}"),
    };
    let markup = open
        .markup
        .as_ref()
        .map(|m| Arc::new(MarkupSpec::new(m.think.clone(), m.tool_call.as_deref()).unwrap()));
    let spec = StreamSpec {
        dialect,
        stop_sequences: open.stop_sequences.clone(),
        markup,
        prefill: open.prefill.clone(),
        eos_ids: open.eos_ids.clone(),
        tools: Default::default(),
    };
    let usage = PromptUsage {
        prompt_tokens: open.prompt_tokens,
        cached_tokens: open.cached_tokens,
    };
    let id = open.stream_id;
    let reader = router
        .open(&[id], &spec, usage, open.max_tokens, None)
        .unwrap();
    let mut out = Vec::new();
    drain(&reader, &mut out);
    let (mut ended, mut wake) = (Vec::new(), Vec::new());
    for (i, step) in fixture.steps.iter().enumerate() {
        match step {
            StepSpec::Token { token, ends } => {
                ended.clear();
                router
                    .step(&[id], &[*token], &mut ended, &mut wake)
                    .unwrap();
                let got: Vec<(u64, &str)> =
                    ended.iter().map(|&(s, r)| (s, reason_name(r))).collect();
                let want: Vec<(u64, &str)> = ends.iter().map(|r| (id, r.as_str())).collect();
                assert_eq!(got, want, "step {i}");
            }
            StepSpec::Fail { fail } => {
                let kind: ErrorKind = fail.kind.parse().unwrap();
                router.fail(id, kind, &fail.message);
            }
        }
        drain(&reader, &mut out);
    }
    assert!(router.is_empty(), "fixture must end its stream");
    assert_eq!(
        reader.take_with(|_| ()),
        None,
        "reader must be at end of stream"
    );
    out
}

fn drain(reader: &Channel<()>, out: &mut Vec<u8>) {
    if let Some(bytes) = reader.take_with(<[u8]>::to_vec) {
        out.extend(bytes);
    }
}

#[test]
fn golden_transcripts() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.ends_with(".json") && !name.ends_with(".body.json")
        })
        .collect();
    inputs.sort();
    assert!(inputs.len() >= 5, "fixtures missing: {inputs:?}");
    let mut failures = Vec::new();
    for input in &inputs {
        let fixture: Fixture = serde_json::from_slice(&std::fs::read(input).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", input.display()));
        let stem = input.file_stem().unwrap().to_str().unwrap();
        let golden = input.with_file_name(if fixture.open.stream {
            format!("{stem}.sse")
        } else {
            format!("{stem}.body.json")
        });
        let got = run(&fixture);
        if update {
            std::fs::write(&golden, &got).unwrap();
            continue;
        }
        let want = std::fs::read(&golden)
            .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", golden.display()));
        if got != want {
            failures.push(format!(
                "{}:\n--- want\n{}\n--- got\n{}",
                golden.display(),
                String::from_utf8_lossy(&want),
                String::from_utf8_lossy(&got)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
