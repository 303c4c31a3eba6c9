//! SSE framing: `event: <type>\ndata: <json>\n\n`, JSON written straight into the output buffer.

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
}
