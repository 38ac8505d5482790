//! `sipp serve` fronting a remote provider with server-side credentials: a
//! second sipp server stands in for the provider.

mod common;

use common::Server;
use reqwest::blocking::Client;
use serde_json::{json, Value};

#[test]
fn a_target_can_be_a_remote_provider() {
    let upstream = Server::start_with_env(&[], &[("SIPP_API_KEY", "inner-key")]);
    let tmp = common::temp_dir("gateway");
    let dir = tmp.path();
    let cfg = dir.join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[[models]]
id = "upstream"
[models.provider]
kind = "openai_compatible"
base_url = "{}/v1"
api_key_env = "UPSTREAM_KEY"
model = "default"
"#,
            upstream.base
        ),
    )
    .expect("write");
    let gw = Server::start_with_env(
        &["--config", cfg.to_str().expect("utf8")],
        &[("UPSTREAM_KEY", "inner-key")],
    );
    let c = Client::new();
    // The client needs no upstream key: the gateway holds it.
    let v: Value = c
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"model": "upstream", "messages": [{"role": "user", "content": "The capital of France is"}], "max_tokens": 8, "temperature": 0}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .expect("text")
        .is_empty());
    // The gateway refuses ignore_eos for a remote target, so the model may end
    // early; "length" means all 8 tokens were made.
    let n = v["usage"]["completion_tokens"].as_u64().expect("usage");
    assert!(n <= 8, "{v}");
    if v["choices"][0]["finish_reason"] == "length" {
        assert_eq!(n, 8, "{v}");
    }
    // Streaming passes through. The greedy first token of this raw prompt is
    // " Paris" on every kernel set.
    let body = c
        .post(gw.url("/v1/completions"))
        .json(&json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": true}))
        .send()
        .expect("send")
        .text()
        .expect("text");
    let text: String = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert!(text.contains("Paris"), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"));
    // First-party profile through the gateway.
    let v: Value = c
        .post(gw.url("/v1/query"))
        .json(&json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert!(v["text"].as_str().expect("text").contains("Paris"), "{v}");
    // Tools, the choice and parallel calls are forwarded to the provider
    // (another sipp server here, which constrains the call to the schema),
    // and its calls come back in OpenAI's shape.
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}
    }}]);
    let ask = json!({
        "model": "upstream",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": false,
        "max_tokens": 64, "temperature": 0,
    });
    let v: Value = c
        .post(gw.url("/v1/chat/completions"))
        .json(&ask)
        .send()
        .expect("send")
        .json()
        .expect("json");
    let m = &v["choices"][0]["message"];
    let calls = m["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["type"], "function", "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{v}");
    assert!(
        calls[0]["id"].as_str().is_some_and(|s| !s.is_empty()),
        "{v}"
    );
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("text"))
            .expect("JSON arguments");
    assert!(args["city"].is_string(), "{v}");
    assert!(m["content"].is_null(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    // Streamed: the call's start (index, id, type, name), then its arguments.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let body = c
        .post(gw.url("/v1/chat/completions"))
        .json(&streamed)
        .send()
        .expect("send")
        .text()
        .expect("text");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk"))
        .collect();
    let pieces: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(pieces[0]["index"], 0, "{body}");
    assert_eq!(pieces[0]["function"]["name"], "get_weather", "{body}");
    assert!(pieces[0]["id"].is_string(), "{body}");
    let streamed_args: String = pieces
        .iter()
        .filter_map(|p| p["function"]["arguments"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&streamed_args).expect("JSON arguments"),
        args,
        "{body}"
    );
    let reasons: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(reasons, [&json!("tool_calls")], "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"));
    // sipp's own profile forwards them too.
    let v: Value = c
        .post(gw.url("/v1/chat"))
        .json(&json!({
            "model": "upstream",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": false,
            "max_tokens": 64, "temperature": 0,
        }))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["tool_calls"][0]["function"]["name"], "get_weather", "{v}");
    assert_eq!(v["finish_reason"], "tool_calls", "{v}");
    // Local-only options are refused with the field named.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= \"a\""}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    let v: Value = r.json().expect("json");
    assert_eq!(v["error"]["param"], "grammar", "{v}");
    // Upstream errors keep their status and message.
    let r = c
        .post(gw.url("/v1/completions"))
        .json(&json!({"prompt": "word ".repeat(10000), "max_tokens": 1}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    assert!(r.text().expect("text").contains("context"));
}

/// A provider (a second sipp server) behind `sipp serve` as target
/// `upstream`: (provider, gateway).
fn gateway(tag: &str) -> (Server, Server) {
    let upstream = Server::start_with_env(&[], &[("SIPP_API_KEY", "inner-key")]);
    let dir = common::temp_dir(&format!("gateway-{tag}"));
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[[models]]
id = "upstream"
[models.provider]
kind = "openai_compatible"
base_url = "{}/v1"
api_key_env = "UPSTREAM_KEY"
model = "default"
"#,
            upstream.base
        ),
    )
    .expect("write");
    let gw = Server::start_with_env(
        &["--config", cfg.to_str().expect("utf8")],
        &[("UPSTREAM_KEY", "inner-key")],
    )
    .keeping(dir);
    (upstream, gw)
}

/// The data of each server-sent event, as JSON.
fn sse_data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event JSON"))
        .collect()
}

/// Arguments valid for the get_weather schema: an object with exactly a
/// string `city`.
fn weather_args(args: &Value) -> bool {
    args.as_object()
        .is_some_and(|o| o.len() == 1 && o.get("city").is_some_and(Value::is_string))
}

const WEATHER_SCHEMA: &str = r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}"#;

#[test]
fn responses_serve_a_remote_provider_with_tools() {
    let (_upstream, gw) = gateway("responses");
    let c = Client::new();
    let schema: Value = serde_json::from_str(WEATHER_SCHEMA).expect("schema");
    // A plain text answer.
    let v: Value = c
        .post(gw.url("/v1/responses"))
        .json(&json!({"model": "upstream", "input": "The capital of France is", "max_output_tokens": 8, "temperature": 0}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["object"], "response", "{v}");
    assert!(
        v["status"] == "completed" || v["status"] == "incomplete",
        "{v}"
    );
    let item = &v["output"][0];
    assert_eq!(item["type"], "message", "{v}");
    assert!(
        !item["content"][0]["text"]
            .as_str()
            .expect("text")
            .is_empty(),
        "{v}"
    );
    assert!(
        v["usage"]["output_tokens"].as_u64().expect("usage") <= 8,
        "{v}"
    );
    // A forced call comes back as a function_call item.
    let ask = json!({
        "model": "upstream",
        "input": "What is the weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "description": "The current weather in a city", "parameters": schema}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": false,
        "max_output_tokens": 64, "temperature": 0,
    });
    let v: Value = c
        .post(gw.url("/v1/responses"))
        .json(&ask)
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["status"], "completed", "{v}");
    let calls: Vec<&Value> = v["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter(|o| o["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["name"], "get_weather", "{v}");
    assert_eq!(calls[0]["status"], "completed", "{v}");
    assert!(
        calls[0]["call_id"].as_str().is_some_and(|s| !s.is_empty()),
        "{v}"
    );
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().expect("text"))
        .expect("JSON arguments");
    assert!(weather_args(&args), "{v}");
    // The same streamed: the item added, its arguments in deltas, done, then
    // the response completed.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let body = c
        .post(gw.url("/v1/responses"))
        .json(&streamed)
        .send()
        .expect("send")
        .text()
        .expect("text");
    let events = sse_data(&body);
    assert_eq!(events[0]["type"], "response.created", "{body}");
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.completed", "{body}");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    let args: Value = serde_json::from_str(&deltas).expect("JSON arguments");
    assert!(weather_args(&args), "{body}");
    let done: Vec<&Value> = events
        .iter()
        .filter(|e| {
            e["type"] == "response.output_item.done" && e["item"]["type"] == "function_call"
        })
        .collect();
    assert_eq!(done.len(), 1, "{body}");
    assert_eq!(done[0]["item"]["arguments"], json!(deltas), "{body}");
    let final_calls: Vec<&Value> = last["response"]["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter(|o| o["type"] == "function_call")
        .collect();
    assert_eq!(final_calls.len(), 1, "{body}");
    assert_eq!(final_calls[0]["name"], "get_weather", "{body}");
    // A streamed plain answer: text deltas add up to the message.
    let body = c
        .post(gw.url("/v1/responses"))
        .json(&json!({"model": "upstream", "input": "The capital of France is", "max_output_tokens": 8, "temperature": 0, "stream": true}))
        .send()
        .expect("send")
        .text()
        .expect("text");
    let events = sse_data(&body);
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert!(!text.is_empty(), "{body}");
    let last = events.last().expect("events");
    assert_eq!(
        last["response"]["output"][0]["content"][0]["text"],
        json!(text),
        "{body}"
    );
    // Local-only fields are refused with the field named.
    for (field, extra) in [
        (
            "text.format",
            json!({"text": {"format": {"type": "json_object"}}}),
        ),
        ("grammar", json!({"grammar": "root ::= \"a\""})),
    ] {
        let mut req = json!({"model": "upstream", "input": "x"});
        for (k, v) in extra.as_object().expect("object") {
            req[k] = v.clone();
        }
        let r = c
            .post(gw.url("/v1/responses"))
            .json(&req)
            .send()
            .expect("send");
        assert_eq!(r.status(), 400, "{field}");
        let v: Value = r.json().expect("json");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
}

#[test]
fn messages_serve_a_remote_provider_with_tools() {
    let (_upstream, gw) = gateway("messages");
    let c = Client::new();
    let schema: Value = serde_json::from_str(WEATHER_SCHEMA).expect("schema");
    // A plain text answer.
    let v: Value = c
        .post(gw.url("/v1/messages"))
        .json(&json!({"model": "upstream", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "The capital of France is"}]}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    assert!(
        !v["content"][0]["text"].as_str().expect("text").is_empty(),
        "{v}"
    );
    assert!(
        v["stop_reason"] == "end_turn" || v["stop_reason"] == "max_tokens",
        "{v}"
    );
    assert!(
        v["usage"]["output_tokens"].as_u64().expect("usage") <= 8,
        "{v}"
    );
    // A forced call comes back as a tool_use block.
    let ask = json!({
        "model": "upstream",
        "max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"name": "get_weather", "description": "The current weather in a city", "input_schema": schema}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
    });
    let v: Value = c
        .post(gw.url("/v1/messages"))
        .json(&ask)
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses: Vec<&Value> = v["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert_eq!(uses.len(), 1, "{v}");
    assert_eq!(uses[0]["name"], "get_weather", "{v}");
    assert!(uses[0]["id"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    assert!(weather_args(&uses[0]["input"]), "{v}");
    // The same streamed: the block starts, its input streams as JSON pieces.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let body = c
        .post(gw.url("/v1/messages"))
        .json(&streamed)
        .send()
        .expect("send")
        .text()
        .expect("text");
    let events = sse_data(&body);
    assert_eq!(events[0]["type"], "message_start", "{body}");
    assert_eq!(
        events.last().expect("events")["type"],
        "message_stop",
        "{body}"
    );
    let start = events
        .iter()
        .find(|e| e["type"] == "content_block_start" && e["content_block"]["type"] == "tool_use")
        .expect("a tool_use block");
    assert_eq!(start["content_block"]["name"], "get_weather", "{body}");
    let index = &start["index"];
    let json_text: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta" && &e["index"] == index)
        .filter_map(|e| e["delta"]["partial_json"].as_str())
        .collect();
    let input: Value = serde_json::from_str(&json_text).expect("JSON input");
    assert!(weather_args(&input), "{body}");
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .expect("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "tool_use", "{body}");
    // A streamed plain answer: text deltas.
    let body = c
        .post(gw.url("/v1/messages"))
        .json(&json!({"model": "upstream", "max_tokens": 8, "temperature": 0, "stream": true, "messages": [{"role": "user", "content": "The capital of France is"}]}))
        .send()
        .expect("send")
        .text()
        .expect("text");
    let events = sse_data(&body);
    let text: String = events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    assert!(!text.is_empty(), "{body}");
    assert_eq!(
        events.last().expect("events")["type"],
        "message_stop",
        "{body}"
    );
    // Local-only fields are refused by name; count_tokens needs a tokenizer.
    let r = c
        .post(gw.url("/v1/messages"))
        .json(&json!({"model": "upstream", "max_tokens": 8, "top_k": 5, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    assert!(r.text().expect("text").contains("top_k"));
    let r = c
        .post(gw.url("/v1/messages/count_tokens"))
        .json(&json!({"model": "upstream", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    assert!(r.text().expect("text").contains("upstream"));
}
