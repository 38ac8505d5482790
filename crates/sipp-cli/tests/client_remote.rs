//! SippClient's gateway and OpenAI-compatible endpoints against the real
//! `sipp serve` on loopback.

mod common;

use std::time::Duration;

use common::{eventually, two_model_config, Server};
use serde_json::{json, Value};
use sipp::chat::ChatMessage;
use sipp::client::{
    ChatRequest, ClientError, EmbedRequest, EndpointDescriptor, GatewayAuth, ProviderKind,
    QueryRequest, RequestOptions, Response, RunEvent, SippClient, Timeouts,
};
use sipp::tools::{Tool, ToolCall, ToolChoice};

fn descriptors(s: &Server) -> Vec<(&'static str, EndpointDescriptor)> {
    vec![
        (
            "gateway",
            EndpointDescriptor::Gateway {
                base_url: s.base.clone(),
                target: Some("smol".into()),
                auth: GatewayAuth::Bearer("sk-local".into()),
                headers: vec![("x-request-source".into(), "test".into())],
                timeouts: Timeouts::default(),
            },
        ),
        (
            "compat",
            EndpointDescriptor::Provider {
                kind: ProviderKind::OpenAiCompatible,
                base_url: Some(format!("{}/v1", s.base)),
                api_key: Some("sk-local".into()),
                model: "smol".into(),
                headers: Vec::new(),
                timeouts: Timeouts::default(),
                max_retries: 1,
            },
        ),
    ]
}

/// Sets an engine option as each endpoint carries it: a sipp gateway through
/// the client's options, an OpenAI-compatible provider as llama-server's field.
fn engine_option(o: &mut RequestOptions, id: &str, field: &str, value: bool) {
    match (id, field) {
        ("compat", _) => {
            o.provider.extra.insert(field.into(), value.into());
        }
        (_, "ignore_eos") => o.local.ignore_eos = value,
        (_, "cache_prompt") => o.local.cache_prompt = Some(value),
        _ => panic!("no option {field}"),
    }
}

fn weather() -> Tool {
    Tool::function(
        "get_weather",
        "The current weather in a city",
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }),
    )
}

/// A call of `get_weather` whose arguments satisfy its schema.
fn assert_weather_call(id: &str, c: &ToolCall) {
    assert_eq!(c.function.name, "get_weather", "{id}: {c:?}");
    assert!(!c.id.is_empty(), "{id}: {c:?}");
    let args: Value = serde_json::from_str(&c.function.arguments).expect("arguments are JSON");
    let o = args.as_object().expect("an object");
    assert!(o["city"].is_string(), "{id}: {args}");
    assert!(
        ["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap_or("")),
        "{id}: {args}"
    );
    assert_eq!(o.len(), 2, "{id}: {args}");
}

/// A forced call, plain and streamed, then the call's result answered: on a
/// gateway (sipp's own profile) and an OpenAI-compatible provider alike.
async fn tool_calls_through(client: &SippClient, id: &str) {
    let ask = ChatRequest::new(vec![ChatMessage::user("What is the weather in Paris?")])
        .tools(vec![weather()])
        .tool_choice(ToolChoice::Function("get_weather".into()))
        .parallel_tool_calls(false)
        .max_tokens(96)
        .temperature(0.0);
    let r: Response = client
        .chat(id, ask.clone())
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(r.tool_calls.len(), 1, "{id}: {r:?}");
    assert_weather_call(id, &r.tool_calls[0]);
    assert_eq!(r.finish_reason, "tool_calls", "{id}: {r:?}");

    let mut run = client.chat(id, ask.stream()).await.expect("run");
    let mut calls: Vec<ToolCall> = Vec::new();
    let done = loop {
        match run.next().await.expect("event") {
            RunEvent::ToolCallStart { index, id, name } => {
                assert_eq!(index, calls.len());
                calls.push(ToolCall::new(id, name, ""));
            }
            RunEvent::ToolCallArguments { index, fragment } => {
                calls[index].function.arguments.push_str(&fragment)
            }
            RunEvent::Done(r) => break r,
            RunEvent::Error(e) => panic!("{id}: {e}"),
            RunEvent::Delta(_) | RunEvent::Reasoning(_) => {}
        }
    };
    assert_eq!(calls, done.tool_calls, "{id}");
    assert_eq!(done.tool_calls.len(), 1, "{id}: {done:?}");
    assert_weather_call(id, &done.tool_calls[0]);
    assert_eq!(done.finish_reason, "tool_calls", "{id}");

    let call = r.tool_calls[0].clone();
    let turn = ChatRequest::new(vec![
        ChatMessage::user("What is the weather in Paris?"),
        ChatMessage::tool_calls(None, vec![call.clone()]),
        ChatMessage::tool_result(call.id, r#"{"temperature": 18, "sky": "clear"}"#),
    ])
    .tools(vec![weather()])
    .tool_choice(ToolChoice::None)
    .max_tokens(24)
    .temperature(0.0);
    let answer = client
        .chat(id, turn)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert!(answer.tool_calls.is_empty(), "{id}: {answer:?}");
    assert!(!answer.text.trim().is_empty(), "{id}: {answer:?}");
}

#[test]
fn gateway_and_openai_compatible_endpoints_against_sipp_serve() {
    let tmp = common::temp_dir("client-remote");
    let dir = tmp.path().to_path_buf();
    let cfg = two_model_config(&dir, "api_keys = [\"sk-local\"]");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = SippClient::new();
        for (id, d) in descriptors(&s) {
            client.add(id, d).await.expect("add");
        }
        for id in ["gateway", "compat"] {
            // Query and chat, plain. The greedy first token of this raw
            // prompt is " Paris" on every kernel set.
            let mut q = QueryRequest::new("The capital of France is")
                .max_tokens(8)
                .temperature(0.0);
            // No end-of-generation token, so the count is exact.
            engine_option(&mut q.options, id, "ignore_eos", true);
            let r = client
                .query(id, q)
                .await
                .expect("run")
                .response()
                .await
                .expect("ok");
            assert!(r.text.contains("Paris"), "{id}: {}", r.text);
            let n = r.usage.completion_tokens;
            assert_eq!((n, r.finish_reason.as_str()), (8, "length"), "{id}");
            let mut chat = ChatRequest::new(vec![
                ChatMessage::system("Be brief."),
                ChatMessage::user("Name a fruit."),
            ])
            .max_tokens(12)
            .temperature(0.0);
            // Both runs compute the whole prompt in the same batch shape;
            // a reused KV prefix could tip a near-tie the other way.
            engine_option(&mut chat.options, id, "cache_prompt", false);
            let plain = client
                .chat(id, chat.clone())
                .await
                .expect("run")
                .response()
                .await
                .expect("ok");
            assert!(!plain.text.is_empty());
            // Streamed: the deltas add up to the final answer.
            let mut run = client.chat(id, chat.stream()).await.expect("run");
            let mut text = String::new();
            let done = loop {
                match run.next().await.expect("event") {
                    RunEvent::Delta(d) => text.push_str(&d),
                    RunEvent::Done(r) => break r,
                    RunEvent::Error(e) => panic!("{id}: {e}"),
                    other => panic!("{id}: no tools, no reasoning: {other:?}"),
                }
            };
            assert_eq!(text, done.text, "{id}");
            assert_eq!(done.text, plain.text, "{id}");
            // Errors from the server arrive as remote errors with its message.
            let err = client
                .query(id, QueryRequest::new("word ".repeat(3000)).max_tokens(1))
                .await
                .expect_err("too long");
            assert!(
                matches!(&err, ClientError::Remote { status: 400, .. }),
                "{id}: {err}"
            );
            assert!(err.to_string().contains("context"), "{id}: {err}");
        }
        for id in ["gateway", "compat"] {
            tool_calls_through(&client, id).await;
        }
        // Gateway stats come from the server.
        let r = client
            .query("gateway", QueryRequest::new("Hi").max_tokens(2))
            .await
            .expect("run")
            .response()
            .await
            .expect("ok");
        assert!(r.stats.expect("stats").prompt_tokens > 0);

        // Embeddings through both.
        let gw = SippClient::new();
        let mut d = descriptors(&s).remove(0).1;
        if let EndpointDescriptor::Gateway { target, .. } = &mut d {
            *target = Some("minilm".into());
        }
        gw.add("emb", d).await.expect("add");
        let e = gw
            .embed("emb", EmbedRequest::new(["a cat", "a dog"]))
            .await
            .expect("embed");
        assert_eq!((e.data.len(), e.data[0].values.len()), (2, 384));
        let mut d = descriptors(&s).remove(1).1;
        if let EndpointDescriptor::Provider { model, .. } = &mut d {
            *model = "minilm".into();
        }
        gw.add("emb2", d).await.expect("add");
        let e2 = gw
            .embed("emb2", EmbedRequest::new(["a cat", "a dog"]))
            .await
            .expect("embed");
        assert_eq!(e2.data[1].values.len(), 384);

        // Cancel: the client stops, and the server frees the slot.
        for id in ["gateway", "compat"] {
            let mut q = QueryRequest::new("1, 2, 3, 4, 5, 6,")
                .temperature(0.0)
                .max_tokens(100_000)
                .stream();
            // No end-of-generation token: only the cancel can end it.
            engine_option(&mut q.options, id, "ignore_eos", true);
            let mut run = client.query(id, q).await.expect("run");
            let mut n = 0;
            let done = loop {
                match run.next().await.expect("event") {
                    RunEvent::Delta(_) => {
                        n += 1;
                        if n == 3 {
                            run.cancel();
                        }
                    }
                    RunEvent::Done(r) => break r,
                    RunEvent::Error(e) => panic!("{id}: {e}"),
                    other => panic!("{id}: no tools, no reasoning: {other:?}"),
                }
            };
            assert_eq!(done.finish_reason, "cancelled", "{id}");
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || s.metric_with_key(
            "sipp_busy_slots{model=\"smol\"}",
            Some("sk-local")
        ) == Some(0.0)),
        "slots not freed after client cancels: {}",
        s.log()
    );
    assert_eq!(
        s.metric_with_key(
            "sipp_requests_finished_total{model=\"smol\",outcome=\"cancelled\"}",
            Some("sk-local")
        ),
        Some(2.0)
    );
    // A wrong key is a remote 401.
    rt.block_on(async {
        let client = SippClient::new();
        client
            .add("bad", EndpointDescriptor::gateway(s.base.clone()))
            .await
            .expect("add");
        let err = client
            .query("bad", QueryRequest::new("x"))
            .await
            .expect_err("401");
        assert!(
            matches!(err, ClientError::Remote { status: 401, .. }),
            "{err}"
        );
    });
}
