//! What the formats share to read markup: a tag at the start of the input, the earliest of several tags in it, names and keys between tags.

use super::partial_len;

/// What the input starts with, among some tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prefix {
    /// The tag at this index of the list.
    Tag(usize),
    /// The input is a proper prefix of some tag: more input decides.
    Partial,
    None,
}

/// Which of `tags` `text` starts with (the first listed wins when one tag prefixes another).
pub(super) fn prefix(text: &str, tags: &[&str]) -> Prefix {
    if let Some(index) = tags.iter().position(|tag| text.starts_with(tag)) {
        return Prefix::Tag(index);
    }
    if tags.iter().any(|tag| tag.starts_with(text)) {
        Prefix::Partial
    } else {
        Prefix::None
    }
}

/// The earliest of `tags` in `text`: (position, index in `tags`). Every tag starts with an ASCII
/// byte.
pub(super) fn find_first(text: &str, tags: &[&str]) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut from = 0;
    while let Some(i) = bytes[from..]
        .iter()
        .position(|&b| tags.iter().any(|tag| tag.as_bytes()[0] == b))
    {
        let at = from + i;
        let tail = &bytes[at..];
        if let Some(index) = tags.iter().position(|tag| tail.starts_with(tag.as_bytes())) {
            return Some((at, index));
        }
        from = at + 1;
    }
    None
}

/// How many leading bytes of `text` cannot be part of any of `tags`, given that none occurs
/// whole in it: all but a suffix that may begin one.
pub(super) fn safe_len(text: &str, tags: &[&str]) -> usize {
    text.len()
        - tags
            .iter()
            .map(|tag| partial_len(text, tag))
            .max()
            .unwrap_or(0)
}

/// Leading whitespace length.
pub(super) fn ws_len(text: &str) -> usize {
    text.len() - text.trim_start().len()
}

/// Names and keys longer than this are cut (the rest is dropped): bounds what a model can make
/// us buffer.
const MAX_NAME: usize = 256;

/// Appends `text` to a name or key, cut at [`MAX_NAME`] bytes.
pub(super) fn push_capped(buf: &mut String, text: &str) {
    let room = MAX_NAME.saturating_sub(buf.len());
    let mut end = text.len().min(room);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    buf.push_str(&text[..end]);
}

/// A name or key without surrounding whitespace and quotes.
pub(super) fn unquote(text: &str) -> &str {
    let text = text.trim();
    let text = text.strip_prefix(['"', '\'']).unwrap_or(text);
    text.strip_suffix(['"', '\'']).unwrap_or(text).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_find_and_safe_length() {
        let tags = ["</parameter>", "<parameter="];
        assert_eq!(prefix("<parameter=x", &tags), Prefix::Tag(1));
        assert_eq!(prefix("</para", &tags), Prefix::Partial);
        assert_eq!(prefix("<b>", &tags), Prefix::None);
        assert_eq!(find_first("a < b </p </parameter>", &tags), Some((10, 0)));
        assert_eq!(find_first("é<parameter=", &tags), Some((2, 1)));
        assert_eq!(find_first("a < b", &tags), None);
        assert_eq!(safe_len("a < b </par", &tags), 6);
        assert_eq!(safe_len("a <", &tags), 2);
        assert_eq!(safe_len("a <b", &tags), 4);
    }
}
