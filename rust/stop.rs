//! Stop-sequence matcher over streamed text: holds back possible stop prefixes, never leaks a stop.

/// Per-stream stop-sequence state.
#[derive(Debug, Default, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released because its end could begin a stop sequence.
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored: they would match before any text.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            held: String::new(),
        }
    }

    pub fn stop(&self, index: usize) -> &str {
        &self.stops[index]
    }

    /// Appends the text that is safe to release to `out`. On a match, `out` gets the text before
    /// the stop and the index of the stop sequence is returned; the matcher must not be fed again.
    pub fn push(&mut self, text: &str, out: &mut String) -> Option<usize> {
        if self.stops.is_empty() {
            out.push_str(text);
            return None;
        }
        if text.is_empty() {
            return None;
        }
        self.held.push_str(text);
        // The stop that ends first wins (what char-by-char streaming would see, so the result
        // does not depend on how text was split into tokens); on a tie, the longer one.
        let mut best: Option<(usize, usize)> = None;
        for (index, stop) in self.stops.iter().enumerate() {
            if let Some(at) = find(self.held.as_bytes(), stop.as_bytes()) {
                let better = best.is_none_or(|(best_at, best_index)| {
                    let best_end = best_at + self.stops[best_index].len();
                    let end = at + stop.len();
                    end < best_end || (end == best_end && at < best_at)
                });
                if better {
                    best = Some((at, index));
                }
            }
        }
        if let Some((at, index)) = best {
            out.push_str(&self.held[..at]);
            self.held.clear();
            return Some(index);
        }
        let release = self.held.len() - self.partial_stop_len();
        out.push_str(&self.held[..release]);
        self.held.drain(..release);
        None
    }

    /// End of stream: the held text was not a stop after all.
    pub fn finish(&mut self, out: &mut String) {
        out.push_str(&self.held);
        self.held.clear();
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop sequence.
    fn partial_stop_len(&self) -> usize {
        let held = self.held.as_bytes();
        let mut longest = 0;
        for stop in &self.stops {
            let stop = stop.as_bytes();
            // Only a suffix longer than the best so far, and shorter than the stop, can matter.
            let from = held.len() - (stop.len() - 1).min(held.len());
            let to = held.len() - longest;
            if let Some(at) = (from..to).find(|&at| stop.starts_with(&held[at..])) {
                longest = held.len() - at;
            }
        }
        longest
    }
}

/// Naive substring search: haystacks here are a few dozen bytes, too short to amortize the setup
/// of `str::find`'s two-way searcher. Both sides are UTF-8, so a match starts on a char boundary.
pub(crate) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    let last_start = haystack.len().checked_sub(needle.len())?;
    (0..=last_start).find(|&at| haystack[at] == first && haystack[at..].starts_with(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], chunks: &[&str]) -> (Vec<String>, Option<usize>, String) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for chunk in chunks {
            let mut out = String::new();
            let matched = matcher.push(chunk, &mut out);
            pieces.push(out);
            if matched.is_some() {
                return (pieces, matched, String::new());
            }
        }
        let mut tail = String::new();
        matcher.finish(&mut tail);
        (pieces, None, tail)
    }

    #[test]
    fn no_stops_passes_through() {
        let (pieces, matched, tail) = feed(&[], &["a", "b"]);
        assert_eq!(pieces, ["a", "b"]);
        assert_eq!((matched, tail.as_str()), (None, ""));
    }

    #[test]
    fn stop_split_across_three_tokens_never_leaks() {
        let (pieces, matched, _) = feed(&["</answer>"], &["42 </", "ans", "wer> trailing"]);
        assert_eq!(pieces, ["42 ", "", ""]);
        assert_eq!(matched, Some(0));
    }

    #[test]
    fn false_start_released_when_it_diverges() {
        let (pieces, matched, tail) = feed(&["STOP"], &["a ST", "OR", "Y"]);
        assert_eq!(pieces, ["a ", "STOR", "Y"]);
        assert_eq!((matched, tail.as_str()), (None, ""));
    }

    #[test]
    fn holdback_released_at_finish() {
        let (pieces, matched, tail) = feed(&["\n\nHuman:"], &["bye", "\n\nHum"]);
        assert_eq!(pieces, ["bye", ""]);
        assert_eq!((matched, tail.as_str()), (None, "\n\nHum"));
    }

    #[test]
    fn overlapping_prefix_is_found_later_in_held_text() {
        let (pieces, matched, _) = feed(&["ab"], &["a", "a", "b"]);
        assert_eq!(pieces, ["", "a", ""]);
        assert_eq!(matched, Some(0));
    }

    #[test]
    fn first_stop_to_end_wins_then_longest() {
        let (pieces, matched, _) = feed(&["abcd", "bc"], &["xab", "cd"]);
        assert_eq!(pieces, ["x", "a"]);
        assert_eq!(matched, Some(1));
        let (pieces, matched, _) = feed(&["c", "ab"], &["xabc"]);
        assert_eq!((pieces, matched), (vec!["x".to_string()], Some(1)));
        let (pieces, matched, _) = feed(&["b", "ab"], &["xab"]);
        assert_eq!((pieces, matched), (vec!["x".to_string()], Some(1)));
    }

    #[test]
    fn multibyte_stop_split_on_char_boundaries() {
        let (pieces, matched, _) = feed(&["。\n"], &["好", "。", "\n"]);
        assert_eq!(pieces, ["好", "", ""]);
        assert_eq!(matched, Some(0));
    }

    #[test]
    fn result_does_not_depend_on_token_splits() {
        let stops = ["aab", "ab", "ba\u{e9}", "\u{e9}\u{e9}x"];
        let alphabet = ['a', 'b', '\u{e9}', 'x'];
        let mut seed = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let text: String = (0..12).map(|_| alphabet[(next() % 4) as usize]).collect();
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
            let mut chunks = Vec::new();
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let mut n = 1 + (next() % 5) as usize;
                while !rest.is_char_boundary(n.min(rest.len())) {
                    n += 1;
                }
                let (chunk, tail) = rest.split_at(n.min(rest.len()));
                chunks.push(chunk);
                rest = tail;
            }
            let (a, ma, ta) = feed(&stops, &by_char);
            let (b, mb, tb) = feed(&stops, &chunks);
            assert_eq!(
                (a.concat(), ma, ta),
                (b.concat(), mb, tb),
                "{text:?} {chunks:?}"
            );
        }
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let (pieces, matched, _) = feed(&[""], &["a"]);
        assert_eq!((pieces, matched), (vec!["a".to_string()], None));
    }
}
