//! Criterion benches of the stream core: one engine step over 256 streams, end to end to bytes.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use mlxgate::channel::Channel;
use mlxgate::detok::Detok;
use mlxgate::events::anthropic::AnthropicParams;
use mlxgate::events::openai::{CompletionKind, OpenAiParams};
use mlxgate::events::responses::ResponsesParams;
use mlxgate::events::{DialectParams, FinishReason, PromptUsage};
use mlxgate::markup::MarkupSpec;
use mlxgate::router::{Router, StreamSpec};
use mlxgate::vocab::Vocab;

const STREAMS: usize = 256;

/// Word-like tokens plus the pieces of multi-byte chars, like a real BPE vocab.
fn vocab() -> Arc<Vocab> {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    for i in 0..2000 {
        tokens.push(format!(" w{i}").into_bytes());
    }
    for text in ["😀", "你好", "é", "\n", "\"q\""] {
        let b = text.as_bytes();
        let mid = b.len() / 2;
        tokens.push(b[..mid].to_vec());
        tokens.push(b[mid..].to_vec());
    }
    Arc::new(Vocab::from_token_bytes(&tokens, &[0]).unwrap())
}

/// The wire dialect a benchmark's streams answer in.
#[derive(Clone, Copy)]
enum Wire {
    Anthropic,
    OpenAi,
    Responses,
}

fn dialect(wire: Wire, stream: bool) -> DialectParams {
    let model = "smollm2-135m-instruct".to_owned();
    match wire {
        Wire::Anthropic => DialectParams::Anthropic(AnthropicParams {
            model,
            message_id: "msg_01XFDUDYJgAACzvnptvVoYEL".into(),
            stream,
            compaction: false,
            compacted: None,
            applied_edits: None,
            tool_search: None,
        }),
        Wire::OpenAi => DialectParams::OpenAi(OpenAiParams {
            model,
            completion_id: "chatcmpl-9fQ2xXkRr1uZb3Lw7Ytn0AaE".into(),
            created: 1_763_762_400,
            stream,
            include_usage: true,
            kind: CompletionKind::Chat,
            custom_tools: Vec::new(),
        }),
        Wire::Responses => DialectParams::Responses(ResponsesParams {
            model,
            response_id: "resp_7Hq2Lk9Xw3Rt5Yb8Nc1Vm4Za".into(),
            created_at: 1_763_762_500,
            stream,
            echo: r#"{"instructions":null,"store":false,"tools":[]}"#.into(),
            reasoning_summary: false,
            encrypted_reasoning: true,
            namespaced: Vec::new(),
            custom_tools: Vec::new(),
            compaction: None,
        }),
    }
}

fn spec(stream: bool, stops: &[&str], markup: Option<Arc<MarkupSpec>>) -> StreamSpec {
    spec_in(Wire::Anthropic, stream, stops, markup)
}

fn spec_in(
    wire: Wire,
    stream: bool,
    stops: &[&str],
    markup: Option<Arc<MarkupSpec>>,
) -> StreamSpec {
    StreamSpec {
        dialect: dialect(wire, stream),
        stop_sequences: stops.iter().map(|s| s.to_string()).collect(),
        markup,
        prefill: String::new(),
        eos_ids: vec![0],
        tools: Default::default(),
    }
}

const USAGE: PromptUsage = PromptUsage {
    prompt_tokens: 100,
    cached_tokens: 0,
};

struct Batch {
    router: Router<()>,
    readers: Vec<Arc<Channel<()>>>,
    ids: Vec<u64>,
    tokens: Vec<Vec<u32>>,
    step: usize,
}

/// Thinking + Hermes tool-call markup, as for a Qwen3 model (the text itself has no tags).
fn qwen3_markup() -> Arc<MarkupSpec> {
    let think = Some(("<think>".to_owned(), "</think>".to_owned()));
    Arc::new(MarkupSpec::new(think, Some("hermes")).unwrap())
}

fn batch_with(stops: &[&str], stream: bool, markup: Option<Arc<MarkupSpec>>) -> Batch {
    batch_in(Wire::Anthropic, stops, stream, markup)
}

fn batch_in(wire: Wire, stops: &[&str], stream: bool, markup: Option<Arc<MarkupSpec>>) -> Batch {
    let vocab = vocab();
    let n = vocab.len() as u32;
    let mut router = Router::new(vocab, 1 << 20);
    let spec = spec_in(wire, stream, stops, markup);
    let readers = (0..STREAMS as u64)
        .map(|id| router.open(&[id], &spec, USAGE, u64::MAX, None).unwrap())
        .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let tokens = (0..64)
        .map(|_| {
            (0..STREAMS)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    1 + (seed % u64::from(n - 1)) as u32
                })
                .collect()
        })
        .collect();
    Batch {
        router,
        readers,
        ids: (0..STREAMS as u64).collect(),
        tokens,
        step: 0,
    }
}

impl Batch {
    /// One engine step, then every reader takes its bytes (as the asyncio side would).
    fn run(&mut self, ended: &mut Vec<(u64, FinishReason)>, wake: &mut Vec<()>) -> usize {
        let tokens = &self.tokens[self.step % self.tokens.len()];
        self.step += 1;
        ended.clear();
        wake.clear();
        self.router.step(&self.ids, tokens, ended, wake).unwrap();
        self.readers
            .iter()
            .map(|r| r.take_with(|b| b.len()).unwrap_or(0))
            .sum()
    }
}

fn bench_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("router_step_256");
    group.throughput(Throughput::Elements(STREAMS as u64));
    for (name, wire, stops, stream) in [
        ("stream", Wire::Anthropic, &[][..], true),
        ("stream_openai", Wire::OpenAi, &[][..], true),
        ("stream_responses", Wire::Responses, &[][..], true),
        (
            "stream_2_stops",
            Wire::Anthropic,
            &["</answer>", "\n\nHuman:"][..],
            true,
        ),
        ("nonstream", Wire::Anthropic, &[][..], false),
    ] {
        let mut b = batch_in(wire, stops, stream, None);
        let (mut dropped, mut wake) = (Vec::new(), Vec::new());
        group.bench_function(name, |bench| {
            bench.iter(|| black_box(b.run(&mut dropped, &mut wake)));
        });
    }
    group.finish();
}

fn bench_step_markup(c: &mut Criterion) {
    let mut group = c.benchmark_group("router_step_256_markup");
    group.throughput(Throughput::Elements(STREAMS as u64));
    let mut b = batch_with(&[], true, Some(qwen3_markup()));
    let (mut dropped, mut wake) = (Vec::new(), Vec::new());
    group.bench_function("stream_qwen3", |bench| {
        bench.iter(|| black_box(b.run(&mut dropped, &mut wake)));
    });
    group.finish();
}

fn bench_open_finish(c: &mut Criterion) {
    let mut group = c.benchmark_group("lifecycle");
    group.bench_function("open_10_tokens_end_turn", |bench| {
        let vocab = vocab();
        bench.iter_batched(
            || Router::<()>::new(vocab.clone(), 1 << 20),
            |mut router| {
                let reader = router
                    .open(&[1], &spec(true, &[], None), USAGE, u64::MAX, None)
                    .unwrap();
                let (mut ended, mut wake) = (Vec::new(), Vec::new());
                for t in 1..=10 {
                    let token = if t == 10 { 0 } else { t };
                    router.step(&[1], &[token], &mut ended, &mut wake).unwrap();
                }
                black_box(reader.take_with(|b| b.len()))
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

fn bench_detok(c: &mut Criterion) {
    let text = "Streaming text with some naïve café 😀 and 你好 mixed in. ".repeat(16);
    let bytes = text.as_bytes();
    let mut group = c.benchmark_group("detok");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("3_byte_tokens", |bench| {
        let mut out = String::with_capacity(bytes.len() * 2);
        bench.iter(|| {
            out.clear();
            let mut detok = Detok::new(false);
            for chunk in bytes.chunks(3) {
                detok.push(chunk, &mut out);
            }
            detok.finish(&mut out);
            black_box(out.len())
        });
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_step,
    bench_step_markup,
    bench_open_finish,
    bench_detok
);
criterion_main!(benches);
