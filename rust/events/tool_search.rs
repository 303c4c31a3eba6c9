//! Anthropic's server-side tool search: which deferred tools a model's query finds, by a
//! regular expression or by BM25 over each tool's document (name, description, arguments).

use std::collections::HashMap;
use std::str::FromStr;

use crate::error::CoreError;

/// A search finds at most this many tools (Anthropic's).
pub const MAX_RESULTS: usize = 5;
/// Anthropic's limit on a regex query.
const MAX_PATTERN_CHARS: usize = 200;
/// What a pattern may compile to: a hostile one is refused, not run.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Words too common to tell tools apart; a query's and a document's are both left out.
const STOP_WORDS: [&str; 22] = [
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "is", "it", "its", "of",
    "on", "or", "that", "the", "this", "to", "with",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchKind {
    /// A regular expression (Python `re.search` syntax, as far as the `regex` crate has it).
    Regex,
    /// A natural-language query, ranked by BM25.
    Bm25,
}

impl FromStr for SearchKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "regex" => Ok(Self::Regex),
            "bm25" => Ok(Self::Bm25),
            _ => Err(CoreError::UnknownSearchKind(s.to_owned())),
        }
    }
}

/// A deferred tool as a search sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deferred {
    pub name: String,
    /// What the search matches: the name, description and arguments' names and descriptions.
    pub document: String,
}

/// A declared search tool: its name (the model calls it so) and what it searches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSearch {
    pub name: String,
    pub kind: SearchKind,
    pub deferred: Vec<Deferred>,
}

/// A call the search cannot answer: Anthropic's `invalid_tool_input`, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidInput(pub String);

impl ToolSearch {
    /// The names of the tools the call's input (its JSON arguments) finds, best first.
    pub fn run(&self, input: &str) -> Result<Vec<&str>, InvalidInput> {
        let query = query(input)?;
        match self.kind {
            SearchKind::Regex => self.regex(&query),
            SearchKind::Bm25 => Ok(self.bm25(&query)),
        }
    }

    /// Tools whose document the pattern matches: those whose name it matches first, each in
    /// the order declared.
    fn regex(&self, pattern: &str) -> Result<Vec<&str>, InvalidInput> {
        if pattern.chars().count() > MAX_PATTERN_CHARS {
            return Err(InvalidInput(format!(
                "the pattern is longer than {MAX_PATTERN_CHARS} characters"
            )));
        }
        let regex = regex::RegexBuilder::new(pattern)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|e| InvalidInput(format!("invalid regular expression: {e}")))?;
        let matching = self.deferred.iter().filter(|t| regex.is_match(&t.document));
        let (by_name, by_text): (Vec<&Deferred>, Vec<&Deferred>) =
            matching.partition(|t| regex.is_match(&t.name));
        Ok(by_name
            .into_iter()
            .chain(by_text)
            .take(MAX_RESULTS)
            .map(|t| t.name.as_str())
            .collect())
    }

    /// Okapi BM25 (k1 1.2, b 0.75) of each document for the query's terms: the best
    /// `MAX_RESULTS` with a positive score, ties in the order declared.
    fn bm25(&self, query: &str) -> Vec<&str> {
        const K1: f64 = 1.2;
        const B: f64 = 0.75;
        let frequencies: Vec<(HashMap<String, f64>, f64)> = self
            .deferred
            .iter()
            .map(|tool| {
                let mut tf = HashMap::new();
                let words = terms(&tool.document);
                let length = words.len() as f64;
                for word in words {
                    *tf.entry(word).or_insert(0.0) += 1.0;
                }
                (tf, length)
            })
            .collect();
        let count = frequencies.len() as f64;
        let average = (frequencies.iter().map(|(_, l)| l).sum::<f64>() / count).max(1.0);
        let mut query_terms = terms(query);
        query_terms.sort_unstable();
        query_terms.dedup();
        let weighted: Vec<(&str, f64)> = query_terms
            .iter()
            .map(|term| {
                let holding = frequencies.iter().filter(|(tf, _)| tf.contains_key(term));
                let holding = holding.count() as f64;
                (
                    term.as_str(),
                    (1.0 + (count - holding + 0.5) / (holding + 0.5)).ln(),
                )
            })
            .collect();
        let mut scores: Vec<(f64, usize)> = frequencies
            .iter()
            .enumerate()
            .map(|(index, (tf, length))| {
                let norm = K1 * (1.0 - B + B * length / average);
                let score = weighted
                    .iter()
                    .filter_map(|&(term, idf)| {
                        tf.get(term).map(|&f| idf * f * (K1 + 1.0) / (f + norm))
                    })
                    .sum::<f64>();
                (score, index)
            })
            .filter(|&(score, _)| score > 0.0)
            .collect();
        scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scores
            .into_iter()
            .take(MAX_RESULTS)
            .map(|(_, i)| self.deferred[i].name.as_str())
            .collect()
    }
}

/// The `query` string of a call's JSON arguments.
fn query(input: &str) -> Result<String, InvalidInput> {
    let input = if input.trim().is_empty() { "{}" } else { input };
    let arguments: serde_json::Value = serde_json::from_str(input)
        .map_err(|e| InvalidInput(format!("the input is not a JSON object: {e}")))?;
    match arguments.get("query") {
        Some(serde_json::Value::String(query)) => Ok(query.clone()),
        _ => Err(InvalidInput("the input needs a `query` string".to_owned())),
    }
}

/// Lowercase words but stop words: split at anything not a letter or digit, and where camelCase
/// turns to a capital (`WebFetch` is `web` and `fetch`, `get_weather` is `get` and `weather`).
fn terms(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut previous_lower = false;
    for c in text.chars() {
        if !c.is_alphanumeric() {
            flush(&mut word, &mut out);
            previous_lower = false;
            continue;
        }
        if c.is_uppercase() && previous_lower {
            flush(&mut word, &mut out);
        }
        previous_lower = c.is_lowercase() || c.is_numeric();
        word.extend(c.to_lowercase());
    }
    flush(&mut word, &mut out);
    out
}

fn flush(word: &mut String, out: &mut Vec<String>) {
    if !word.is_empty() && !STOP_WORDS.contains(&word.as_str()) {
        out.push(std::mem::take(word));
    }
    word.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalogue(kind: SearchKind) -> ToolSearch {
        let tool = |name: &str, document: &str| Deferred {
            name: name.to_owned(),
            document: format!("{name}\n{document}"),
        };
        ToolSearch {
            name: "tool_search_tool_regex".into(),
            kind,
            deferred: vec![
                tool("send_email", "Send an email message.\nto The recipient"),
                tool(
                    "get_weather",
                    "Get the current weather for a city.\ncity The city",
                ),
                tool("WebFetch", "Fetches a URL and returns its content."),
                tool(
                    "forecast",
                    "A multi-day weather forecast.\ndays How many days",
                ),
                tool("slack_post", "Post a message to a Slack channel."),
            ],
        }
    }

    #[test]
    fn regex_matches_names_first_then_descriptions() {
        let search = catalogue(SearchKind::Regex);
        assert_eq!(
            search.run(r#"{"query": "weather"}"#).unwrap(),
            ["get_weather", "forecast"]
        );
        assert_eq!(
            search.run(r#"{"query": "(?i)SLACK"}"#).unwrap(),
            ["slack_post"]
        );
        assert_eq!(search.run(r#"{"query": "^Web"}"#).unwrap(), ["WebFetch"]);
        assert_eq!(
            search.run(r#"{"query": "message"}"#).unwrap(),
            ["send_email", "slack_post"]
        );
        assert!(search
            .run(r#"{"query": "nothing here"}"#)
            .unwrap()
            .is_empty());
        assert_eq!(search.run(r#"{"query": "."}"#).unwrap().len(), MAX_RESULTS);
    }

    #[test]
    fn bad_input_is_invalid_tool_input() {
        let search = catalogue(SearchKind::Regex);
        let error = search.run(r#"{"query": "(unclosed"}"#).unwrap_err();
        assert!(
            error.0.starts_with("invalid regular expression"),
            "{error:?}"
        );
        let long = format!(r#"{{"query": "{}"}}"#, "a".repeat(201));
        assert!(search.run(&long).unwrap_err().0.contains("200"));
        assert!(search
            .run(r#"{"pattern": "x"}"#)
            .unwrap_err()
            .0
            .contains("query"));
        assert!(search.run("").is_err() && search.run("[1]").is_err());
    }

    #[test]
    fn bm25_ranks_by_the_query_words() {
        let search = catalogue(SearchKind::Bm25);
        let found = search
            .run(r#"{"query": "weather forecast for the next days"}"#)
            .unwrap();
        assert_eq!(found, ["forecast", "get_weather"]);
        assert_eq!(
            search.run(r#"{"query": "web fetch a page"}"#).unwrap(),
            ["WebFetch"]
        );
        assert_eq!(search.run(r#"{"query": "email"}"#).unwrap(), ["send_email"]);
        assert!(search.run(r#"{"query": "zebra"}"#).unwrap().is_empty());
    }

    #[test]
    fn terms_split_words_and_camel_case() {
        assert_eq!(
            terms("WebFetch get_weather, HTTP2 mcp__demo__add"),
            ["web", "fetch", "get", "weather", "http2", "mcp", "demo", "add"]
        );
    }

    #[test]
    fn kinds_parse() {
        assert_eq!("bm25".parse::<SearchKind>().unwrap(), SearchKind::Bm25);
        assert!("fuzzy".parse::<SearchKind>().is_err());
    }
}
