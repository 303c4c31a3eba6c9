//! The incremental JSON scanner on any bytes: no panic; the bytes it accepts, completed by
//! `complete` (as a tool call cut short is), are one JSON value to serde; `is_valid` agrees
//! with serde, and `minify` keeps the value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxgate::jsonscan::{is_valid, minify, JsonScan, Scan};
use serde::de::IgnoredAny;
use serde_json::Value;

/// JSON by its grammar (read without making numbers f64s, which refuses `1e999`).
fn is_json(text: &str) -> bool {
    serde_json::from_str::<IgnoredAny>(text).is_ok()
}

fuzz_target!(|input: &[u8]| {
    let mut scan = JsonScan::new();
    let mut accepted = 0;
    for &b in input {
        match scan.push(b) {
            Scan::More => accepted += 1,
            Scan::Done => {
                accepted += 1;
                break;
            }
            Scan::DoneBefore | Scan::Invalid => break,
        }
    }
    let Ok(prefix) = std::str::from_utf8(&input[..accepted]) else {
        return;
    };
    // serde refuses lone surrogates (`\ud800`), which JSON's grammar allows.
    if prefix.contains("\\u") {
        return;
    }
    let mut completed = prefix.to_owned();
    scan.complete(&mut completed);
    assert!(
        is_json(&completed),
        "accepted bytes complete to JSON: {completed:?}"
    );
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    if text.contains("\\u") {
        return;
    }
    assert_eq!(is_valid(text), is_json(text), "{text:?}");
    if let Ok(value) = serde_json::from_str::<Value>(text) {
        let mut small = String::new();
        minify(text, &mut small);
        assert_eq!(
            serde_json::from_str::<Value>(&small).ok(),
            Some(value),
            "{small:?}"
        );
    }
});
