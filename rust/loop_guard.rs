//! The loop guard: notices a reply that has fallen into repeating one cycle of tokens.
//!
//! A small model left to itself can repeat a sentence or a line until `max_tokens` (a Claude
//! Code turn asks for 32k tokens). The guard ends such a reply once its last `span` tokens or
//! more are one cycle of at most [`MAX_PERIOD`] tokens, repeated at least [`MIN_CYCLES`] times. Text that merely copies something, such as an edited file, is almost
//! never exactly periodic for hundreds of tokens, so it is left alone.

/// The longest cycle looked for, in tokens (a paragraph).
pub const MAX_PERIOD: usize = 256;
/// The fewest repeats of a cycle that count as a loop, however long the span.
pub const MIN_CYCLES: usize = 4;

/// One reply's recent tokens and, for each cycle length, how long the reply has kept to it.
#[derive(Debug)]
pub struct LoopGuard {
    span: usize,
    /// The last `MAX_PERIOD` tokens, a ring indexed by `seen`.
    recent: Box<[u32; MAX_PERIOD]>,
    seen: usize,
    /// `runs[p - 1]`: how many tokens in a row have each equalled the token `p` before them.
    runs: Box<[u32; MAX_PERIOD]>,
}

impl LoopGuard {
    /// A guard that trips once `span` tokens (and at least [`MIN_CYCLES`] cycles) repeat.
    pub fn new(span: u32) -> Self {
        Self {
            span: span.max(1) as usize,
            recent: Box::new([0; MAX_PERIOD]),
            seen: 0,
            runs: Box::new([0; MAX_PERIOD]),
        }
    }

    /// Takes the reply's next token; true once the reply loops.
    pub fn push(&mut self, token: u32) -> bool {
        let mut looping = false;
        for period in 1..=self.seen.min(MAX_PERIOD) {
            let run = &mut self.runs[period - 1];
            if self.recent[(self.seen - period) % MAX_PERIOD] == token {
                *run += 1;
                // The last `run + period` tokens are the cycle over and over.
                let repeating = *run as usize + period;
                looping |= repeating >= self.span.max(MIN_CYCLES * period);
            } else {
                *run = 0;
            }
        }
        self.recent[self.seen % MAX_PERIOD] = token;
        self.seen += 1;
        looping
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index of the token that trips the guard, if any.
    fn trips(span: u32, tokens: impl IntoIterator<Item = u32>) -> Option<usize> {
        let mut guard = LoopGuard::new(span);
        tokens.into_iter().position(|t| guard.push(t))
    }

    #[test]
    fn one_token_over_and_over_trips_at_the_span() {
        assert_eq!(trips(100, std::iter::repeat_n(7, 500)), Some(99));
    }

    #[test]
    fn a_cycle_trips_once_the_span_repeats_it() {
        let cycle = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
        let tokens = (0..100).flat_map(|_| cycle);
        assert_eq!(trips(100, tokens), Some(99));
    }

    #[test]
    fn a_long_cycle_needs_its_repeats_whatever_the_span() {
        let cycle: Vec<u32> = (1000..1200).collect(); // 200 tokens: 4 cycles are 800
        let tokens = (0..10).flat_map(|_| cycle.clone());
        assert_eq!(trips(100, tokens), Some(799));
    }

    #[test]
    fn the_text_before_a_loop_does_not_count() {
        let prose = (0..300).map(|i| i * 7 % 1000);
        let tokens = prose.chain(std::iter::repeat_n(3, 200));
        assert_eq!(trips(150, tokens), Some(300 + 149));
    }

    #[test]
    fn a_cycle_longer_than_the_longest_looked_for_is_not_seen() {
        let cycle: Vec<u32> = (0..MAX_PERIOD as u32 + 1).collect();
        let tokens = (0..8).flat_map(|_| cycle.clone());
        assert_eq!(trips(100, tokens), None);
    }

    #[test]
    fn copying_a_file_never_trips() {
        // Each byte a token: finer than any tokenizer's, so more of it repeats (indentation,
        // rules of dashes, a lock file's entries), and still no 384-byte stretch is periodic.
        for file in [
            include_str!("router.rs"),
            include_str!("../Cargo.lock"),
            include_str!("../docs/cli.md"),
            include_str!("../docs/models.md"),
        ] {
            assert_eq!(trips(384, file.bytes().map(u32::from)), None);
        }
    }

    #[test]
    fn varied_text_and_short_repeats_never_trip() {
        // A pseudo-random stream over a small vocabulary, with short runs and repeated pairs.
        let mut x: u32 = 12345;
        let tokens = (0..20_000).map(move |_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) % 50
        });
        assert_eq!(trips(64, tokens), None);
        let stutter = (0..2000).flat_map(|i| [i, i, i, i + 1]);
        assert_eq!(trips(64, stutter), None);
    }
}
