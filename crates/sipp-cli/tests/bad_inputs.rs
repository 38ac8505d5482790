//! A catalogue of bad requests over HTTP: each gets its documented 4xx with an
//! OpenAI-shaped error, while a long streamed generation keeps being served.

mod common;

use common::Server;
use reqwest::blocking::Client;
use serde_json::Value;

struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    /// Expected `param`, or a word the message must contain.
    expect: &'static str,
}

fn case(
    name: &'static str,
    path: &'static str,
    body: &str,
    status: u16,
    expect: &'static str,
) -> Case {
    Case {
        name,
        method: "POST",
        path,
        body: body.as_bytes().to_vec(),
        status,
        expect,
    }
}

fn catalogue() -> Vec<Case> {
    let c = "/v1/completions";
    let ch = "/v1/chat/completions";
    let e = "/v1/embeddings";
    let ok_msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    let mut v = vec![
        case("malformed JSON", c, "{bad", 400, "JSON"),
        case("empty body", c, "", 400, "empty"),
        case("array body", c, "[]", 400, "JSON"),
        case("null body", c, "null", 400, "JSON"),
        case(
            "deeply nested JSON",
            c,
            &format!("{{\"prompt\":{}1{}}}", "[".repeat(5000), "]".repeat(5000)),
            400,
            "JSON",
        ),
        case(
            "prompt of wrong type",
            c,
            r#"{"prompt": {"a": 1}}"#,
            400,
            "prompt",
        ),
        case("missing prompt", c, r#"{"max_tokens": 3}"#, 400, "prompt"),
        case(
            "too many drafted tokens",
            c,
            r#"{"prompt": "hi", "speculative": {"mode": "ngram", "n_max": 99}}"#,
            400,
            "speculative.n_max",
        ),
        case(
            "draft speculation without a draft model",
            c,
            r#"{"prompt": "hi", "speculative": {"mode": "draft"}}"#,
            400,
            "speculative.mode",
        ),
        case(
            "unknown speculative mode",
            c,
            r#"{"prompt": "hi", "speculative": {"mode": "eagle"}}"#,
            400,
            "speculative",
        ),
        case("empty prompt", c, r#"{"prompt": ""}"#, 400, "prompt"),
        case("empty prompt list", c, r#"{"prompt": []}"#, 400, "prompt"),
        case(
            "negative token id",
            c,
            r#"{"prompt": [1, -5]}"#,
            400,
            "prompt",
        ),
        case(
            "token id out of vocabulary",
            c,
            r#"{"prompt": [1, 999999]}"#,
            400,
            "prompt",
        ),
        case(
            "max_tokens as text",
            c,
            r#"{"prompt": "x", "max_tokens": "ten"}"#,
            400,
            "max_tokens",
        ),
        case(
            "negative max_tokens",
            c,
            r#"{"prompt": "x", "max_tokens": -1}"#,
            400,
            "max_tokens",
        ),
        case(
            "zero max_tokens",
            c,
            r#"{"prompt": "x", "max_tokens": 0}"#,
            400,
            "max_tokens",
        ),
        case(
            "huge max_tokens",
            c,
            r#"{"prompt": "x", "max_tokens": 99999999999}"#,
            400,
            "max_tokens",
        ),
        case(
            "astronomic max_tokens",
            c,
            r#"{"prompt": "x", "max_tokens": 1e30}"#,
            400,
            "max_tokens",
        ),
        case(
            "negative temperature",
            c,
            r#"{"prompt": "x", "temperature": -1}"#,
            400,
            "temperature",
        ),
        case(
            "temperature as text",
            c,
            r#"{"prompt": "x", "temperature": "hot"}"#,
            400,
            "temperature",
        ),
        case(
            "infinite temperature",
            c,
            r#"{"prompt": "x", "temperature": 1e400}"#,
            400,
            "JSON",
        ),
        case(
            "top_p zero",
            c,
            r#"{"prompt": "x", "top_p": 0}"#,
            400,
            "top_p",
        ),
        case(
            "top_p above one",
            c,
            r#"{"prompt": "x", "top_p": 2}"#,
            400,
            "top_p",
        ),
        case(
            "negative top_k",
            c,
            r#"{"prompt": "x", "top_k": -5}"#,
            400,
            "top_k",
        ),
        case(
            "min_p above one",
            c,
            r#"{"prompt": "x", "min_p": 3}"#,
            400,
            "min_p",
        ),
        case("n zero", c, r#"{"prompt": "x", "n": 0}"#, 400, "n"),
        case("n huge", c, r#"{"prompt": "x", "n": 1000}"#, 400, "n"),
        case(
            "too many logprobs",
            c,
            r#"{"prompt": "x", "logprobs": 21}"#,
            400,
            "logprobs",
        ),
        case(
            "negative logprobs",
            c,
            r#"{"prompt": "x", "logprobs": -1}"#,
            400,
            "logprobs",
        ),
        case(
            "logit_bias key not a token",
            c,
            r#"{"prompt": "x", "logit_bias": {"abc": 1}}"#,
            400,
            "logit_bias",
        ),
        case(
            "logit_bias token out of vocabulary",
            c,
            r#"{"prompt": "x", "logit_bias": {"999999": -100}}"#,
            400,
            "logit_bias",
        ),
        case(
            "stop of wrong type",
            c,
            r#"{"prompt": "x", "stop": 5}"#,
            400,
            "stop",
        ),
        case(
            "too many stop strings",
            c,
            &format!(
                r#"{{"prompt": "x", "stop": [{}]}}"#,
                (0..17)
                    .map(|i| format!("\"s{i}\""))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            400,
            "stop",
        ),
        case(
            "seed out of range",
            c,
            r#"{"prompt": "x", "seed": 99999999999}"#,
            400,
            "seed",
        ),
        case(
            "invalid grammar",
            c,
            r#"{"prompt": "x", "grammar": "root ::= ("}"#,
            400,
            "grammar",
        ),
        case(
            "unsupported schema feature",
            c,
            r#"{"prompt": "x", "json_schema": {"type": "number", "multipleOf": 2}}"#,
            400,
            "multipleOf",
        ),
        case(
            "schema not an object",
            c,
            r#"{"prompt": "x", "json_schema": 5}"#,
            400,
            "json_schema",
        ),
        case(
            "unknown sampler name",
            c,
            r#"{"prompt": "x", "samplers": ["top_k", "nope"]}"#,
            400,
            "samplers",
        ),
        case(
            "prompt longer than the context",
            c,
            &format!(r#"{{"prompt": "{}"}}"#, "word ".repeat(6000)),
            400,
            "prompt",
        ),
        case(
            "zero-length model name",
            c,
            r#"{"prompt": "x", "model": ""}"#,
            400,
            "model",
        ),
        case(
            "unknown model",
            c,
            r#"{"prompt": "x", "model": "gpt-7"}"#,
            404,
            "model",
        ),
        case("empty messages", ch, r#"{"messages": []}"#, 400, "messages"),
        case(
            "missing messages",
            ch,
            r#"{"max_tokens": 2}"#,
            400,
            "messages",
        ),
        case(
            "unknown role",
            ch,
            r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
            400,
            "messages[0].role",
        ),
        case(
            "content of wrong type",
            ch,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            400,
            "messages[0].content",
        ),
        case(
            "message without content",
            ch,
            r#"{"messages": [{"role": "user"}]}"#,
            400,
            "messages[0]",
        ),
        case(
            "tool_choice naming no tool",
            ch,
            &format!(
                r#"{{{ok_msgs}, "tools": [{{"type": "function", "function": {{"name": "f"}}}}], "tool_choice": {{"type": "function", "function": {{"name": "g"}}}}}}"#
            ),
            400,
            "tool_choice",
        ),
        case(
            "tool parameters not an object schema",
            ch,
            &format!(
                r#"{{{ok_msgs}, "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {{"type": "string"}}}}}}]}}"#
            ),
            400,
            "tools[0].function.parameters",
        ),
        case(
            "tool result answering no call",
            ch,
            r#"{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]}"#,
            400,
            "messages[1].tool_call_id",
        ),
        case(
            "call arguments in history not JSON",
            ch,
            r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}"#,
            400,
            "messages[1].tool_calls[0].function.arguments",
        ),
        case(
            "too many top_logprobs",
            ch,
            &format!(r#"{{{ok_msgs}, "logprobs": true, "top_logprobs": 21}}"#),
            400,
            "top_logprobs",
        ),
        case(
            "top_logprobs without logprobs",
            ch,
            &format!(r#"{{{ok_msgs}, "top_logprobs": 3}}"#),
            400,
            "top_logprobs",
        ),
        case(
            "negative max_completion_tokens",
            ch,
            &format!(r#"{{{ok_msgs}, "max_completion_tokens": -2}}"#),
            400,
            "max_completion_tokens",
        ),
        case(
            "json_schema format without schema",
            ch,
            &format!(
                r#"{{{ok_msgs}, "response_format": {{"type": "json_schema", "json_schema": {{"name": "x"}}}}}}"#
            ),
            400,
            "response_format",
        ),
        case(
            "unknown response_format",
            ch,
            &format!(r#"{{{ok_msgs}, "response_format": {{"type": "xml"}}}}"#),
            400,
            "response_format.type",
        ),
        case(
            "grammar and json mode together",
            ch,
            &format!(
                r#"{{{ok_msgs}, "grammar": "root ::= \"a\"", "response_format": {{"type": "json_object"}}}}"#
            ),
            400,
            "grammar",
        ),
        case(
            "embeddings: empty input",
            e,
            r#"{"input": []}"#,
            400,
            "input",
        ),
        case(
            "embeddings: input of wrong type",
            e,
            r#"{"input": {"a": 1}}"#,
            400,
            "input",
        ),
        case(
            "embeddings: bad encoding_format",
            e,
            r#"{"input": "x", "encoding_format": "hex"}"#,
            400,
            "encoding_format",
        ),
        case(
            "embeddings: dimensions",
            e,
            r#"{"input": "x", "dimensions": 8}"#,
            400,
            "dimensions",
        ),
        case(
            "embeddings on a generation model",
            e,
            r#"{"input": "x"}"#,
            400,
            "embeddings",
        ),
        case(
            "rerank: empty query",
            "/v1/rerank",
            r#"{"query": "", "documents": ["a"]}"#,
            400,
            "query",
        ),
        case(
            "rerank: no documents",
            "/v1/rerank",
            r#"{"query": "q", "documents": []}"#,
            400,
            "documents",
        ),
        case(
            "rerank: a document that is not a string",
            "/rerank",
            r#"{"query": "q", "documents": ["a", {"text": 1}]}"#,
            400,
            "documents",
        ),
        case(
            "rerank: negative top_n",
            "/v1/rerank",
            r#"{"query": "q", "documents": ["a"], "top_n": -1}"#,
            400,
            "top_n",
        ),
        case(
            "rerank on a model without rank pooling",
            "/v1/rerank",
            r#"{"query": "q", "documents": ["a"]}"#,
            400,
            "rank pooling",
        ),
        case(
            "infill: input_extra not a list of {filename, text}",
            "/infill",
            r#"{"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}"#,
            400,
            "input_extra",
        ),
        case(
            "infill: prefix that is not a string",
            "/infill",
            r#"{"input_prefix": 1, "input_suffix": "b"}"#,
            400,
            "input_prefix",
        ),
        case(
            "infill on a model without FIM tokens",
            "/infill",
            r#"{"input_prefix": "a", "input_suffix": "b"}"#,
            400,
            "FIM",
        ),
        case(
            "lora: an adapter the model does not have",
            c,
            r#"{"prompt": "x", "max_tokens": 1, "lora": [{"id": 0, "scale": 1.0}]}"#,
            400,
            "lora",
        ),
        case(
            "lora: not a list",
            ch,
            &format!(r#"{{{ok_msgs}, "lora": {{"id": 0, "scale": 1}}}}"#),
            400,
            "lora",
        ),
        case(
            "lora: scale that is not a number",
            "/v1/query",
            r#"{"prompt": "x", "lora": [{"id": 0, "scale": "high"}]}"#,
            400,
            "lora",
        ),
        case(
            "lora-adapters: unknown id",
            "/lora-adapters",
            r#"[{"id": 3, "scale": 1.0}]"#,
            400,
            "lora",
        ),
        case(
            "lora-adapters: body that is not a list",
            "/lora-adapters",
            r#"{"id": 0, "scale": 1.0}"#,
            400,
            "JSON",
        ),
        case(
            "native query without prompt",
            "/v1/query",
            r#"{"max_tokens": 2}"#,
            400,
            "prompt",
        ),
        case(
            "native embed without input",
            "/v1/embed",
            r#"{}"#,
            400,
            "input",
        ),
        case(
            "detokenize negative id",
            "/detokenize",
            r#"{"tokens": [-1]}"#,
            400,
            "tokens",
        ),
        case(
            "tokenize without content",
            "/tokenize",
            r#"{}"#,
            400,
            "content",
        ),
    ];
    for path in ["/models/load", "/models/unload"] {
        v.extend([
            case("model admin: empty body", path, "", 400, "empty"),
            case("model admin: malformed JSON", path, "{", 400, "JSON"),
            case("model admin: missing model", path, r#"{}"#, 400, "model"),
            case(
                "model admin: model of wrong type",
                path,
                r#"{"model": 7}"#,
                400,
                "model",
            ),
            case(
                "model admin: empty model",
                path,
                r#"{"model": ""}"#,
                400,
                "model",
            ),
            case(
                "model admin: unknown model",
                path,
                r#"{"model": "no-such-model"}"#,
                404,
                "no-such-model",
            ),
        ]);
        v.push(Case {
            name: "model admin: wrong method",
            method: "GET",
            path,
            body: Vec::new(),
            status: 405,
            expect: "method",
        });
    }
    v.push(Case {
        name: "slots of an unknown model",
        method: "GET",
        path: "/slots?model=no-such-model",
        body: Vec::new(),
        status: 404,
        expect: "model",
    });
    v.push(Case {
        name: "slots: wrong method",
        method: "POST",
        path: "/slots",
        body: Vec::new(),
        status: 405,
        expect: "method",
    });
    // Slot and session persistence (this server has no --slot-save-path).
    for (what, base) in [("slot", "/slots/0"), ("session", "/v1/sessions/k")] {
        let at = |action: &str| -> &'static str {
            Box::leak(format!("{base}?action={action}").into_boxed_str())
        };
        let named =
            |n: &str| -> &'static str { Box::leak(format!("{what}: {n}").into_boxed_str()) };
        v.extend([
            case(named("unknown action"), at("compact"), "", 400, "action"),
            case(named("missing action"), base, "", 400, "action"),
            case(
                named("filename with .."),
                at("save"),
                r#"{"filename": "../x.bin"}"#,
                400,
                "filename",
            ),
            case(
                named("filename with /"),
                at("restore"),
                r#"{"filename": "dir/x.bin"}"#,
                400,
                "filename",
            ),
            case(
                named("filename with a backslash"),
                at("save"),
                r#"{"filename": "dir\\x.bin"}"#,
                400,
                "filename",
            ),
            case(
                named("empty filename"),
                at("restore"),
                r#"{"filename": ""}"#,
                400,
                "filename",
            ),
            case(named("missing filename"), at("save"), "{}", 400, "filename"),
            case(named("no body"), at("restore"), "", 400, "filename"),
            case(
                named("filename not a string"),
                at("save"),
                r#"{"filename": 7}"#,
                400,
                "filename",
            ),
            case(named("malformed JSON"), at("save"), "{", 400, "JSON"),
            case(
                named("save without --slot-save-path"),
                at("save"),
                r#"{"filename": "x.bin"}"#,
                501,
                "slot-save-path",
            ),
            case(
                named("restore without --slot-save-path"),
                at("restore"),
                r#"{"filename": "x.bin"}"#,
                501,
                "slot-save-path",
            ),
            case(
                named("unknown model"),
                Box::leak(format!("{base}?action=erase&model=no-such-model").into_boxed_str()),
                "",
                404,
                "no-such-model",
            ),
        ]);
        v.push(Case {
            name: named("wrong method"),
            method: "GET",
            path: at("erase"),
            body: Vec::new(),
            status: 405,
            expect: "method",
        });
    }
    v.extend([
        case(
            "slot id not a number",
            "/slots/abc?action=erase",
            "",
            400,
            "id_slot",
        ),
        case(
            "slot id out of range",
            "/slots/99?action=erase",
            "",
            400,
            "id_slot",
        ),
        case(
            "negative slot id",
            "/slots/-1?action=erase",
            "",
            400,
            "id_slot",
        ),
    ]);
    let mut invalid_utf8 = br#"{"prompt": ""#.to_vec();
    invalid_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    invalid_utf8.extend_from_slice(br#""}"#);
    v.push(Case {
        name: "invalid UTF-8",
        method: "POST",
        path: c,
        body: invalid_utf8,
        status: 400,
        expect: "JSON",
    });
    let mut big = br#"{"prompt": ""#.to_vec();
    big.extend(std::iter::repeat_n(b'a', 10 * 1024 * 1024));
    big.extend_from_slice(br#""}"#);
    v.push(Case {
        name: "10 MB prompt",
        method: "POST",
        path: c,
        body: big,
        status: 413,
        expect: "limit",
    });
    v.push(Case {
        name: "wrong method",
        method: "GET",
        path: c,
        body: Vec::new(),
        status: 405,
        expect: "method",
    });
    v.extend(image_cases());
    v.push(Case {
        name: "unknown route",
        method: "POST",
        path: "/v2/completions",
        body: b"{}".to_vec(),
        status: 404,
        expect: "route",
    });
    v
}

fn png(w: u32, h: u32) -> Vec<u8> {
    common::png_bytes(&image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([x as u8, y as u8, 7])
    }))
}

/// A chat body whose user message has these image URLs, then text.
fn with_images(model: &str, urls: &[String], text: &str) -> String {
    let mut parts: Vec<Value> = urls
        .iter()
        .map(|u| serde_json::json!({"type": "image_url", "image_url": {"url": u}}))
        .collect();
    parts.push(serde_json::json!({"type": "text", "text": text}));
    serde_json::json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": parts}]})
    .to_string()
}

/// Bad images, on the catalogue's vision target (`default`: at most 2
/// images of 200 kB and 512 pixels a side) and its text-only one (`text`).
fn image_cases() -> Vec<Case> {
    let ch = "/v1/chat/completions";
    let ok = common::data_url(&png(8, 8), "image/png");
    let mut broken = png(8, 8);
    broken.truncate(40);
    let mut big = png(8, 8);
    big.extend(std::iter::repeat_n(0u8, 300_000));
    let body = |urls: &[String], text: &str| with_images("default", urls, text);
    let own = |name, body: String, expect| Case {
        name,
        method: "POST",
        path: "/v1/chat/completions",
        body: body.into_bytes(),
        status: 400,
        expect,
    };
    vec![
        own(
            "image that does not decode",
            body(&[common::data_url(&broken, "image/png")], "hi"),
            "does not decode",
        ),
        own(
            "image format not supported",
            body(
                &[common::data_url(
                    b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
                    "image/gif",
                )],
                "hi",
            ),
            "not supported",
        ),
        own(
            "too many images",
            body(&[ok.clone(), ok.clone(), ok.clone()], "hi"),
            "at most 2",
        ),
        own(
            "image too large",
            body(&[common::data_url(&big, "image/png")], "hi"),
            "allowed per image",
        ),
        own(
            "image too many pixels",
            body(&[common::data_url(&png(600, 4), "image/png")], "hi"),
            "600x4",
        ),
        own(
            "image URL while fetching is off",
            body(&["https://example.com/cat.png".to_string()], "hi"),
            "fetch-image-urls",
        ),
        own(
            "image data URL not base64",
            body(&["data:image/png,rawbytes".to_string()], "hi"),
            "base64",
        ),
        own(
            "image to a text-only model",
            with_images("text", std::slice::from_ref(&ok), "hi"),
            "mmproj",
        ),
        own(
            "image marker in text",
            body(std::slice::from_ref(&ok), "see <__sipp_image__> here"),
            "stands for an image",
        ),
        case(
            "image part without a url",
            ch,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
            400,
            "url",
        ),
        case(
            "image embedding input",
            "/v1/embeddings",
            r#"{"input": [{"type": "image_url"}]}"#,
            400,
            "input",
        ),
        case(
            "Messages image with a bad source",
            "/v1/messages",
            r#"{"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]}"#,
            400,
            "source.type",
        ),
    ]
}

/// The catalogue's server config: the default model taking images (a tiny
/// projector, small image limits) and, as `text`, without a projector.
fn catalogue_config(dir: &std::path::Path) -> std::path::PathBuf {
    let src = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let mmproj = common::tiny_model(
        "smollm2-tiny-mmproj-seed1.gguf",
        "tiny_vision.py",
        &src,
        &["1"],
    );
    let path = dir.join("sipp.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[[models]]
id = "default"
model = "default"
default = true
[models.runtime]
mmproj = "{}"
[models.runtime.context]
n_ctx = 4096
n_parallel = 4
[models.runtime.images]
max_images = 2
max_image_bytes = 200000
max_image_side = 512

[[models]]
id = "text"
model = "default"
[models.runtime.context]
n_ctx = 1024
n_parallel = 1
"#,
            mmproj.display()
        ),
    )
    .expect("write config");
    path
}

#[test]
fn every_bad_input_gets_its_4xx_and_others_keep_being_served() {
    let tmp = common::temp_dir("bad-inputs");
    let dir = tmp.path().to_path_buf();
    let cfg = catalogue_config(&dir);
    let s = Server::start(&["--config", cfg.to_str().expect("utf-8 path")]);
    // A long generation streams the whole time.
    let url = s.url("/v1/completions");
    let stream = std::thread::spawn(move || {
        // reqwest's blocking client gives up after 30 s by default; on 2
        // busy cores 150 tokens beside 40 other requests can take longer.
        Client::builder()
            .timeout(std::time::Duration::from_secs(300))
            .build()
            .expect("client")
            .post(url)
            .json(&serde_json::json!({"prompt": "Tell me a long story", "max_tokens": 150, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}))
            .send()
            .and_then(|r| r.text())
    });
    // A fresh connection per case: a 413 is answered before the body is read,
    // after which the server closes that connection.
    let c = Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let cases = catalogue();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for k in &cases {
        let req = match k.method {
            "GET" => c.get(s.url(k.path)),
            _ => c
                .post(s.url(k.path))
                .header("content-type", "application/json")
                .body(k.body.clone()),
        };
        let r = req
            .send()
            .unwrap_or_else(|e| panic!("{}: no response: {e}", k.name));
        let status = r.status().as_u16();
        let v: Value = r.json().unwrap_or(Value::Null);
        let shaped = v["error"]["message"].is_string() && v["error"]["type"].is_string();
        let mentions = v["error"]["param"].as_str() == Some(k.expect)
            || v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(k.expect));
        if status != k.status || !shaped || !mentions {
            failures.push(format!(
                "{}: got {status} {v}, expected {} mentioning {:?}",
                k.name, k.status, k.expect
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases wrong:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    let body = stream.join().expect("thread").expect("stream answered");
    assert!(
        body.contains("\"completion_tokens\":150"),
        "the concurrent stream was disturbed: {body}"
    );
    assert!(body.trim_end().ends_with("data: [DONE]"));
    // Nothing was left running.
    assert!(common::eventually(
        std::time::Duration::from_secs(5),
        || s.metric("sipp_busy_slots{") == Some(0.0)
    ));
    assert_eq!(s.metric("sipp_idle_invariant_violations_total{"), Some(0.0));
    println!(
        "bad inputs: {} cases, each answered with its documented status",
        cases.len()
    );
}
