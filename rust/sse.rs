//! SSE framing: `event: <type>\ndata: <json>\n\n`, JSON written straight into the output buffer,
//! the `id:` line each event gets as its response's channel queues it, and each event's data
//! alone (a WebSocket's messages).

use std::io::Write;

use serde::Serialize;

/// Appends one SSE frame; `data` is serialized compactly (one line: serde_json escapes newlines).
pub fn write_event<T: Serialize + ?Sized>(out: &mut Vec<u8>, event: &str, data: &T) {
    out.reserve(event.len() + 64);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(event.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    write_json(out, data);
    out.extend_from_slice(b"\n\n");
}

/// Appends `data` as compact JSON.
pub fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, data: &T) {
    // Serializing plain structs and strings into a Vec has no failure path.
    serde_json::to_writer(&mut *out, data).expect("JSON serialization into a Vec failed");
}

/// Appends an SSE comment line, e.g. a keep-alive (`: keep-alive\n\n`).
pub fn write_comment(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(b": ");
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Copies whole SSE frames into `out`, giving each event an `id: N` line first, N counting up
/// from `next_id`; a comment frame (a keep-alive, `: ...`) gets none. A trailing part without its
/// blank line is copied as it is. Returns the id the next event gets.
pub fn number_events(frames: &[u8], mut next_id: u64, out: &mut Vec<u8>) -> u64 {
    out.reserve(frames.len() + 16);
    let mut rest = frames;
    while !rest.is_empty() {
        let end = find_frame_end(rest).unwrap_or(rest.len());
        let (frame, after) = rest.split_at(end);
        if !frame.starts_with(b":") && frame != b"\n\n" {
            // Writing into a Vec cannot fail.
            writeln!(out, "id: {next_id}").expect("writing into a Vec failed");
            next_id += 1;
        }
        out.extend_from_slice(frame);
        rest = after;
    }
    next_id
}

/// The frames of numbered `frames` after the event with id `last_id`: what a client that has
/// seen up to `last_id` still needs of them (all of them if they start later, none if they end
/// sooner).
pub fn events_after(frames: &[u8], last_id: u64) -> &[u8] {
    let wanted = format!("id: {}\n", last_id + 1);
    let mut rest = frames;
    while !rest.is_empty() {
        if rest.starts_with(wanted.as_bytes()) {
            return rest;
        }
        if let Some(id) = frame_id(rest) {
            if id > last_id {
                return rest;
            }
        }
        let end = find_frame_end(rest).unwrap_or(rest.len());
        rest = &rest[end..];
    }
    rest
}

/// The `data` of each event in `frames` (whole frames as the encoders write them, numbered or
/// not), in order; a comment (keep-alive) has none. An encoder writes an event's data on one line
/// (compact JSON), so that line is the whole event: what a WebSocket carries as one message.
pub fn event_data(frames: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = frames;
    std::iter::from_fn(move || {
        while !rest.is_empty() {
            let end = find_frame_end(rest).unwrap_or(rest.len());
            let (frame, after) = rest.split_at(end);
            rest = after;
            let data = frame
                .split(|&b| b == b'\n')
                .find_map(|line| line.strip_prefix(b"data: "));
            if data.is_some() {
                return data;
            }
        }
        None
    })
}

/// The id of a frame that starts with its `id:` line.
fn frame_id(frame: &[u8]) -> Option<u64> {
    let line = frame.strip_prefix(b"id: ")?;
    let end = line.iter().position(|&b| b == b'\n')?;
    std::str::from_utf8(&line[..end]).ok()?.parse().ok()
}

/// The length of the first frame in `bytes`, its blank line included.
fn find_frame_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(2)
        .position(|pair| pair == b"\n\n")
        .map(|at| at + 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Delta<'a> {
        #[serde(rename = "type")]
        kind: &'a str,
        text: &'a str,
    }

    #[test]
    fn frames_event_and_escaped_data() {
        let mut out = Vec::new();
        write_event(
            &mut out,
            "delta",
            &Delta {
                kind: "text_delta",
                text: "a\n\"b\"",
            },
        );
        write_comment(&mut out, "keep-alive");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "event: delta\ndata: {\"type\":\"text_delta\",\"text\":\"a\\n\\\"b\\\"\"}\n\n: keep-alive\n\n"
        );
    }

    #[test]
    fn numbers_events_but_not_comments() {
        let frames = b"event: a\ndata: {}\n\n: keep-alive\n\ndata: {\"x\":1}\n\ndata: [DONE]\n\n";
        let mut out = Vec::new();
        assert_eq!(number_events(frames, 9, &mut out), 12);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "id: 9\nevent: a\ndata: {}\n\n: keep-alive\n\nid: 10\ndata: {\"x\":1}\n\n\
             id: 11\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn events_after_an_id() {
        let frames = b"id: 3\ndata: a\n\nid: 4\ndata: b\n\nid: 5\ndata: c\n\n";
        assert_eq!(
            events_after(frames, 3),
            b"id: 4\ndata: b\n\nid: 5\ndata: c\n\n"
        );
        assert_eq!(events_after(frames, 5), b"");
        assert_eq!(events_after(frames, 1), frames);
        assert_eq!(events_after(frames, 0), frames);
    }

    #[test]
    fn event_data_without_ids_event_lines_or_comments() {
        let frames = b"id: 3\nevent: a\ndata: {\"x\":\"1\\n2\"}\n\n: keep-alive\n\n\
                       data: {}\n\nid: 4\ndata: [DONE]\n\n";
        let data: Vec<&[u8]> = event_data(frames).collect();
        assert_eq!(
            data,
            [&b"{\"x\":\"1\\n2\"}"[..], b"{}", b"[DONE]"],
            "one line each, escapes untouched"
        );
        assert_eq!(event_data(b"").count(), 0);
        assert_eq!(event_data(b": keep-alive\n\n").count(), 0);
    }

    #[test]
    fn numbering_nothing_or_a_partial_frame() {
        let mut out = Vec::new();
        assert_eq!(number_events(b"", 1, &mut out), 1);
        assert!(out.is_empty());
        assert_eq!(number_events(b"data: 1", 1, &mut out), 2);
        assert_eq!(out, b"id: 1\ndata: 1");
    }
}
