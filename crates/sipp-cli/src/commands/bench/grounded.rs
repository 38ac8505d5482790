//! The `grounded` workload: speculative decoding on traffic that copies from
//! its input, against free text, with each speculative mode side by side.
//!
//! Four grounded tasks, each over a text given in the prompt (fixed here and
//! in the README, so figures compare across runs and servers):
//! - rename: a 40-line Python function, to be written again with one
//!   variable renamed;
//! - quote: a passage and a question, to be answered with quotes from it;
//! - summary: the same passage, to be summarized;
//! - extract: the passage's fields (names, dates, places, figures) as JSON.
//!
//! The prompts are plain completions ending where the answer starts, so any
//! OpenAI-compatible server answers them the same way. Every request
//! generates `--max-tokens` tokens (end-of-generation banned), so each mode
//! does the same work.

use std::sync::Arc;

use super::{
    report, run_clients, story_prompt, BenchArgs, BenchRequest, MakeRequest, Outcome, Target,
};
use crate::common::CliError;
use sipp::config::SpeculativeMode;

/// The function the rename task copies (40 lines).
pub const FUNCTION: &str = r#"def summarize_orders(orders, tax_rate, discounts):
    """Totals a list of orders, applying discounts and tax."""
    total = 0.0
    count = 0
    skipped = []
    by_customer = {}
    for order in orders:
        if order.get("status") == "cancelled":
            skipped.append(order["id"])
            continue
        amount = order["quantity"] * order["unit_price"]
        code = order.get("discount_code")
        if code in discounts:
            amount = amount * (1.0 - discounts[code])
        amount = round(amount * (1.0 + tax_rate), 2)
        total += amount
        count += 1
        customer = order["customer"]
        if customer not in by_customer:
            by_customer[customer] = 0.0
        by_customer[customer] += amount
    average = total / count if count else 0.0
    largest = None
    for customer, spent in by_customer.items():
        if largest is None or spent > by_customer[largest]:
            largest = customer
    report = {
        "total": round(total, 2),
        "count": count,
        "average": round(average, 2),
        "skipped": skipped,
        "largest_customer": largest,
    }
    if total > 10000:
        report["tier"] = "gold"
    elif total > 1000:
        report["tier"] = "silver"
    else:
        report["tier"] = "bronze"
    return report
"#;

/// The passage the quote, summary and extract tasks work from.
pub const PASSAGE: &str = "The Harbor Street Library opened on 14 March 1921 in the town of \
Westmere, funded by a gift of 40,000 dollars from the shipbuilder Eleanor Voss. Its first \
librarian, Thomas Aldridge, catalogued 6,200 books in the opening year and started a reading \
room for sailors who waited in port between voyages. In 1956 a fire destroyed the east wing, \
and the town rebuilt it within two years with money raised by a public subscription of 1,300 \
families. The library added a children's room in 1962, a map collection donated by the \
Westmere Maritime Society in 1978, and public computers in 1997. Today it holds about 85,000 \
books, lends 120,000 items a year, and is open every day except Monday. The current director, \
Amara Okafor, says the library's purpose has not changed since 1921: \"a warm room, a good \
book, and nobody asking you to leave.\"";

/// Renames for the rename task: (old, new).
const RENAMES: [(&str, &str); 4] = [
    ("total", "running_total"),
    ("amount", "line_amount"),
    ("by_customer", "spend_by_customer"),
    ("count", "order_count"),
];

/// Questions for the quote task.
const QUESTIONS: [&str; 4] = [
    "Who paid for the library, and how much did she give?",
    "What happened to the east wing, and how was it rebuilt?",
    "What did the library add after 1960?",
    "What does the current director say about the library's purpose?",
];

/// The prompt of grounded request `i` (the four tasks in turn).
pub fn prompt(i: usize) -> String {
    let v = i / 4;
    match i % 4 {
        0 => {
            let (old, new) = RENAMES[v % RENAMES.len()];
            format!(
                "Here is a Python function:\n\n```python\n{FUNCTION}```\n\nThe same function, \
                 unchanged except that the variable `{old}` is renamed to `{new}` everywhere:\n\n\
                 ```python\n"
            )
        }
        1 => format!(
            "Passage:\n{PASSAGE}\n\nQuestion: {}\nAnswer, quoting the passage word for word:\n\"",
            QUESTIONS[v % QUESTIONS.len()]
        ),
        2 => format!("Passage:\n{PASSAGE}\n\nA summary of the passage, in its own words:\n"),
        _ => format!(
            "Passage:\n{PASSAGE}\n\nThe passage's facts as JSON, with the fields \"name\", \
             \"town\", \"opened\", \"founder\", \"gift_dollars\", \"first_librarian\", \
             \"events\" (year and what happened) and \"director\":\n{{\n  \"name\": \""
        ),
    }
}

fn mode_of(name: &str) -> Result<Option<SpeculativeMode>, CliError> {
    match name {
        "off" => Ok(Some(SpeculativeMode::Off)),
        "ngram" => Ok(Some(SpeculativeMode::Ngram)),
        "draft" => Ok(Some(SpeculativeMode::Draft)),
        "server" => Ok(None),
        other => Err(CliError::usage(format!(
            "--speculative-modes: unknown mode {other:?} (off, ngram, draft, server)"
        ))),
    }
}

/// Grounded and free-text prompts, one stream then `-C` streams, under each
/// speculative mode (in order, then in reverse); ratios of each mode's mean
/// over the first's (`off`): one stream's median decode speed per request,
/// `-C` streams' tokens per second while all were busy.
pub fn workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let max_tokens = args.max_tokens;
    let modes: Vec<(String, Option<SpeculativeMode>)> = args
        .speculative_modes
        .iter()
        .map(|m| mode_of(m).map(|mode| (m.clone(), mode)))
        .collect::<Result<_, _>>()?;
    let make = |grounded: bool, speculative: Option<SpeculativeMode>| -> MakeRequest {
        Arc::new(move |c, r| BenchRequest {
            prompt: if grounded {
                prompt(c * 5 + r)
            } else {
                story_prompt(c, r)
            },
            max_tokens,
            cache_prompt: true,
            ignore_eos: true,
            constraint: None,
            speculative,
        })
    };
    let mut out = Outcome::default();
    // Warm-up, and every prompt's prefix computed once, so no mode pays for
    // the first prefill of a prompt another mode reuses.
    run_clients(rt, target, 1, 1, make(true, modes[0].1))?;
    // The modes in order, then in reverse (ABBA): a machine that drifts
    // during the run (as the KV cache fills, attention costs more) weighs
    // on every mode alike. Each mode's figures are the mean of its two runs.
    let mut figures: Vec<(String, [f64; 4])> =
        modes.iter().map(|(n, _)| (n.clone(), [0.0; 4])).collect();
    let order: Vec<usize> = (0..modes.len()).chain((0..modes.len()).rev()).collect();
    for (pass, &m) in order.iter().enumerate() {
        let (name, mode) = &modes[m];
        let name = &format!("{name}{}", if pass < modes.len() { "" } else { " (2)" });
        let f = &mut figures[m].1;
        for (k, grounded) in [(0, true), (2, false)] {
            let kind = if grounded { "grounded" } else { "generate" };
            // Marks where the engine's step events (`sipp::step`) of each
            // scenario start, for `scripts/step_gain.py`.
            tracing::debug!(target: "sipp::step", "scenario {kind} x1 {name}");
            let (s, w) = run_clients(rt, target, 1, args.requests, make(grounded, *mode))?;
            let single = report(&format!("{kind} x1 {name}"), 1, &s, w);
            // The texts, to compare modes' (and servers') greedy output.
            let texts: Vec<&str> = s.iter().map(|x| x.text.as_str()).collect();
            out.extra
                .insert(format!("texts {}", single.name), serde_json::json!(texts));
            // Each of the C clients sends its `-R` requests back to back
            // (client c's run through the four tasks from task c), so C
            // streams stay busy; the figure is the tokens per second while
            // all were (a request that drafts well finishes early, and with
            // one request per client the rest would run fewer streams).
            tracing::debug!(target: "sipp::step", "scenario {kind} x{} {name}", args.clients);
            let (s, w) = run_clients(
                rt,
                target,
                args.clients,
                args.requests,
                make(grounded, *mode),
            )?;
            let multi = report(
                &format!("{kind} x{} {name}", args.clients),
                args.clients,
                &s,
                w,
            );
            f[k] += single.request_decode_tokens_per_s / 2.0;
            f[k + 1] += multi.busy_tokens_per_s / 2.0;
            for r in [&single, &multi] {
                if let Some(a) = r.draft_acceptance {
                    out.extra
                        .insert(format!("acceptance {}", r.name), serde_json::json!(a));
                }
            }
            out.reports.push(single);
            out.reports.push(multi);
        }
    }
    let (base_name, base) = &figures[0];
    let labels = [
        "grounded_single",
        "grounded_concurrent",
        "generate_single",
        "generate_concurrent",
    ];
    for (name, f) in &figures[1..] {
        for (i, label) in labels.iter().enumerate() {
            out.ratio(
                &format!("{label}_{name}_over_{base_name}"),
                f[i] / base[i].max(1e-9),
            );
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_function_has_forty_lines_and_every_task_is_used() {
        assert_eq!(FUNCTION.lines().count(), 40);
        let prompts: Vec<String> = (0..8).map(prompt).collect();
        assert!(prompts[0].contains("renamed to `running_total`"));
        assert!(prompts[1].contains("quoting the passage"));
        assert!(prompts[2].contains("summary"));
        assert!(prompts[3].ends_with("\"name\": \""));
        assert!(prompts[4].contains("renamed to `line_amount`"));
        assert!(mode_of("bogus").is_err());
    }
}
