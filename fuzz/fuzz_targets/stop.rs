//! The stop-sequence matcher on any text in any chunks: what it lets through is the text before
//! the stop sequence it reports, holding no stop sequence; all of it if it reports none.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxgate::stop::StopMatcher;

fuzz_target!(|input: &[u8]| {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let mut parts = text.splitn(3, '\u{1}');
    let (Some(stops), Some(body)) = (parts.next(), parts.next()) else {
        return;
    };
    let stops: Vec<String> = stops
        .split('|')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let mut matcher = StopMatcher::new(stops.clone());
    let mut out = String::new();
    let mut matched = None;
    for chunk in body.split_inclusive(|c: char| (c as u32) % 3 == 0) {
        if let Some(index) = matcher.push(chunk, &mut out) {
            matched = Some(index);
            break;
        }
    }
    if matched.is_none() {
        matcher.finish(&mut out);
    }
    // What got through is the text before a stop sequence, and holds none.
    assert!(body.starts_with(&out));
    assert!(
        stops.iter().all(|stop| !out.contains(stop.as_str())),
        "{out:?}"
    );
    match matched {
        Some(index) => assert!(body[out.len()..].starts_with(stops[index].as_str())),
        None => assert_eq!(out, body),
    }
});
