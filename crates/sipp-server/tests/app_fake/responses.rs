//! OpenAI's Responses API on the fake: the response object, storing and
//! retrieving, `previous_response_id` chaining, tool calls, errors, and the
//! typed event stream.

use axum::body::Body;
use axum::http::{Method, Request};
use serde_json::{json, Value};

use crate::harness::{assert_error, App, Reply};

const BAD: &str = "invalid_request_error";

fn weather() -> Value {
    json!({
        "type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": false}
    })
}

/// The concatenated `output_text` of a response.
fn output_text(r: &Value) -> String {
    let mut out = String::new();
    for item in r["output"].as_array().expect("output") {
        if item["type"] == "message" {
            for c in item["content"].as_array().expect("content") {
                assert_eq!(c["type"], "output_text", "{r}");
                out.push_str(c["text"].as_str().expect("text"));
            }
        }
    }
    out
}

/// Prompt tokens of a rendered conversation on the fake: BOS and the text.
async fn prompt_tokens(app: &App, text: &str) -> u64 {
    let r = app
        .post(
            "/tokenize",
            json!({"content": text, "add_special": false, "parse_special": true}),
        )
        .await;
    1 + r.json()["tokens"].as_array().expect("tokens").len() as u64
}

async fn create(app: &App, body: Value) -> Value {
    let r = app.post("/v1/responses", body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

async fn delete(app: &App, path: &str) -> Reply {
    app.send(
        Request::builder()
            .method(Method::DELETE)
            .uri(path)
            .body(Body::empty())
            .expect("request"),
    )
    .await
}

/// The SDK's `Response` fields, each present, with a cut answer's status.
#[tokio::test]
async fn a_response_has_the_sdk_shape_and_is_stored() {
    let app = App::new();
    let v = create(
        &app,
        json!({"input": "Hello", "max_output_tokens": 8, "metadata": {"k": "v"}}),
    )
    .await;
    assert!(v["id"].as_str().expect("id").starts_with("resp_"), "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], "fake");
    assert!(v["created_at"].as_u64().expect("created_at") > 0);
    // The fake never ends by itself: max_output_tokens cuts it.
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["error"], Value::Null);
    assert_eq!(v["store"], true);
    assert_eq!(v["tool_choice"], "auto");
    assert_eq!(v["tools"], json!([]));
    assert_eq!(v["parallel_tool_calls"], true);
    assert_eq!(v["text"]["format"]["type"], "text");
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["max_output_tokens"], 8);
    assert_eq!(v["previous_response_id"], Value::Null);
    assert!(
        v["temperature"].is_number() && v["top_p"].is_number(),
        "{v}"
    );
    let output = v["output"].as_array().expect("output");
    assert_eq!(output.len(), 1, "{v}");
    let m = &output[0];
    assert_eq!(m["type"], "message");
    assert!(m["id"].as_str().expect("id").starts_with("msg_"), "{m}");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["status"], "incomplete");
    assert_eq!(m["content"][0]["annotations"], json!([]));
    assert!(!output_text(&v).is_empty());
    let u = &v["usage"];
    assert_eq!(u["output_tokens"], 8, "{v}");
    assert_eq!(
        u["input_tokens"].as_u64(),
        Some(prompt_tokens(&app, "<|user|>Hello\n<|assistant|>").await)
    );
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["input_tokens"].as_u64().expect("n") + 8)
    );
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64(), "{u}");
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);

    // Stored: GET gives it back whole; DELETE removes it.
    let path = format!("/v1/responses/{}", v["id"].as_str().expect("id"));
    let got = app.get(&path).await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json(), v);
    let d = delete(&app, &path).await;
    assert_eq!(d.status, 200, "{}", d.text());
    assert_eq!(
        d.json(),
        json!({"id": v["id"], "object": "response", "deleted": true})
    );
    assert_error(&app.get(&path).await, 404, BAD, Some("not_found"), None);
    assert_error(
        &delete(&app, &path).await,
        404,
        BAD,
        Some("not_found"),
        None,
    );

    // `store: false` keeps nothing.
    let v = create(
        &app,
        json!({"input": "Hello", "max_output_tokens": 2, "store": false}),
    )
    .await;
    assert_eq!(v["store"], false);
    let path = format!("/v1/responses/{}", v["id"].as_str().expect("id"));
    assert_error(&app.get(&path).await, 404, BAD, Some("not_found"), None);
}

/// Instructions are a system message first; input items are messages in
/// order, `developer` a system message, text parts joined.
#[tokio::test]
async fn instructions_and_items_render_as_the_conversation() {
    let app = App::new();
    let v = create(
        &app,
        json!({"instructions": "Be brief", "input": "Hello", "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(v["instructions"], "Be brief");
    assert_eq!(
        v["usage"]["input_tokens"].as_u64(),
        Some(prompt_tokens(&app, "<|system|>Be brief\n<|user|>Hello\n<|assistant|>").await)
    );
    let v = create(
        &app,
        json!({"max_output_tokens": 1, "input": [
            {"role": "developer", "content": "Rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "id": "msg_x", "status": "completed",
             "content": [{"type": "output_text", "text": "c", "annotations": []}]},
            {"role": "user", "content": "d"}
        ]}),
    )
    .await;
    assert_eq!(
        v["usage"]["input_tokens"].as_u64(),
        Some(
            prompt_tokens(
                &app,
                "<|system|>Rules\n<|user|>a\nb\n<|assistant|>c\n<|user|>d\n<|assistant|>"
            )
            .await
        )
    );
}

/// A follow-up's prompt is the stored conversation (without the earlier
/// instructions) and its own input; chains go on.
#[tokio::test]
async fn previous_response_id_continues_the_conversation() {
    let app = App::new();
    let first = create(
        &app,
        json!({"instructions": "Sys", "input": "Hello", "max_output_tokens": 4, "temperature": 0}),
    )
    .await;
    let t1 = output_text(&first);
    let second = create(
        &app,
        json!({"previous_response_id": first["id"], "input": "More", "max_output_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(second["previous_response_id"], first["id"]);
    assert_eq!(second["instructions"], Value::Null);
    let convo = format!("<|user|>Hello\n<|assistant|>{t1}\n<|user|>More\n<|assistant|>");
    assert_eq!(
        second["usage"]["input_tokens"].as_u64(),
        Some(prompt_tokens(&app, &convo).await),
        "{second}"
    );
    let t2 = output_text(&second);
    let third = create(
        &app,
        json!({"previous_response_id": second["id"], "input": [{"role": "user", "content": "End"}],
               "instructions": "New", "max_output_tokens": 2}),
    )
    .await;
    let convo = format!("<|system|>New\n<|user|>Hello\n<|assistant|>{t1}\n<|user|>More\n<|assistant|>{t2}\n<|user|>End\n<|assistant|>");
    assert_eq!(
        third["usage"]["input_tokens"].as_u64(),
        Some(prompt_tokens(&app, &convo).await),
        "{third}"
    );

    // Unknown ids are 404 naming the field.
    let r = app
        .post(
            "/v1/responses",
            json!({"previous_response_id": "resp_nope", "input": "x"}),
        )
        .await;
    let m = assert_error(
        &r,
        404,
        BAD,
        Some("previous_response_not_found"),
        Some("previous_response_id"),
    );
    assert!(m.contains("resp_nope"), "{m}");
}

/// Tools are shown to the model (a longer prompt) and echoed in Responses'
/// shapes. (The fake's toy grammar cannot write calls: the function_call
/// items themselves are tested in the route's unit tests and with the real
/// model in sipp-cli's serve_responses.)
#[tokio::test]
async fn tools_are_shown_and_echoed() {
    let app = App::new();
    let plain = create(
        &app,
        json!({"input": "Weather in Paris?", "max_output_tokens": 1}),
    )
    .await;
    let v = create(
        &app,
        json!({"input": "Weather in Paris?", "tools": [weather()], "max_output_tokens": 1,
               "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": false}),
    )
    .await;
    assert_eq!(
        v["tool_choice"],
        json!({"type": "function", "name": "get_weather"})
    );
    assert_eq!(v["tools"], json!([weather()]));
    assert_eq!(v["parallel_tool_calls"], false);
    assert!(
        v["usage"]["input_tokens"].as_u64() > plain["usage"]["input_tokens"].as_u64(),
        "{v}"
    );
    // `none`: the tools are not shown.
    let none = create(
        &app,
        json!({"input": "Weather in Paris?", "tools": [weather()], "max_output_tokens": 1, "tool_choice": "none"}),
    )
    .await;
    assert_eq!(none["tool_choice"], "none");
    assert_eq!(
        none["usage"]["input_tokens"],
        plain["usage"]["input_tokens"]
    );
}

/// Calls made earlier (in the input or in a stored response) are answered
/// by later `function_call_output` items; the prompt grows by the exchange.
#[tokio::test]
async fn call_outputs_answer_calls_made_earlier() {
    let app = App::new();
    let call = json!({"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"});
    // The whole loop as items.
    let r = app
        .post(
            "/v1/responses",
            json!({"tools": [weather()], "max_output_tokens": 2, "input": [
                {"role": "user", "content": "Weather in Paris?"}, call,
                {"type": "function_call_output", "call_id": "call_a", "output": "18 C"}
            ]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // A stored call, answered by a follow-up.
    let first = create(
        &app,
        json!({"tools": [weather()], "max_output_tokens": 2,
               "input": [{"role": "user", "content": "Weather in Paris?"}, call]}),
    )
    .await;
    let next = create(
        &app,
        json!({"previous_response_id": first["id"], "tools": [weather()], "max_output_tokens": 2,
               "input": [{"type": "function_call_output", "call_id": "call_a", "output": "18 C"}]}),
    )
    .await;
    assert!(
        next["usage"]["input_tokens"].as_u64() > first["usage"]["input_tokens"].as_u64(),
        "{next}"
    );
    // A call the stored conversation never made is refused.
    let r = app
        .post(
            "/v1/responses",
            json!({"previous_response_id": first["id"], "tools": [weather()],
                   "input": [{"type": "function_call_output", "call_id": "call_b", "output": "x"}]}),
        )
        .await;
    let m = assert_error(&r, 400, BAD, None, Some("input[0].call_id"));
    assert!(m.contains("call_b"), "{m}");
}

#[tokio::test]
async fn bad_input_is_a_400_naming_the_field() {
    let app = App::new();
    let cases = [
        (
            json!({"input": "x", "tools": [weather()], "tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}),
            "input[0].call_id",
        ),
        (
            json!({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}),
            "input[1].arguments",
        ),
        (
            json!({"input": [{"role": "robot", "content": "a"}]}),
            "input[0].role",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}),
            "tools[0].parameters",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [weather()], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
            "tools",
        ),
        (
            json!({"input": "x", "max_output_tokens": -1}),
            "max_output_tokens",
        ),
        (json!({"input": []}), "input"),
        (json!({"model": "fake"}), "input"),
        (
            json!({"input": [{"type": "image_generation_call"}]}),
            "input",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}),
            "text.format",
        ),
    ];
    for (body, param) in cases {
        let r = app.post("/v1/responses", body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.text());
    }
}

/// One SSE event: its `event:` name and its JSON.
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
    assert!(!body.contains("[DONE]"), "{body}");
    let mut out = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let (mut name, mut data) = (None, None);
        for line in event.lines() {
            if line.starts_with(':') {
                continue;
            } else if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str::<Value>(d).expect("JSON data"));
            } else {
                panic!("unexpected line {line:?}");
            }
        }
        if let (Some(n), Some(d)) = (name, data) {
            assert_eq!(d["type"], n.as_str(), "{d}");
            out.push((n, d));
        }
    }
    for (i, (_, d)) in out.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64, "{d}");
    }
    out
}

/// The typed events of a text answer, in order; the deltas add up to the
/// final text, and the final response is the stored one.
#[tokio::test]
async fn a_stream_tells_the_response_in_typed_events() {
    let app = App::new();
    let r = app
        .post(
            "/v1/responses",
            json!({"input": "Hello", "max_output_tokens": 6, "stream": true}),
        )
        .await;
    let ev = events(&r);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    assert!(deltas >= 1, "{names:?}");
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(names, expected);
    assert_eq!(ev[0].1["response"]["status"], "in_progress");
    assert_eq!(ev[0].1["response"]["output"], json!([]));
    let last = &ev.last().expect("events").1["response"];
    assert_eq!(last["status"], "incomplete");
    assert_eq!(last["usage"]["output_tokens"], 6);
    let item_id = last["output"][0]["id"].clone();
    let mut text = String::new();
    for (n, d) in &ev {
        if n == "response.output_text.delta" {
            assert_eq!(d["item_id"], item_id);
            assert_eq!(
                (d["output_index"].as_u64(), d["content_index"].as_u64()),
                (Some(0), Some(0))
            );
            text.push_str(d["delta"].as_str().expect("delta"));
        }
    }
    assert_eq!(text, output_text(last));
    assert_eq!(ev[names.len() - 4].1["text"], text.as_str());
    assert_eq!(ev[2].1["item"]["content"], json!([]));
    assert_eq!(ev[names.len() - 2].1["item"], last["output"][0]);
    let path = format!("/v1/responses/{}", last["id"].as_str().expect("id"));
    assert_eq!(&app.get(&path).await.json(), last);
}

/// A failure while generating: a 400 when not streamed; mid-stream an
/// `error` event, then `response.failed` with the error, and no `[DONE]`.
#[tokio::test]
async fn a_failure_is_an_error_or_a_failed_response() {
    let app = App::new();
    let body = json!({"input": "Hi", "max_output_tokens": 10, "grammar": sipp::runtime::fake::EXHAUSTING_GRAMMAR});
    let r = app.post("/v1/responses", body.clone()).await;
    assert_error(&r, 400, BAD, Some("grammar_exhausted"), None);
    let mut body = body;
    body["stream"] = json!(true);
    let ev = events(&app.post("/v1/responses", body).await);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(
        names[names.len() - 2..],
        ["error", "response.failed"],
        "{names:?}"
    );
    let (_, err) = &ev[ev.len() - 2];
    assert_eq!(err["code"], "grammar_exhausted", "{err}");
    assert!(err["message"].is_string(), "{err}");
    let failed = &ev[ev.len() - 1].1["response"];
    assert_eq!(failed["status"], "failed");
    assert!(failed["error"]["message"].is_string(), "{failed}");
    // Failed responses are not stored.
    let path = format!("/v1/responses/{}", failed["id"].as_str().expect("id"));
    assert_eq!(app.get(&path).await.status, 404);
}
