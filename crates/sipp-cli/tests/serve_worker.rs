//! The routers' worker contract on the real `sipp serve` and default model:
//! /model_info, /server_info, both /get_load shapes, /tokenize in vLLM's
//! form, the render endpoints, and the fields routers add to bodies
//! (accepted; `no_stop_trim`, `skip_special_tokens`, `continue_final_message`
//! honoured).

mod common;

use common::{eventually, Server};
use reqwest::blocking::Client;
use serde_json::{json, Value};
use std::time::Duration;

fn post(c: &Client, s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = c.post(s.url(path)).json(&body).send().expect("request");
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn get(c: &Client, s: &Server, path: &str) -> (u16, Value) {
    let r = c.get(s.url(path)).send().expect("request");
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|t| t.as_i64().expect("id"))
        .collect()
}

const QUESTION: &str = "Count from 1 to 10, separated by commas.";

#[test]
fn the_worker_contract_routers_read() {
    let s = Server::start(&["--parallel", "2"]);
    let c = Client::new();

    let (st, v) = get(&c, &s, "/model_info");
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["model_path"], "default");
    assert_eq!(v["tokenizer_path"], "default");
    assert_eq!(v["is_generation"], true);
    assert_eq!(get(&c, &s, "/get_model_info").1, v);
    let (st, v) = get(&c, &s, "/server_info");
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["dp_size"].as_i64(), v["max_running_requests"].as_i64()),
        (Some(1), Some(2))
    );
    let n_ctx = v["context_length"].as_i64().expect("context");

    // Load, both shapes, idle then with a request running.
    assert_eq!(
        get(&c, &s, "/get_load").1,
        json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
    );
    assert_eq!(get(&c, &s, "/get_load?format=vllm").1, json!({"load": 0}));
    let (st, v) = get(&c, &s, "/get_load?format=other");
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("format")),
        "{v}"
    );
    let base = s.base.clone();
    let long = std::thread::spawn(move || {
        Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": true}))
            .send()
            .map(|r| r.status().as_u16())
    });
    // Queued first, then in a slot holding KV.
    assert!(eventually(Duration::from_secs(20), || {
        let v = get(&c, &s, "/get_load").1;
        v[0]["num_reqs"] == 1
            && v[0]["num_waiting_reqs"] == 0
            && v[0]["num_tokens"].as_i64().is_some_and(|n| n > 0)
    }));
    assert_eq!(get(&c, &s, "/get_load?format=vllm").1, json!({"load": 1}));
    // /slots (llama-server's): one slot busy with the request, one idle.
    let (st, slots) = get(&c, &s, "/slots");
    assert_eq!(st, 200, "{slots}");
    let slots = slots.as_array().expect("a list").clone();
    assert_eq!(slots.len(), 2, "{slots:?}");
    let busy: Vec<&Value> = slots
        .iter()
        .filter(|v| v["is_processing"] == true)
        .collect();
    assert_eq!(busy.len(), 1, "{slots:?}");
    assert!(
        busy[0]["id_task"].as_i64().is_some_and(|t| t >= 0),
        "{slots:?}"
    );
    assert!(
        busy[0]["n_prompt_tokens"].as_u64().is_some_and(|n| n > 0),
        "{slots:?}"
    );
    assert_ne!(busy[0]["phase"], "Idle", "{slots:?}");
    let idle = slots
        .iter()
        .find(|v| v["is_processing"] == false)
        .expect("an idle slot");
    assert_eq!(
        (&idle["id_task"], &idle["phase"]),
        (&json!(-1), &json!("Idle"))
    );
    assert_eq!(slots[0]["n_ctx"], n_ctx);
    let (st, v) = get(&c, &s, "/slots?model=nope");
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (404, Some("model")),
        "{v}"
    );
    assert_eq!(long.join().expect("joins").expect("sent"), 200);
    // The slot is free once the request ended (views are published per step).
    let all_idle = || {
        get(&c, &s, "/slots")
            .1
            .as_array()
            .is_some_and(|a| a.iter().all(|v| v["is_processing"] == false))
    };
    assert!(
        eventually(Duration::from_secs(10), all_idle),
        "a slot stayed busy"
    );

    // /tokenize: llama-server's content, vLLM's prompt and messages.
    let (st, by_content) = post(&c, &s, "/tokenize", json!({"content": "hello world"}));
    assert_eq!(st, 200, "{by_content}");
    let (_, by_prompt) = post(
        &c,
        &s,
        "/tokenize",
        json!({"model": "default", "prompt": "hello world"}),
    );
    assert_eq!(by_prompt["tokens"], by_content["tokens"]);
    assert_eq!(
        by_prompt["count"],
        by_content["tokens"].as_array().expect("ids").len()
    );
    assert_eq!(by_prompt["max_model_len"], n_ctx);
    let messages = json!([{"role": "user", "content": QUESTION}]);
    let (_, by_messages) = post(&c, &s, "/tokenize", json!({"messages": messages}));
    let (st, v) = post(&c, &s, "/tokenize", json!({"content": "a", "prompt": "b"}));
    assert_eq!(st, 400, "{v}");

    // The chat render is what the chat route computes: the same ids as
    // /tokenize and as many as the answer's usage counts.
    let (st, rendered) = post(
        &c,
        &s,
        "/v1/chat/completions/render",
        json!({"model": "default", "messages": messages}),
    );
    assert_eq!(st, 200, "{rendered}");
    assert_eq!(rendered["token_ids"], by_messages["tokens"]);
    let (st, answer) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 4}),
    );
    assert_eq!(st, 200, "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens"].as_u64(),
        Some(ids(&rendered["token_ids"]).len() as u64)
    );
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions/render",
        json!({"prompt": ["hello world", "hi"]}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v[0]["token_ids"], by_content["tokens"]);
    assert_eq!(v.as_array().map(Vec::len), Some(2));

    // The fields sglang-router and vllm-router add, with the values they
    // send, are accepted on both routes.
    let router_fields = json!({
        "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
        "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
        "return_hidden_states": false, "include_reasoning": true, "logprobs": false,
        "max_completion_tokens": 3
    });
    let mut chat = router_fields.clone();
    chat["messages"] = messages.clone();
    for stream in [false, true] {
        chat["stream"] = json!(stream);
        let r = c
            .post(s.url("/v1/chat/completions"))
            .json(&chat)
            .send()
            .expect("chat");
        assert_eq!(r.status(), 200, "{}", r.text().unwrap_or_default());
    }
    let mut completion = router_fields.clone();
    // Neither router adds these two to completions (logprobs is a count there).
    for f in ["continue_final_message", "logprobs"] {
        completion.as_object_mut().expect("object").remove(f);
    }
    // Completions carry `max_tokens` (the routers rename it only for chat).
    completion["max_tokens"] = json!(3);
    completion["prompt"] = json!("hello");
    completion["echo"] = json!(false);
    let (st, v) = post(&c, &s, "/v1/completions", completion);
    assert_eq!(st, 200, "{v}");
}

#[test]
fn stop_trim_special_tokens_and_continuing_the_last_message() {
    let s = Server::start(&[]);
    let c = Client::new();
    let ask = |extra: Value| {
        let mut body = json!({
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 40, "temperature": 0, "repeatable": true, "stop": [", 4", "4,"]
        });
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (st, v) = post(&c, &s, "/v1/chat/completions", body);
        assert_eq!(st, 200, "{v}");
        (content(&v), v["choices"][0]["finish_reason"].clone())
    };
    let (trimmed, why) = ask(json!({}));
    if why == "stop" {
        // The same greedy answer keeps the stop string it matched.
        for field in ["no_stop_trim", "include_stop_str_in_output"] {
            let (kept, why) = ask(json!({ field: true }));
            assert_eq!(why, "stop");
            assert!(
                [", 4", "4,"]
                    .iter()
                    .any(|stop| kept == format!("{trimmed}{stop}")),
                "{field}: {kept:?} is not {trimmed:?} plus a stop"
            );
        }
    } else {
        panic!("the model never wrote 4 while counting: {trimmed:?}");
    }

    // A special token the model writes (forced here by a bias on
    // `<|im_start|>`) renders as nothing unless `skip_special_tokens: false`.
    let (st, v) = post(
        &c,
        &s,
        "/tokenize",
        json!({"content": "<|im_start|>", "parse_special": true}),
    );
    assert_eq!(st, 200, "{v}");
    let special = v["tokens"][0].as_i64().expect("id");
    let forced = |skip: bool| {
        let (st, v) = post(
            &c,
            &s,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "logit_bias": {special.to_string(): 100}, "skip_special_tokens": skip}),
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        content(&v)
    };
    assert_eq!(forced(true), "");
    assert_eq!(forced(false), "<|im_start|>".repeat(3));

    // continue_final_message: the prompt ends with the partial answer's
    // tokens (no end of turn, no new assistant turn), and the answer goes on.
    let partial = "My favourite colour is";
    let conv = json!([
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": partial}
    ]);
    let (st, rendered) = post(
        &c,
        &s,
        "/v1/chat/completions/render",
        json!({"messages": conv, "continue_final_message": true}),
    );
    assert_eq!(st, 200, "{rendered}");
    let (_, tail) = post(&c, &s, "/tokenize", json!({"content": partial}));
    let prompt = ids(&rendered["token_ids"]);
    let tail = ids(&tail["tokens"]);
    assert!(
        prompt.ends_with(&tail),
        "{prompt:?} does not end with {tail:?}"
    );
    let (st, v) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"messages": conv, "continue_final_message": true, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(!content(&v).is_empty(), "{v}");
    // Without an assistant message to continue: a 400 naming the field.
    let (st, v) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}),
    );
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("continue_final_message")),
        "{v}"
    );

    // Anthropic's prefill: a last assistant message is continued too, so
    // the Messages API counts the same prompt as the continued chat.
    let r = c
        .post(s.url("/v1/messages/count_tokens"))
        .json(&json!({"model": "default", "messages": conv}))
        .send()
        .expect("count");
    assert_eq!(r.status(), 200);
    let counted: Value = r.json().expect("json");
    assert_eq!(
        counted["input_tokens"].as_u64(),
        Some(prompt.len() as u64),
        "{counted}"
    );
}
