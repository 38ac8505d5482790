//! Anthropic's Messages API on the fake: the message and event shapes, the
//! stop reasons, `count_tokens`, errors in Anthropic's shape, `x-api-key`.

use serde_json::{json, Value};
use sipp_server::ServerSection;

use crate::harness::{target, App, Fake, Reply};

/// The prompt tokens of a conversation on the fake: BOS and one per byte of
/// the rendered template.
fn rendered_len(text: &str) -> u64 {
    1 + text.len() as u64
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn weather() -> Value {
    json!({"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

/// Checks an Anthropic error: the status, `{"type": "error", "error": {"type",
/// "message"}}` and nothing else, JSON; returns the message.
#[track_caller]
fn assert_anthropic_error(r: &Reply, status: u16, kind: &str) -> String {
    let v = r.json();
    assert_eq!(r.status.as_u16(), status, "{v}");
    let mut top: Vec<&String> = v.as_object().expect("object").keys().collect();
    top.sort();
    assert_eq!(top, vec!["error", "type"], "{v}");
    assert_eq!(v["type"], "error", "{v}");
    let mut inner: Vec<&String> = v["error"].as_object().expect("object").keys().collect();
    inner.sort();
    assert_eq!(inner, vec!["message", "type"], "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{:?}",
        r.headers
    );
    let m = v["error"]["message"].as_str().expect("message").to_string();
    assert!(!m.is_empty(), "{v}");
    m
}

/// The events of an Anthropic stream as (event name, data), checking the
/// framing: every event has an `event:` line naming its data's `type`, then
/// one `data:` line of JSON (`:` comments are keep-alives).
#[track_caller]
fn events(r: &Reply) -> Vec<(String, Value)> {
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        r.headers
    );
    let body = r.text();
    assert!(body.ends_with("\n\n"), "unterminated event: {body:?}");
    let mut out = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let lines: Vec<&str> = event.lines().filter(|l| !l.starts_with(':')).collect();
        if lines.is_empty() {
            continue;
        }
        assert_eq!(lines.len(), 2, "{event:?}");
        let name = lines[0]
            .strip_prefix("event: ")
            .unwrap_or_else(|| panic!("no `event:` line: {event:?}"));
        let data = lines[1]
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("no `data:` line: {event:?}"));
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert_eq!(v["type"], name, "{event:?}");
        out.push((name.to_string(), v));
    }
    out
}

/// The text of a stream's text deltas.
fn streamed_text(ev: &[(String, Value)]) -> String {
    ev.iter()
        .filter(|(_, v)| v["delta"]["type"] == "text_delta")
        .map(|(_, v)| v["delta"]["text"].as_str().expect("text").to_string())
        .collect()
}

/// A whole answer: `msg_` id, `message`, `assistant`, the model, one text
/// block, `max_tokens` when cut, and usage whose input tokens (computed and
/// cached) are the rendered prompt.
#[tokio::test]
async fn messages_answer_in_anthropics_shape() {
    let app = App::new();
    let r = app
        .post(
            "/v1/messages",
            json!({"model": "fake", "max_tokens": 8, "temperature": 0, "messages": user("Say hi"),
                   "system": [{"type": "text", "text": "Be brief."}], "metadata": {"user_id": "u1"}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().expect("id").starts_with("msg_"), "{v}");
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["role"], "assistant", "{v}");
    assert_eq!(v["model"], "fake", "{v}");
    let content = v["content"].as_array().expect("content");
    assert_eq!(content.len(), 1, "{v}");
    assert_eq!(content[0]["type"], "text", "{v}");
    assert!(
        !content[0]["text"].as_str().expect("text").is_empty(),
        "{v}"
    );
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["stop_sequence"], Value::Null, "{v}");
    assert_eq!(v["usage"]["output_tokens"], 8, "{v}");
    let input = v["usage"]["input_tokens"].as_u64().expect("input")
        + v["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
    let expected = rendered_len("<|system|>Be brief.\n<|user|>Say hi\n<|assistant|>");
    assert_eq!(input, expected, "{v}");
    // count_tokens renders the same prompt.
    let c = app
        .post(
            "/v1/messages/count_tokens",
            json!({"model": "fake", "messages": user("Say hi"), "system": "Be brief."}),
        )
        .await;
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(c.json(), json!({"input_tokens": expected}));
}

/// The stream: `message_start` (empty content, null stop reason), `ping`,
/// one text block's start, deltas and stop, `message_delta` with the stop
/// reason and usage, `message_stop`; its text is the whole answer's.
#[tokio::test]
async fn streamed_messages_follow_anthropics_event_sequence() {
    let app = App::new();
    let body = json!({"max_tokens": 10, "temperature": 0, "messages": user("Tell me")});
    let whole = app.post("/v1/messages", body.clone()).await.json();
    let mut body = body;
    body["stream"] = json!(true);
    let ev = events(&app.post("/v1/messages", body).await);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names[..4],
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta"
        ],
        "{names:?}"
    );
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{names:?}"
    );
    assert!(
        names[3..names.len() - 3]
            .iter()
            .all(|n| *n == "content_block_delta"),
        "{names:?}"
    );
    let start = &ev[0].1["message"];
    assert!(
        start["id"].as_str().expect("id").starts_with("msg_"),
        "{start}"
    );
    assert_eq!(start["type"], "message");
    assert_eq!(start["role"], "assistant");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(start["model"], "fake");
    assert!(start["usage"]["input_tokens"].as_u64().expect("input") > 0);
    assert_eq!(ev[2].1["index"], 0);
    assert_eq!(
        ev[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert!(ev[3..ev.len() - 3].iter().all(|(_, v)| v["index"] == 0));
    assert_eq!(
        ev[ev.len() - 3].1,
        json!({"type": "content_block_stop", "index": 0})
    );
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    assert_eq!(delta["usage"]["output_tokens"], 10, "{delta}");
    assert_eq!(
        delta["usage"]["input_tokens"].as_u64().expect("input")
            + delta["usage"]["cache_read_input_tokens"]
                .as_u64()
                .unwrap_or(0),
        rendered_len("<|user|>Tell me\n<|assistant|>")
    );
    assert_eq!(ev[ev.len() - 1].1, json!({"type": "message_stop"}));
    assert_eq!(
        streamed_text(&ev),
        whole["content"][0]["text"].as_str().expect("text")
    );
}

/// A stop sequence ends the text before it: `stop_sequence` and the one that
/// matched, whole and streamed.
#[tokio::test]
async fn stop_sequences_report_the_one_that_matched() {
    let app = App::new();
    let body = json!({"max_tokens": 16, "temperature": 0, "messages": user("Go on")});
    let plain = app.post("/v1/messages", body.clone()).await.json();
    let text = plain["content"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "{text:?}");
    let stop: String = chars[3..5].iter().collect();
    let before = &text[..text.find(&stop).expect("in the text")];
    let mut body = body;
    body["stop_sequences"] = json!(["<never-written>", stop]);
    let v = app.post("/v1/messages", body.clone()).await.json();
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop.as_str(), "{v}");
    assert_eq!(v["content"][0]["text"], before, "{v}");
    body["stream"] = json!(true);
    let ev = events(&app.post("/v1/messages", body).await);
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], stop.as_str(), "{delta}");
    assert_eq!(streamed_text(&ev), before);
}

/// A tool loop's history renders (tool_use and tool_result become calls and
/// tool messages), tools add to the prompt, and `thinking` is accepted.
#[tokio::test]
async fn tool_history_tools_and_thinking_render() {
    let app = App::new();
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}
        ]}
    ]);
    let r = app
        .post(
            "/v1/messages",
            json!({"max_tokens": 4, "messages": history, "tools": [weather()],
                   "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stop_reason"], "max_tokens");
    let count = |body: Value| {
        let app = &app;
        async move {
            let r = app.post("/v1/messages/count_tokens", body).await;
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["input_tokens"].as_u64().expect("count")
        }
    };
    let without = count(json!({"messages": history})).await;
    let with = count(json!({"messages": history, "tools": [weather()]})).await;
    assert!(with > without, "{with} <= {without}");
    let none =
        count(json!({"messages": history, "tools": [weather()], "tool_choice": {"type": "none"}}))
            .await;
    assert_eq!(none, without);
    let thinking =
        count(json!({"messages": history, "thinking": {"type": "enabled", "budget_tokens": 1024}}))
            .await;
    assert_eq!(thinking, without);
}

/// Every failure is in Anthropic's shape, with the status the OpenAI routes
/// use, and validation errors name the field.
#[tokio::test]
async fn errors_are_anthropic_shaped_and_name_the_field() {
    let app = App::new();
    let post = |body: Value| app.post("/v1/messages", body);
    let r = post(json!({"messages": user("hi")})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("max_tokens"), "{m}");
    let r = post(json!({"max_tokens": 0, "messages": user("hi")})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("max_tokens"), "{m}");
    let r = post(
        json!({"max_tokens": 4, "messages": user("hi"), "tools": [weather()],
                        "tool_choice": {"type": "tool", "name": "get_time"}}),
    )
    .await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(
        m.contains("tool_choice.name") && m.contains("get_time"),
        "{m}"
    );
    let r = post(json!({"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
    ]}))
    .await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("messages[0].content[0].tool_use_id"), "{m}");
    let r = post(json!({"max_tokens": 4, "messages": user("hi"), "tools": [{"name": "f", "input_schema": {"type": "string"}}]})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("tools[0].input_schema"), "{m}");
    let r = post(json!({"max_tokens": 4, "messages": user("hi"), "top_p": 3})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("top_p"), "{m}");
    let stops: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
    let r = post(json!({"max_tokens": 4, "messages": user("hi"), "stop_sequences": stops})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("stop_sequences"), "{m}");
    let r = post(json!({"max_tokens": 4, "messages": []})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("messages"), "{m}");
    let r = post(json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})).await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("messages[0].content[0].source.type"), "{m}");
    // A well-formed image to a model without a projector.
    let r = post(json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "what is this?"}]}]}))
    .await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("takes no images"), "{m}");
    let r = post(json!({"model": "no-such", "max_tokens": 4, "messages": user("hi")})).await;
    assert_anthropic_error(&r, 404, "not_found_error");
    let r = post(json!({"model": "embed", "max_tokens": 4, "messages": user("hi")})).await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = app.post_raw("/v1/messages", "{not json", &[]).await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = app.post_raw("/v1/messages/count_tokens", "", &[]).await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = app
        .post("/v1/messages/count_tokens", json!({"messages": user("hi"), "tools": [weather()], "tool_choice": {"type": "tool", "name": "x"}}))
        .await;
    let m = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(m.contains("tool_choice.name"), "{m}");
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let r = app.get(path).await;
        assert_anthropic_error(&r, 405, "invalid_request_error");
    }
}

/// With API keys, `x-api-key` is accepted as well as `Authorization: Bearer`,
/// on every route; refusals on the Anthropic routes are Anthropic-shaped.
#[tokio::test]
async fn x_api_key_is_accepted_and_refusals_are_anthropic_shaped() {
    let app = App::with(
        ServerSection {
            api_keys: vec!["sk-one".into(), "sk-two".into()],
            ..ServerSection::default()
        },
        vec![(target("fake", &[]), Fake::default())],
    );
    let body = json!({"max_tokens": 2, "messages": user("hi")}).to_string();
    for headers in [
        vec![],
        vec![("x-api-key", "sk-three")],
        vec![("x-api-key", "")],
        vec![("authorization", "Bearer sk-three")],
    ] {
        let r = app.post_raw("/v1/messages", body.clone(), &headers).await;
        assert_anthropic_error(&r, 401, "authentication_error");
    }
    for headers in [
        vec![("x-api-key", "sk-one")],
        vec![("x-api-key", "sk-two"), ("anthropic-version", "2023-06-01")],
        vec![("authorization", "Bearer sk-one")],
        vec![("x-api-key", "wrong"), ("authorization", "Bearer sk-two")],
    ] {
        let r = app.post_raw("/v1/messages", body.clone(), &headers).await;
        assert_eq!(r.status, 200, "{headers:?}: {}", r.text());
    }
    let r = app
        .post_raw(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1}).to_string(),
            &[("x-api-key", "sk-one")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        app.get_with("/v1/models", &[("x-api-key", "sk-two")])
            .await
            .status,
        200
    );
    // The OpenAI routes keep OpenAI's shape.
    let r = app.get_with("/v1/models", &[("x-api-key", "nope")]).await;
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["code"].is_string(), "{}", r.text());
}
