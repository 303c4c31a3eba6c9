//! Tag matching shared by the formats: a tag at the start of the input, the earliest of several tags in it.

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
