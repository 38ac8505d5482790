//! Images in: the default model with a tiny random-weight LLaVA-style
//! projector (scripts/tiny_vision.py), served by `sipp serve --mmproj`.
//! Greedy tokens for 5 images x 2 prompts equal llama.cpp's llama-mtmd-cli
//! on the same files (up to near-ties), different images give different
//! tokens or logits (an ignored image cannot pass), and the official openai
//! client chats with images, streamed and not, with the same image twice
//! cached, and with eight image requests beside a text stream
//! (tests/images_client.py). Also: the Messages and Responses APIs' image
//! parts, and `/v1/models`' input modalities.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use common::post_json as post;
use common::Server;
use common::{data_url, png_bytes};
use reqwest::blocking::Client;
use serde_json::{json, Value};

const PROMPTS: [&str; 2] = ["Describe the image.", "What colour dominates?"];
const N: u32 = 16;
/// Near-tie rule: sipp and the reference may part only where sipp's top-2
/// logprob gap is at most this.
const NEAR_TIE: f32 = 1.0;

fn projector() -> PathBuf {
    let src = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model fetched");
    common::tiny_model(
        "smollm2-tiny-mmproj-seed1.gguf",
        "tiny_vision.py",
        &src,
        &["1"],
    )
}

/// Test image `i` (sizes and patterns differ; none is the projector's 64x64
/// except two, so most are resized the way llama.cpp resizes).
fn image(i: u32) -> image::RgbImage {
    let (w, h) = [
        (64, 64),
        (40, 30),
        (64, 64),
        (100, 80),
        (48, 48),
        (33, 57),
        (72, 20),
        (50, 50),
        (20, 90),
        (64, 40),
    ][i as usize % 10];
    let mut seed = 0x9E37_79B9u32.wrapping_mul(i + 1);
    image::RgbImage::from_fn(w, h, |x, y| {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let noise = (seed >> 24) as u8;
        match i % 5 {
            0 => image::Rgb([220, (x * 3) as u8, 30]),
            1 => {
                if (y / 5) % 2 == 0 {
                    image::Rgb([20, 40, 200])
                } else {
                    image::Rgb([240, 240, 240])
                }
            }
            2 => {
                if (x / 8 + y / 8) % 2 == 0 {
                    image::Rgb([10, 160, 20])
                } else {
                    image::Rgb([0, 0, 0])
                }
            }
            3 => image::Rgb([(x * 2) as u8, (y * 3) as u8, ((x + y) * (i + 1)) as u8]),
            _ => image::Rgb([noise, noise / 2, 255 - noise]),
        }
    })
}

/// llama-mtmd-cli's greedy text for one image and prompt: the model's own
/// chat template (`--jinja`, as sipp renders it), the image marker right
/// before the prompt (as both put an image part before a text part).
fn reference(model: &Path, mmproj: &Path, png: &Path, prompt: &str) -> String {
    let out = Command::new(common::reference_tool("llama-mtmd-cli"))
        .arg("-m")
        .arg(model)
        .arg("--mmproj")
        .arg(mmproj)
        .arg("--image")
        .arg(png)
        .args([
            "-p",
            prompt,
            "-n",
            &N.to_string(),
            "--temp",
            "0",
            "-t",
            "2",
            "--jinja",
        ])
        .output()
        .expect("llama-mtmd-cli runs");
    assert!(
        out.status.success(),
        "llama-mtmd-cli failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A greedy chat answer: its text, each token's text and top-2 gap, and the
/// first token's top log-probabilities.
#[derive(Debug)]
struct Answer {
    text: String,
    pieces: Vec<(String, f32)>,
    first_top: Vec<(String, f64)>,
}

fn chat(c: &Client, s: &Server, url: &str, prompt: &str) -> Answer {
    let (status, v) = post(
        c,
        &s.url("/v1/chat/completions"),
        &json!({
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": prompt}]}],
            "max_tokens": N, "temperature": 0, "logprobs": true, "top_logprobs": 2,
            "cache_prompt": false,
        }),
    );
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .clone();
    let top = |t: &Value| -> Vec<(String, f64)> {
        t["top_logprobs"]
            .as_array()
            .expect("top")
            .iter()
            .map(|x| {
                (
                    x["token"].as_str().unwrap_or_default().to_string(),
                    x["logprob"].as_f64().unwrap_or_default(),
                )
            })
            .collect()
    };
    Answer {
        text: v["choices"][0]["message"]["content"]
            .as_str()
            .expect("text")
            .to_string(),
        pieces: content
            .iter()
            .map(|t| {
                let tt = top(t);
                let gap = if tt.len() >= 2 {
                    tt[0].1 - tt[1].1
                } else {
                    f64::INFINITY
                };
                (
                    t["token"].as_str().unwrap_or_default().to_string(),
                    gap as f32,
                )
            })
            .collect(),
        first_top: content.first().map(top).unwrap_or_default(),
    }
}

/// sipp's answer equals the reference's text, or parts from it only at a
/// token where sipp's two best candidates were within [`NEAR_TIE`].
fn same_up_to_near_tie(a: &Answer, reference: &str, what: &str) -> bool {
    let (mine, theirs) = (a.text.trim(), reference.trim());
    if mine == theirs {
        return false;
    }
    let mut text = String::new();
    for (piece, gap) in &a.pieces {
        let next = format!("{text}{piece}");
        if !theirs.starts_with(next.trim_start()) {
            assert!(
                *gap <= NEAR_TIE,
                "{what}: sipp {mine:?} parts from llama-mtmd-cli {theirs:?} at {piece:?}, \
                 where its top-2 gap is {gap} (more than the near-tie {NEAR_TIE})"
            );
            return true;
        }
        text = next;
    }
    // Every sipp token is a prefix of the reference: it stopped earlier.
    assert!(theirs.starts_with(mine), "{what}: {mine:?} vs {theirs:?}");
    false
}

#[test]
fn images_match_llama_mtmd_cli_and_serve_the_openai_client() {
    let mmproj = projector();
    let model = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let tmp = common::temp_dir("images");
    let dir = tmp.path().to_path_buf();
    let pngs: Vec<(PathBuf, String)> = (0..10)
        .map(|i| {
            let bytes = png_bytes(&image(i));
            let path = dir.join(format!("image{i}.png"));
            std::fs::write(&path, &bytes).expect("write png");
            (path, data_url(&bytes, "image/png"))
        })
        .collect();

    let s = Server::start(&[
        "--mmproj",
        mmproj.to_str().expect("utf-8 path"),
        "--parallel",
        "9",
    ]);
    let c = Client::new();

    // The model lists images among its inputs.
    let models: Value = c
        .get(s.url("/v1/models"))
        .send()
        .expect("models")
        .json()
        .expect("json");
    assert_eq!(
        models["data"][0]["meta"]["input_modalities"],
        json!(["text", "image"]),
        "{models}"
    );

    // 5 images x 2 prompts against llama-mtmd-cli.
    let mut parted = 0;
    let mut answers: Vec<Vec<Answer>> = Vec::new();
    for prompt in PROMPTS {
        let mut row = Vec::new();
        for (png, url) in &pngs[..5] {
            let r = reference(&model, &mmproj, png, prompt);
            let a = chat(&c, &s, url, prompt);
            let what = format!("{} / {prompt:?}", png.display());
            eprintln!("{what}: sipp {:?}, llama-mtmd-cli {r:?}", a.text);
            assert!(!a.text.trim().is_empty(), "{what}: no text");
            parted += usize::from(same_up_to_near_tie(&a, &r, &what));
            row.push(a);
        }
        answers.push(row);
    }
    eprintln!("{parted} of 10 parted from llama-mtmd-cli at near-ties");
    // Different images: different tokens, or at least different logits.
    for (prompt, row) in PROMPTS.iter().zip(&answers) {
        for i in 0..row.len() {
            for j in i + 1..row.len() {
                let logits_differ = row[i]
                    .first_top
                    .iter()
                    .zip(&row[j].first_top)
                    .any(|(x, y)| x.0 != y.0 || (x.1 - y.1).abs() > 1e-3);
                assert!(
                    row[i].text != row[j].text || logits_differ,
                    "{prompt:?}: images {i} and {j} give the same tokens and logits"
                );
            }
        }
    }

    // JPEG and WebP are read too (decoders other than llama.cpp's: only
    // that an answer comes is checked).
    for (fmt, mime) in [
        (image::ImageFormat::Jpeg, "image/jpeg"),
        (image::ImageFormat::WebP, "image/webp"),
    ] {
        let mut out = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(image(3))
            .write_to(&mut out, fmt)
            .expect("encodes");
        let a = chat(&c, &s, &data_url(&out.into_inner(), mime), PROMPTS[0]);
        assert!(!a.text.is_empty(), "{mime}");
    }

    // Anthropic's Messages API: a base64 image block.
    let b64 = base64::engine::general_purpose::STANDARD.encode(png_bytes(&image(2)));
    let (status, v) = post(
        &c,
        &s.url("/v1/messages"),
        &json!({"max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": PROMPTS[0]}]}]}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["input_tokens"].as_u64().unwrap_or(0) > 64, "{v}");
    // The same image and prompt through chat completions give the same text
    // (one template, one image) up to a near-tie: the chat request computes
    // its prompt afresh (`cache_prompt: false`), the Messages request may
    // reuse cached KV, and batching moves logits.
    let same = chat(&c, &s, &pngs[2].1, PROMPTS[0]);
    let messages_text = v["content"][0]["text"].as_str().unwrap_or_default();
    let mut text = String::new();
    for (piece, gap) in &same.pieces {
        if text.len() >= messages_text.len() {
            break;
        }
        let next = format!("{text}{piece}");
        if !messages_text.starts_with(&next) && !next.starts_with(messages_text) {
            eprintln!("messages and chat part at {piece:?}, top-2 gap {gap}");
            assert!(
                *gap <= NEAR_TIE,
                "messages {messages_text:?} vs chat {:?}: they part at {piece:?}, \
                 where the chat's top-2 gap is {gap} (more than the near-tie {NEAR_TIE})",
                same.text
            );
            break;
        }
        text = next;
    }
    // OpenAI's Responses API: an input_image part.
    let (status, v) = post(
        &c,
        &s.url("/v1/responses"),
        &json!({"max_output_tokens": 8, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": pngs[2].1},
            {"type": "input_text", "text": PROMPTS[0]}]}]}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["input_tokens"].as_u64().unwrap_or(0) > 64, "{v}");

    // Every image so far was computed and counted.
    let images = s.metric("sipp_images_total{").expect("sipp_images_total");
    assert!(images >= 10.0, "{images} images counted");
    // The official client: streamed and not, cached, concurrent.
    let urls: Vec<&String> = pngs.iter().map(|(_, u)| u).collect();
    let file = dir.join("images.json");
    std::fs::write(&file, serde_json::to_vec(&urls).expect("json")).expect("write");
    common::run_python_client(
        &s,
        "SIPP_PYTHON",
        "images_client.py",
        &[file.to_str().expect("utf-8 path")],
        "openai client with images",
    );
}

/// Serves `body` as any path but `/missing` (404) over HTTP/1.1 on
/// loopback, for as long as the test runs.
fn image_host(body: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 4096];
            let n = conn.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]);
            let reply = if head.starts_with("GET /missing") {
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec()
            } else {
                let mut r = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                r.extend_from_slice(&body);
                r
            };
            let _ = conn.write_all(&reply);
        }
    });
    format!("http://{addr}")
}

#[test]
fn image_urls_are_fetched_only_when_allowed() {
    let mmproj = projector();
    let bytes = png_bytes(&image(1));
    let host = image_host(bytes.clone());
    let c = Client::new();
    let ask = |s: &Server, url: &str| {
        post(
            &c,
            &s.url("/v1/chat/completions"),
            &json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": PROMPTS[0]}]}],
                "max_tokens": 6, "temperature": 0, "cache_prompt": false}),
        )
    };
    let url = format!("{host}/cat.png");
    {
        let s = Server::start(&["--mmproj", mmproj.to_str().expect("utf-8 path")]);
        let (status, v) = ask(&s, &url);
        assert_eq!(status, 400, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("--fetch-image-urls"),
            "{v}"
        );
    }
    let s = Server::start(&[
        "--mmproj",
        mmproj.to_str().expect("utf-8 path"),
        "--fetch-image-urls",
    ]);
    let (status, fetched) = ask(&s, &url);
    assert_eq!(status, 200, "{fetched}");
    let (status, inline) = ask(&s, &data_url(&bytes, "image/png"));
    assert_eq!(status, 200, "{inline}");
    assert_eq!(
        fetched["choices"][0]["message"]["content"], inline["choices"][0]["message"]["content"],
        "the fetched image is the same image"
    );
    let (status, v) = ask(&s, &format!("{host}/missing"));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("404"),
        "{v}"
    );
}

#[test]
fn run_takes_images_and_refuses_bad_projectors() {
    let mmproj = projector();
    let model = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let tmp = common::temp_dir("run-images");
    let dir = tmp.path().to_path_buf();
    let png = dir.join("image.png");
    std::fs::write(&png, png_bytes(&image(4))).expect("write png");
    let _turn = common::ServerTurn::take();
    let run = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_sipp"))
            .arg("run")
            .args(args)
            .output()
            .expect("sipp runs")
    };
    let out = run(&[
        "--mmproj".as_ref(),
        mmproj.as_os_str(),
        "--image".as_ref(),
        png.as_os_str(),
        "-n".as_ref(),
        N.to_string().as_ref(),
        "--temperature".as_ref(),
        "0".as_ref(),
        "-t".as_ref(),
        "2".as_ref(),
        PROMPTS[1].as_ref(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // `run` prints no logprobs: the near-tie rule reads them from the same
    // request through `sipp serve` (itself checked against llama-mtmd-cli
    // above), whose text `run`'s must equal up to a near-tie.
    {
        let s = Server::start(&["--mmproj", mmproj.to_str().expect("utf-8 path")]);
        let served = chat(
            &Client::new(),
            &s,
            &data_url(&png_bytes(&image(4)), "image/png"),
            PROMPTS[1],
        );
        same_up_to_near_tie(&served, &text, "sipp run vs sipp serve");
    }
    // Another image, another answer: the image reaches the model.
    let other = dir.join("other.png");
    std::fs::write(&other, png_bytes(&image(2))).expect("write png");
    let out2 = run(&[
        "--mmproj".as_ref(),
        mmproj.as_os_str(),
        "--image".as_ref(),
        other.as_os_str(),
        "-n".as_ref(),
        N.to_string().as_ref(),
        "--temperature".as_ref(),
        "0".as_ref(),
        PROMPTS[1].as_ref(),
    ]);
    assert!(out2.status.success());
    assert_ne!(String::from_utf8_lossy(&out2.stdout).trim(), text);
    // A projector that is none, or one that is missing: usage errors.
    for bad in [
        model.as_os_str(),
        dir.join("missing.gguf").into_os_string().leak(),
    ] {
        let out = run(&["--mmproj".as_ref(), bad, "hi".as_ref()]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("projector"));
    }
    // An image for a model without a projector.
    let out = run(&["--image".as_ref(), png.as_os_str(), "hi".as_ref()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("takes no images"));
}
