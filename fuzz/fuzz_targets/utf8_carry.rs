//! Token bytes in any split: the carried output equals decoding everything at
//! once, so streaming never breaks or invents a character.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sipp::text::Utf8Carry;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let stride = (data[0] % 5) as usize + 1;
    let bytes = &data[1..];
    let mut c = Utf8Carry::default();
    let mut out = String::new();
    for chunk in bytes.chunks(stride) {
        out.push_str(&c.push(chunk));
    }
    out.push_str(&c.finish());
    assert_eq!(out, String::from_utf8_lossy(bytes));
});
