//! Event numbering on any bytes: every frame comes out as it went in, an event with the next id
//! line before it, a comment with none.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxgate::sse::number_events;

fuzz_target!(|input: &[u8]| {
    let first = u64::from(input.first().copied().unwrap_or(0));
    let mut out = Vec::new();
    let next = number_events(input, first, &mut out);
    let mut expected_id = first;
    let mut rest = out.as_slice();
    let mut original = input;
    while !original.is_empty() {
        let end = original
            .windows(2)
            .position(|pair| pair == b"\n\n")
            .map_or(original.len(), |at| at + 2);
        let (frame, after) = original.split_at(end);
        if !frame.starts_with(b":") && frame != b"\n\n" {
            let id_line = format!("id: {expected_id}\n");
            assert!(rest.starts_with(id_line.as_bytes()), "missing id {expected_id}");
            rest = &rest[id_line.len()..];
            expected_id += 1;
        }
        assert!(rest.starts_with(frame), "a frame changed");
        rest = &rest[frame.len()..];
        original = after;
    }
    assert!(rest.is_empty(), "bytes added at the end");
    assert_eq!(next, expected_id);
});
