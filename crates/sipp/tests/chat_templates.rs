//! Golden tests: sipp renders chat templates exactly as Hugging Face
//! transformers does. `fixtures/chat/expected.json` comes from
//! `scripts/chat_golden.py`, which renders each fixture with transformers' own
//! `render_jinja_template` (the code behind `apply_chat_template`); the last
//! test re-runs that script to show the file is current.
//!
//! A case without `tools` is rendered as it is ([`ChatTemplate::render`]). A
//! case with `tools` is a chat turn as the OpenAI endpoint prepares it
//! (`RequestPreparer::render_turn`): templates that render tools get the tools,
//! calls and tool results as they are; the others get the documented fallback
//! ([`format::fallback_messages`]), which the script re-implements on its own.
//! Each template's path is pinned in cases.json, on both sides.

mod common;

use std::path::PathBuf;

use sipp::chat::{ChatError, ChatMessage, ChatTemplate, RenderOptions};
use sipp::engine::TemplateCaps;
use sipp::tools::{format, Tool, ToolSpec};

fn fixtures() -> PathBuf {
    common::manifest_dir().join("tests/fixtures/chat")
}

fn load(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).expect("fixture"))
        .expect("json")
}

/// One chat turn rendered as `RequestPreparer::render_turn` renders it, with
/// the case's `add_generation_prompt`.
fn render_turn(
    template: &ChatTemplate,
    caps: TemplateCaps,
    messages: &[ChatMessage],
    spec: &ToolSpec,
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    add_generation_prompt: bool,
) -> Result<String, ChatError> {
    spec.validate().expect("valid tools");
    format::check_history(messages).expect("valid tool history");
    let shown: &[Tool] = if spec.may_call() { &spec.tools } else { &[] };
    if caps.native_tools {
        template.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt,
                tools: (!shown.is_empty()).then_some(shown),
                kwargs,
            },
        )
    } else {
        let messages = format::fallback_messages(
            messages,
            shown,
            caps.format,
            spec.parallel,
            caps.system_role,
        )
        .expect("fallback");
        template.render_with(
            &messages,
            &RenderOptions {
                add_generation_prompt,
                tools: None,
                kwargs,
            },
        )
    }
}

#[test]
fn every_template_matches_transformers() {
    let spec = load("cases.json");
    let expected = load("expected.json");
    let templates = spec["templates"].as_object().expect("templates");
    let cases = spec["cases"].as_object().expect("cases");
    let mut checked = 0;
    let mut with_tools = 0;
    for (name, t) in templates {
        let source = std::fs::read_to_string(fixtures().join(t["file"].as_str().expect("file")))
            .expect("template");
        let template = ChatTemplate::new(
            &source,
            t["bos_token"].as_str().expect("bos"),
            t["eos_token"].as_str().expect("eos"),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        // The path tool cases take, as the engine decides it.
        let caps = TemplateCaps::of(&template);
        assert_eq!(
            (
                if caps.native_tools {
                    "native"
                } else {
                    "fallback"
                },
                caps.format.as_str(),
                caps.system_role
            ),
            (
                t["tools_path"].as_str().expect("tools_path"),
                t["tool_format"].as_str().expect("tool_format"),
                t["system_role"].as_bool().expect("system_role")
            ),
            "{name}: (tools_path, tool_format, system_role)"
        );
        for (case, c) in cases {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(c["messages"].clone()).expect("messages");
            let add = c["add_generation_prompt"].as_bool().expect("bool");
            let got = match c.get("tools") {
                None => template.render(&messages, add),
                Some(names) => {
                    let tools = names
                        .as_array()
                        .expect("tool names")
                        .iter()
                        .map(|n| {
                            let def = &spec["tool_definitions"][n.as_str().expect("tool name")];
                            serde_json::from_value::<Tool>(def.clone()).expect("tool")
                        })
                        .collect();
                    let kwargs = c.get("kwargs").map(|k| k.as_object().expect("kwargs"));
                    with_tools += 1;
                    render_turn(
                        &template,
                        caps,
                        &messages,
                        &ToolSpec::auto(tools),
                        kwargs,
                        add,
                    )
                }
            };
            let want = &expected[name][case];
            match (got, want.get("ok"), want.get("error")) {
                (Ok(text), Some(ok), _) => {
                    assert_eq!(text, ok.as_str().expect("text"), "{name}/{case}")
                }
                (Err(ChatError::Raised(msg)), _, Some(err)) => {
                    assert_eq!(msg, err.as_str().expect("text"), "{name}/{case}")
                }
                (got, _, _) => panic!("{name}/{case}: got {got:?}, expected {want}"),
            }
            checked += 1;
        }
    }
    // 7 templates (Qwen 2.5, Qwen 3, Llama 3.1, Mistral, Gemma 1/2, Gemma 3,
    // SmolLM2) times 14 cases, 9 of them with tools.
    assert_eq!((checked, with_tools), (98, 63), "renderings checked");
}

#[test]
fn golden_file_is_what_transformers_renders_now() {
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("../../scripts/chat_golden.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(fixtures())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{python} {}: {} (scripts/test.sh installs transformers into the test venv)",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let now: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(now, load("expected.json"));
}

/// The template sipp gives a Gemma 3 base GGUF (which ships none) is the
/// fixture checked against transformers above.
#[test]
fn gemma3_family_template_is_the_checked_fixture() {
    let fixture = std::fs::read_to_string(fixtures().join("gemma3.jinja")).expect("fixture");
    assert_eq!(
        sipp::chat::family_template("gemma3"),
        Some(fixture.as_str())
    );
    assert_eq!(sipp::chat::family_template("llama"), None);
}
