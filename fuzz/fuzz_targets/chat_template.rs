//! Hostile chat templates: compiling and rendering either works or fails with
//! an error, within the fuel limit; never a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sipp::chat::{ChatMessage, ChatTemplate};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (source, content) = text.split_once('\u{0}').unwrap_or((&text, "hello"));
    if let Ok(t) = ChatTemplate::new(source, "<s>", "</s>") {
        let messages = [ChatMessage::system("sys"), ChatMessage::user(content), ChatMessage::assistant("ok"), ChatMessage::user(content)];
        let _ = t.render(&messages, true);
        let _ = t.render(&messages[1..2], false);
    }
});
