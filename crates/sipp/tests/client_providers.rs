//! The OpenAI and Anthropic adapters against local HTTP fakes (wiremock) that
//! replay the request and response shapes their APIs document; the services
//! themselves are unreachable from these machines. Also every validation rule.

use serde_json::{json, Value};
use sipp::chat::ChatMessage;
use sipp::client::{
    ChatRequest, ClientError, EmbedRequest, EndpointDescriptor, ProviderKind, QueryRequest,
    Response, Run, RunEvent, SippClient, Timeouts,
};
use sipp::tools::{Tool, ToolCall, ToolChoice};
use wiremock::matchers::{body_partial_json, header, method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

fn provider(kind: ProviderKind, base: &str, key: Option<&str>) -> EndpointDescriptor {
    EndpointDescriptor::Provider {
        kind,
        base_url: Some(base.to_string()),
        api_key: key.map(str::to_string),
        model: "test-model".into(),
        headers: vec![("x-team".into(), "sipp".into())],
        timeouts: Timeouts::default(),
        max_retries: 2,
    }
}

fn sse_body(events: &[(&str, Value)]) -> String {
    let mut s = String::new();
    for (name, v) in events {
        if !name.is_empty() {
            s.push_str(&format!("event: {name}\n"));
        }
        s.push_str(&format!("data: {v}\n\n"));
    }
    s
}

fn weather() -> Tool {
    Tool::function(
        "get_weather",
        "The weather in a city",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    )
}

/// The streamed events of a run (everything but its end) and its answer.
async fn drain(mut run: Run) -> (Vec<RunEvent>, Response) {
    let mut events = Vec::new();
    loop {
        match run.next().await.expect("event") {
            RunEvent::Done(r) => return (events, r),
            RunEvent::Error(e) => panic!("{e}"),
            other => events.push(other),
        }
    }
}

/// The answer's calls, rebuilt from streamed events.
fn calls_of(events: &[RunEvent]) -> Vec<ToolCall> {
    let mut calls: Vec<ToolCall> = Vec::new();
    for e in events {
        match e {
            RunEvent::ToolCallStart { index, id, name } => {
                assert_eq!(*index, calls.len(), "calls start in order");
                calls.push(ToolCall::new(id.clone(), name.clone(), ""));
            }
            RunEvent::ToolCallArguments { index, fragment } => {
                calls[*index].function.arguments.push_str(fragment)
            }
            _ => {}
        }
    }
    calls
}

fn messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::system("Answer in English."),
        ChatMessage::user("Hi"),
    ]
}

#[tokio::test]
async fn openai_chat_completions_embeddings_and_streaming() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .and(header("authorization", "Bearer sk-test"))
        .and(header("x-team", "sipp"))
        .and(body_partial_json(json!({"model": "test-model", "max_completion_tokens": 5, "stream": false, "user": "u-1"})))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 4}}
        })))
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1/completions"))
        .and(body_partial_json(json!({"prompt": "Once", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}})))
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("content-type", "text/event-stream")
                .set_body_string(
                    sse_body(&[
                        ("", json!({"choices": [{"index": 0, "text": " upon", "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "text": " a", "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "text": " time", "finish_reason": "length"}]})),
                        ("", json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})),
                    ]) + "data: [DONE]\n\n",
                ),
        )
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1/embeddings"))
        .and(body_partial_json(json!({"input": ["a", "b"], "encoding_format": "float"})))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "object": "list", "model": "test-model", "usage": {"prompt_tokens": 2, "total_tokens": 2},
            "data": [{"object": "embedding", "index": 1, "embedding": [0.0, 1.0]}, {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}]
        })))
        .mount(&server)
        .await;

    let client = SippClient::new();
    let ep = client
        .add(
            "oa",
            provider(
                ProviderKind::OpenAi,
                &format!("{}/v1", server.uri()),
                Some("sk-test"),
            ),
        )
        .await
        .expect("add");
    let mut req = ChatRequest::new(messages()).max_tokens(5);
    req.options.provider.user = Some("u-1".into());
    let r = ep
        .chat(req)
        .await
        .expect("run")
        .response()
        .await
        .expect("response");
    assert_eq!(r.text, "Hello!");
    assert_eq!(r.finish_reason, "stop");
    assert_eq!(
        (
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            r.usage.cached_tokens
        ),
        (9, 2, 4)
    );
    // The OpenAI wire body carries the messages as given.
    let sent: Value = server.received_requests().await.expect("recorded")[0]
        .body_json()
        .expect("json");
    assert_eq!(
        sent["messages"][2],
        json!({"role": "user", "content": "Hi"})
    );

    let mut run = ep
        .query(QueryRequest::new("Once").max_tokens(3).stream())
        .await
        .expect("run");
    let mut deltas = Vec::new();
    let done = loop {
        match run.next().await.expect("event") {
            RunEvent::Delta(d) => deltas.push(d),
            RunEvent::Done(r) => break r,
            RunEvent::Error(e) => panic!("{e}"),
            other => panic!("no tools, no reasoning: {other:?}"),
        }
    };
    assert_eq!(deltas, vec![" upon", " a", " time"]);
    assert_eq!(done.text, " upon a time");
    assert_eq!(done.finish_reason, "length");
    assert_eq!(done.usage.completion_tokens, 3);

    let e = ep
        .embed(EmbedRequest::new(["a", "b"]))
        .await
        .expect("embed");
    assert_eq!(e.data[0].values, vec![1.0, 0.0], "sorted by index");
    assert_eq!(e.prompt_tokens, 2);
}

#[tokio::test]
async fn openai_retries_only_what_is_safe() {
    let server = MockServer::start().await;
    // Two 429s, then success: retried.
    Mock::given(method("POST"))
        .and(path("/chat/completions"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "0")
                .set_body_json(
                    json!({"error": {"message": "slow down", "type": "rate_limit_error"}}),
                ),
        )
        .up_to_n_times(2)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/chat/completions"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], "usage": {}
        })))
        .mount(&server)
        .await;
    let client = SippClient::new();
    let ep = client
        .add(
            "c",
            provider(ProviderKind::OpenAiCompatible, &server.uri(), None),
        )
        .await
        .expect("add");
    let r = ep
        .chat(ChatRequest::new(messages()))
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(r.text, "ok");
    assert_eq!(server.received_requests().await.expect("recorded").len(), 3);

    // A 500 is not retried (the request may have run) and surfaces its message.
    let bad = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(500)
                .set_body_json(json!({"error": {"message": "boom", "type": "server_error"}})),
        )
        .mount(&bad)
        .await;
    let ep = client
        .add(
            "bad",
            provider(ProviderKind::OpenAiCompatible, &bad.uri(), None),
        )
        .await
        .expect("add");
    let err = ep
        .chat(ChatRequest::new(messages()))
        .await
        .expect_err("fails");
    assert_eq!(
        err,
        ClientError::Remote {
            endpoint: "bad".into(),
            status: 500,
            message: "boom".into()
        }
    );
    assert_eq!(bad.received_requests().await.expect("recorded").len(), 1);
}

#[tokio::test]
async fn anthropic_messages_streaming_and_unsupported_operations() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/messages"))
        .and(header("x-api-key", "ak-test"))
        .and(header("anthropic-version", "2023-06-01"))
        .and(body_partial_json(json!({"stream": false, "system": "Be brief.\n\nAnswer in English.", "max_tokens": 1024})))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "test-model",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}],
            "stop_reason": "max_tokens", "stop_sequence": null,
            "usage": {"input_tokens": 12, "output_tokens": 3, "cache_read_input_tokens": 5}
        })))
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1/messages"))
        .and(body_partial_json(json!({"stream": true, "stop_sequences": ["END"]})))
        .respond_with(
            ResponseTemplate::new(200).insert_header("content-type", "text/event-stream").set_body_string(sse_body(&[
                ("message_start", json!({"type": "message_start", "message": {"id": "msg_2", "usage": {"input_tokens": 7, "output_tokens": 1}}})),
                ("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
                ("ping", json!({"type": "ping"})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                ("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 2}})),
                ("message_stop", json!({"type": "message_stop"})),
            ])),
        )
        .mount(&server)
        .await;
    let client = SippClient::new();
    let ep = client
        .add(
            "an",
            provider(ProviderKind::Anthropic, &server.uri(), Some("ak-test")),
        )
        .await
        .expect("add");
    let r = ep
        .chat(ChatRequest::new(messages()))
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(r.text, "Hello there");
    assert_eq!(r.finish_reason, "length");
    assert_eq!(
        (
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            r.usage.cached_tokens
        ),
        (12, 3, 5)
    );
    let sent: Value = server.received_requests().await.expect("recorded")[0]
        .body_json()
        .expect("json");
    assert_eq!(
        sent["messages"],
        json!([{"role": "user", "content": "Hi"}]),
        "system messages moved into `system`"
    );

    let mut run = ep
        .chat(ChatRequest::new(messages()).stop("END").stream())
        .await
        .expect("run");
    let mut text = String::new();
    let done = loop {
        match run.next().await.expect("event") {
            RunEvent::Delta(d) => text.push_str(&d),
            RunEvent::Done(r) => break r,
            RunEvent::Error(e) => panic!("{e}"),
            other => panic!("no tools, no reasoning: {other:?}"),
        }
    };
    assert_eq!(
        (
            text.as_str(),
            done.text.as_str(),
            done.finish_reason.as_str()
        ),
        ("Hi!", "Hi!", "stop")
    );
    assert_eq!(
        (done.usage.prompt_tokens, done.usage.completion_tokens),
        (7, 2)
    );

    let err = ep
        .embed(EmbedRequest::new(["x"]))
        .await
        .expect_err("no embeddings");
    assert!(
        matches!(
            err,
            ClientError::Unsupported {
                operation: "embed",
                ..
            }
        ),
        "{err}"
    );
    let err = ep
        .query(QueryRequest::new("x"))
        .await
        .expect_err("no completions");
    assert!(
        matches!(
            err,
            ClientError::Unsupported {
                operation: "query",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn anthropic_stream_error_event_surfaces() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).insert_header("content-type", "text/event-stream").set_body_string(sse_body(&[
            ("message_start", json!({"type": "message_start", "message": {"usage": {"input_tokens": 1}}})),
            ("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})),
        ])))
        .mount(&server)
        .await;
    let client = SippClient::new();
    let ep = client
        .add(
            "an",
            provider(ProviderKind::Anthropic, &server.uri(), Some("k")),
        )
        .await
        .expect("add");
    let err = ep
        .chat(ChatRequest::new(messages()).stream())
        .await
        .expect("run")
        .response()
        .await
        .expect_err("error");
    assert!(err.to_string().contains("Overloaded"), "{err}");
}

#[tokio::test]
async fn validation_happens_before_anything_is_sent() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(|_: &Request| ResponseTemplate::new(200))
        .mount(&server)
        .await;
    let client = SippClient::new();
    client
        .add("gw", EndpointDescriptor::gateway(server.uri()))
        .await
        .expect("add");
    client
        .add(
            "pv",
            provider(ProviderKind::OpenAiCompatible, &server.uri(), None),
        )
        .await
        .expect("add");

    let local_only = |f: fn(&mut ChatRequest)| {
        let mut r = ChatRequest::new(messages());
        f(&mut r);
        r
    };
    let cases: Vec<(&str, ChatRequest, &str)> = vec![
        (
            "pv",
            local_only(|r| r.options.local.context_key = Some("k".into())),
            "context_key",
        ),
        (
            "pv",
            local_only(|r| r.options.local.grammar = Some("root ::= \"a\"".into())),
            "grammar",
        ),
        // A gateway carries every engine option but log-probabilities.
        (
            "gw",
            local_only(|r| r.options.local.logprobs = Some(2)),
            "logprobs",
        ),
        (
            "pv",
            local_only(|r| r.options.local.json_schema = Some(json!({"type": "object"}))),
            "json_schema",
        ),
        (
            "pv",
            local_only(|r| r.options.local.sampling = Some(Default::default())),
            "sampling",
        ),
        (
            "pv",
            local_only(|r| {
                r.options.local.lora = Some(vec![sipp::engine::LoraScale { id: 0, scale: 1.0 }])
            }),
            "lora",
        ),
        (
            "gw",
            local_only(|r| r.options.provider.user = Some("u".into())),
            "provider options",
        ),
        // Calls are constrained by their own grammar on a sipp engine.
        (
            "gw",
            local_only(|r| {
                r.tools = vec![weather()];
                r.options.local.json_mode = true;
            }),
            "tools",
        ),
    ];
    for (ep, req, needle) in cases {
        let err = client.chat(ep, req).await.expect_err("rejected");
        assert!(
            matches!(err, ClientError::Invalid { .. }) && err.to_string().contains(needle),
            "{ep}: {err}"
        );
    }
    let mut e = EmbedRequest::new(["x"]);
    e.normalize = Some(false);
    assert!(client
        .embed("pv", e.clone())
        .await
        .expect_err("local-only")
        .to_string()
        .contains("normalize"));
    assert!(client
        .embed("gw", e)
        .await
        .expect_err("local-only")
        .to_string()
        .contains("normalize"));
    let mut e = EmbedRequest::new(["x"]);
    e.provider.user = Some("u".into());
    assert!(client
        .embed("gw", e)
        .await
        .expect_err("provider option")
        .to_string()
        .contains("provider"));
    assert!(matches!(
        client.chat("nope", ChatRequest::new(messages())).await,
        Err(ClientError::UnknownEndpoint(_))
    ));
    assert!(client
        .chat("gw", ChatRequest::new(vec![]))
        .await
        .expect_err("empty")
        .to_string()
        .contains("messages"));
    assert!(client
        .embed("gw", EmbedRequest::new(Vec::<String>::new()))
        .await
        .is_err());
    // Nothing reached the server.
    assert_eq!(server.received_requests().await.expect("recorded").len(), 0);

    // Descriptor checks.
    let err = client
        .add(
            "x",
            EndpointDescriptor::provider(ProviderKind::OpenAiCompatible, "m"),
        )
        .await
        .expect_err("needs base_url");
    assert!(err.to_string().contains("base_url"), "{err}");
    let err = client
        .add(
            "y",
            EndpointDescriptor::provider(ProviderKind::Anthropic, "m"),
        )
        .await
        .expect_err("needs key");
    assert!(err.to_string().contains("api_key"), "{err}");

    // Re-adding an id replaces it; closing removes it.
    client
        .add("pv", EndpointDescriptor::gateway(server.uri()))
        .await
        .expect("replace");
    assert!(client
        .chat(
            "pv",
            local_only(|r| r.options.provider.user = Some("u".into()))
        )
        .await
        .expect_err("now a gateway")
        .to_string()
        .contains("gateway"));
    client.close("pv").expect("close");
    assert_eq!(client.endpoint_ids(), vec!["gw".to_string()]);
}

/// A conversation that called tools and has their results: an assistant
/// message with two calls, and a result for each.
fn history() -> Vec<ChatMessage> {
    let mut answered = ChatMessage::tool_calls(
        Some("Checking.".into()),
        vec![
            ToolCall::new("call_a", "get_weather", r#"{"city":"Paris"}"#),
            ToolCall::new("call_b", "get_weather", r#"{"city":"Rome"}"#),
        ],
    );
    answered.reasoning_content = Some("Two cities.".into());
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Weather in Paris and Rome?"),
        answered,
        ChatMessage::tool_result("call_a", "18C"),
        ChatMessage::tool_result("call_b", "21C"),
    ]
}

#[tokio::test]
async fn openai_tools_are_sent_and_calls_come_back() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .and(body_partial_json(json!({
            "stream": false,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false,
        })))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "test-model",
            "choices": [{"index": 0, "message": {
                "role": "assistant", "content": null, "reasoning_content": "Paris it is.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]
            }, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}
        })))
        .mount(&server)
        .await;
    // Streamed, from an OpenAI-compatible server that names the reason
    // `stop` (some do): calls by index, the id and name first, the
    // arguments in pieces; two calls.
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .and(body_partial_json(json!({"stream": true})))
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("content-type", "text/event-stream")
                .set_body_string(
                    sse_body(&[
                        ("", json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": null}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {"reasoning_content": "Both."}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_p", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_r", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]}, "finish_reason": null}]})),
                        ("", json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
                        ("", json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}})),
                    ]) + "data: [DONE]\n\n",
                ),
        )
        .mount(&server)
        .await;
    let client = SippClient::new();
    let ep = client
        .add(
            "oa",
            provider(
                ProviderKind::OpenAi,
                &format!("{}/v1", server.uri()),
                Some("sk-test"),
            ),
        )
        .await
        .expect("add");

    let req = ChatRequest::new(vec![ChatMessage::user("Weather in Paris?")])
        .tools(vec![weather()])
        .tool_choice(ToolChoice::Function("get_weather".into()))
        .parallel_tool_calls(false);
    let r = ep
        .chat(req)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(
        r.tool_calls,
        vec![ToolCall::new(
            "call_1",
            "get_weather",
            r#"{"city":"Paris"}"#
        )]
    );
    assert_eq!(
        (
            r.text.as_str(),
            r.finish_reason.as_str(),
            r.reasoning.as_deref()
        ),
        ("", "tool_calls", Some("Paris it is."))
    );
    let sent: Value = server.received_requests().await.expect("recorded")[0]
        .body_json()
        .expect("json");
    assert_eq!(sent["tools"], json!([weather()]), "tools in OpenAI's shape");

    // Streamed, with the results of earlier calls in the history.
    let req = ChatRequest::new(history()).tools(vec![weather()]).stream();
    let (events, done) = drain(ep.chat(req).await.expect("run")).await;
    assert_eq!(events[0], RunEvent::Reasoning("Both.".into()));
    assert_eq!(
        events[1],
        RunEvent::ToolCallStart {
            index: 0,
            id: "call_p".into(),
            name: "get_weather".into()
        }
    );
    let calls = vec![
        ToolCall::new("call_p", "get_weather", r#"{"city":"Paris"}"#),
        ToolCall::new("call_r", "get_weather", r#"{"city":"Rome"}"#),
    ];
    assert_eq!(calls_of(&events), calls);
    assert_eq!(done.tool_calls, calls);
    assert_eq!(done.finish_reason, "tool_calls", "an answer that called");
    assert_eq!(done.reasoning.as_deref(), Some("Both."));
    assert_eq!(done.usage.completion_tokens, 30);
    let sent: Value = server.received_requests().await.expect("recorded")[1]
        .body_json()
        .expect("json");
    assert!(
        sent.get("tool_choice").is_none() && sent.get("parallel_tool_calls").is_none(),
        "unset fields are the provider's defaults: {sent}"
    );
    assert_eq!(
        sent["messages"][2],
        json!({"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
        ]}),
        "calls as OpenAI's history carries them, without the reasoning"
    );
    assert_eq!(
        sent["messages"][4],
        json!({"role": "tool", "content": "21C", "tool_call_id": "call_b"})
    );
}

#[tokio::test]
async fn anthropic_tools_history_calls_and_thinking() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/messages"))
        .and(body_partial_json(json!({"stream": false})))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "test-model",
            "content": [
                {"type": "thinking", "thinking": "Need the weather.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 30, "output_tokens": 12}
        })))
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1/messages"))
        .and(body_partial_json(json!({"stream": true})))
        .respond_with(
            ResponseTemplate::new(200).insert_header("content-type", "text/event-stream").set_body_string(sse_body(&[
                ("message_start", json!({"type": "message_start", "message": {"id": "msg_2", "usage": {"input_tokens": 30, "output_tokens": 1}}})),
                ("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Think."}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                ("content_block_start", json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Checking"}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 1})),
                ("content_block_start", json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": \"Pa"}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "ris\"}"}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 2})),
                // A tool without arguments: no input_json_delta at all.
                ("content_block_start", json!({"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use", "id": "toolu_3", "name": "get_time", "input": {}}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 3})),
                ("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 40}})),
                ("message_stop", json!({"type": "message_stop"})),
            ])),
        )
        .mount(&server)
        .await;
    let client = SippClient::new();
    let ep = client
        .add(
            "an",
            provider(ProviderKind::Anthropic, &server.uri(), Some("ak-test")),
        )
        .await
        .expect("add");
    let time = Tool::function(
        "get_time",
        "The time",
        json!({"type": "object", "properties": {}}),
    );

    // The history's calls and results, in Anthropic's blocks.
    let req = ChatRequest::new(history())
        .tools(vec![weather(), time.clone()])
        .tool_choice(ToolChoice::Function("get_weather".into()))
        .parallel_tool_calls(false);
    let r = ep
        .chat(req)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(
        r.tool_calls,
        vec![ToolCall::new(
            "toolu_1",
            "get_weather",
            r#"{"city":"Paris"}"#
        )]
    );
    assert_eq!(
        (
            r.text.as_str(),
            r.finish_reason.as_str(),
            r.reasoning.as_deref()
        ),
        ("Let me check.", "tool_calls", Some("Need the weather."))
    );
    let sent: Value = server.received_requests().await.expect("recorded")[0]
        .body_json()
        .expect("json");
    assert_eq!(
        sent["tools"][0],
        json!({"name": "get_weather", "description": "The weather in a city", "input_schema": weather().function.parameters})
    );
    assert_eq!(
        sent["tool_choice"],
        json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true})
    );
    assert_eq!(sent["system"], "Be brief.");
    assert_eq!(
        sent["messages"],
        json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_b", "name": "get_weather", "input": {"city": "Rome"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_a", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "call_b", "content": "21C"},
            ]},
        ])
    );

    // Streamed: thinking, text, a call in pieces, a call without arguments.
    let req = ChatRequest::new(vec![ChatMessage::user("Weather and time?")])
        .tools(vec![weather(), time])
        .tool_choice(ToolChoice::Required)
        .stream();
    let (events, done) = drain(ep.chat(req).await.expect("run")).await;
    assert_eq!(
        events[..3],
        [
            RunEvent::Reasoning("Think.".into()),
            RunEvent::Delta("Checking".into()),
            RunEvent::ToolCallStart {
                index: 0,
                id: "toolu_2".into(),
                name: "get_weather".into()
            },
        ]
    );
    let calls = calls_of(&events);
    assert_eq!(calls[0].function.arguments, r#"{"city": "Paris"}"#);
    assert_eq!(calls[1].function.name, "get_time");
    assert_eq!(done.tool_calls[0], calls[0]);
    assert_eq!(
        done.tool_calls[1],
        ToolCall::new("toolu_3", "get_time", "{}"),
        "no arguments is an empty object"
    );
    assert_eq!(
        (
            done.text.as_str(),
            done.finish_reason.as_str(),
            done.reasoning.as_deref()
        ),
        ("Checking", "tool_calls", Some("Think."))
    );
    let sent: Value = server.received_requests().await.expect("recorded")[1]
        .body_json()
        .expect("json");
    assert_eq!(sent["tool_choice"], json!({"type": "any"}));

    // A tool result must name its call.
    let mut orphan = ChatMessage::tool_result("x", "18C");
    orphan.tool_call_id = None;
    let err = ep
        .chat(ChatRequest::new(vec![ChatMessage::user("Hi"), orphan]))
        .await
        .expect_err("no call id");
    assert!(
        matches!(err, ClientError::Invalid { .. }) && err.to_string().contains("tool_call_id"),
        "{err}"
    );
}
