//! SippClient on a local endpoint (the default model in this process).

use serde_json::{json, Value};
use sipp::chat::ChatMessage;
use sipp::client::{
    ChatRequest, EmbedRequest, EndpointDescriptor, QueryRequest, RunEvent, SippClient,
};
use sipp::tools::{Tool, ToolCall, ToolChoice};
use sipp::NativeRuntimeConfig;

async fn client() -> SippClient {
    let c = SippClient::new();
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 2048;
    cfg.context.n_parallel = 2;
    c.add(
        "local",
        EndpointDescriptor::Local {
            model: "default".into(),
            config: Box::new(cfg),
        },
    )
    .await
    .expect("local model loads");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_chat_stream_and_cancel() {
    let c = client().await;
    let mut q = QueryRequest::new("The capital of France is")
        .max_tokens(8)
        .temperature(0.0);
    q.options.local.logprobs = Some(2);
    // Counts below hold only if nothing can end the run early.
    q.options.local.ignore_eos = true;
    let r = c
        .query("local", q)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert!(r.text.contains("Paris"), "{}", r.text);
    assert_eq!(r.usage.completion_tokens, 8);
    assert!(r.stats.expect("local stats").ttft_ms > 0.0);
    assert_eq!(r.logprobs.len(), 8);

    let mut run = c
        .chat(
            "local",
            ChatRequest::new(vec![ChatMessage::user("Tell me about cats.")])
                .max_tokens(24)
                .temperature(0.0)
                .stream(),
        )
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
    assert_eq!(text, done.text);

    let mut q = QueryRequest::new("Write a long story.")
        .max_tokens(5000)
        .stream();
    q.options.local.ignore_eos = true;
    let mut run = c.query("local", q).await.expect("run");
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
            RunEvent::Error(e) => panic!("{e}"),
            other => panic!("no tools, no reasoning: {other:?}"),
        }
    };
    assert_eq!(done.finish_reason, "cancelled");
    assert!(done.usage.completion_tokens < 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_only_options_work_and_embedding_is_refused_on_a_generation_model() {
    let c = client().await;
    let mut q = QueryRequest::new("Is the sky blue? Answer:").max_tokens(4);
    q.options.local.grammar = Some("root ::= \" yes\" | \" no\"".into());
    let r = c
        .query("local", q)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert!(r.text == " yes" || r.text == " no", "{:?}", r.text);
    let err = c
        .embed("local", EmbedRequest::new(["x"]))
        .await
        .expect_err("generation model");
    assert!(err.to_string().contains("embeddings"), "{err}");
    let err = c
        .query("local", QueryRequest::new(""))
        .await
        .expect_err("empty");
    assert!(err.to_string().contains("empty"), "{err}");
    // `lora` reaches the engine: this model has no adapters to choose.
    let mut q = QueryRequest::new("x").max_tokens(1);
    q.options.local.lora = Some(vec![sipp::engine::LoraScale { id: 0, scale: 1.0 }]);
    let err = c.query("local", q).await.expect_err("no adapters");
    assert!(err.to_string().contains("no LoRA adapters"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_embeddings_with_minilm() {
    let c = SippClient::new();
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.embeddings = true;
    cfg.cache.idle_sequences = 0;
    c.add(
        "emb",
        EndpointDescriptor::Local {
            model: "minilm".into(),
            config: Box::new(cfg),
        },
    )
    .await
    .expect("loads");
    let mut req = EmbedRequest::new([
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "A man is riding a horse.",
    ]);
    req.normalize = Some(true);
    let e = c.embed("emb", req).await.expect("embed");
    assert_eq!(e.data.len(), 3);
    assert_eq!(e.data[0].values.len(), 384);
    assert_eq!(e.data[0].normalized, Some(true));
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!(dot(&e.data[0].values, &e.data[1].values) > dot(&e.data[0].values, &e.data[2].values));
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

/// The call is to `get_weather` and its arguments satisfy the tool's schema.
fn assert_valid_call(c: &ToolCall) {
    assert_eq!(c.function.name, "get_weather", "{c:?}");
    assert!(!c.id.is_empty(), "{c:?}");
    let args: Value = serde_json::from_str(&c.function.arguments)
        .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {c:?}"));
    let schema = weather().parameters();
    let v = jsonschema::validator_for(&schema).expect("schema");
    assert!(v.is_valid(&args), "{args} does not satisfy {schema}");
}

fn ask() -> ChatRequest {
    ChatRequest::new(vec![ChatMessage::user("What is the weather in Paris?")])
        .tools(vec![weather()])
        .tool_choice(ToolChoice::Function("get_weather".into()))
        .parallel_tool_calls(false)
        .max_tokens(96)
        .temperature(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_call_is_schema_valid_streamed_or_not_and_its_result_is_answered() {
    let c = client().await;
    // Not streamed.
    let r = c
        .chat("local", ask())
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert_eq!(r.tool_calls.len(), 1, "{r:?}");
    assert_valid_call(&r.tool_calls[0]);
    assert_eq!(r.finish_reason, "tool_calls", "{r:?}");

    // Streamed: the call's start and argument pieces add up to the answer's call.
    let mut run = c.chat("local", ask().stream()).await.expect("run");
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
            RunEvent::Error(e) => panic!("{e}"),
            RunEvent::Delta(_) | RunEvent::Reasoning(_) => {}
        }
    };
    assert_eq!(calls, done.tool_calls);
    assert_eq!(done.tool_calls.len(), 1, "{done:?}");
    assert_valid_call(&done.tool_calls[0]);
    assert_eq!(done.finish_reason, "tool_calls");

    // The call and its result in the history: the next turn answers in text.
    let call = r.tool_calls[0].clone();
    let turn = ChatRequest::new(vec![
        ChatMessage::user("What is the weather in Paris?"),
        ChatMessage::tool_calls(None, vec![call.clone()]),
        ChatMessage::tool_result(call.id, r#"{"temperature": 18, "sky": "clear"}"#),
    ])
    .tools(vec![weather()])
    .tool_choice(ToolChoice::None)
    .max_tokens(32)
    .temperature(0.0);
    let answer = c
        .chat("local", turn)
        .await
        .expect("run")
        .response()
        .await
        .expect("ok");
    assert!(answer.tool_calls.is_empty(), "{answer:?}");
    assert!(!answer.text.trim().is_empty(), "{answer:?}");
    assert_ne!(answer.finish_reason, "tool_calls");

    // Calls are constrained by their own grammar: no other constraint.
    let mut both = ask();
    both.options.local.json_mode = true;
    let err = c.chat("local", both).await.expect_err("two constraints");
    assert!(err.to_string().contains("tools"), "{err}");
    // Bad tools are refused with the field named.
    let err = c
        .chat(
            "local",
            ask().tool_choice(ToolChoice::Function("nope".into())),
        )
        .await
        .expect_err("unknown function");
    assert!(err.to_string().contains("tool_choice"), "{err}");
}
