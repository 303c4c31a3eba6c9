//! Golden wire transcripts: tests/fixtures/<name>.json drives a router; output must equal <name>.sse or <name>.body.json.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlxgate::channel::Channel;
use mlxgate::events::anthropic::AnthropicParams;
use mlxgate::router::Router;
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
    model: String,
    message_id: String,
    input_tokens: u64,
    #[serde(default)]
    cache_read_input_tokens: u64,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default = "yes")]
    stream: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StepSpec {
    Token {
        token: u32,
        #[serde(default)]
        finish: u32,
        #[serde(default)]
        expect_dropped: bool,
    },
    Fail {
        fail: FailSpec,
    },
}

#[derive(Deserialize)]
struct FailSpec {
    #[serde(rename = "type")]
    kind: String,
    message: String,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Runs one fixture, reading after every step the way the server does; returns all bytes read.
fn run(fixture: &Fixture) -> Vec<u8> {
    let kind: VocabKind = fixture.vocab.kind.parse().unwrap();
    let vocab = Vocab::from_token_strings(&fixture.vocab.tokens, kind, &fixture.vocab.special_ids)
        .unwrap()
        .with_trim_leading_space(fixture.vocab.trim_leading_space);
    let mut router: Router<()> = Router::new(Arc::new(vocab), 1 << 20);
    let open = &fixture.open;
    let params = AnthropicParams {
        model: open.model.clone(),
        message_id: open.message_id.clone(),
        input_tokens: open.input_tokens,
        cache_read_input_tokens: open.cache_read_input_tokens,
        stream: open.stream,
    };
    let id = open.stream_id;
    let reader = router
        .open_anthropic(id, params, open.stop_sequences.clone())
        .unwrap();
    let mut out = Vec::new();
    drain(&reader, &mut out);
    let (mut dropped, mut wake) = (Vec::new(), Vec::new());
    for (i, step) in fixture.steps.iter().enumerate() {
        match step {
            StepSpec::Token {
                token,
                finish,
                expect_dropped,
            } => {
                dropped.clear();
                router
                    .step(&[id], &[*token], &[*finish], &mut dropped, &mut wake)
                    .unwrap();
                assert_eq!(
                    dropped.contains(&id),
                    *expect_dropped,
                    "step {i}: dropped {dropped:?}"
                );
            }
            StepSpec::Fail { fail } => {
                router.fail(id, &fail.kind, &fail.message);
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
