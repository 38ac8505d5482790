//! `sipp chat` driven through a pseudo-terminal, as a person would use it.

use std::process::Command;

/// Drives the chat in a PTY with Python's `pty` module and prints a transcript.
const DRIVER: &str = r#"
import os, pty, sys, time, select

sipp = sys.argv[1]
pid, fd = pty.fork()
if pid == 0:
    os.execv(sipp, [sipp, "chat", "--temperature", "0", "--max-tokens", "40"])
buf = b""

def read_until(marker, timeout=120):
    global buf
    end = time.time() + timeout
    while marker not in buf:
        if time.time() > end:
            raise SystemExit("timeout waiting for %r; got %r" % (marker, buf[-400:]))
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    i = buf.index(marker) + len(marker)
    out, buf = buf[:i], buf[i:]
    return out

def send(text):
    os.write(fd, text.encode())

t = read_until(b"\n> ")
send("My name is Ana.\n")
t += read_until(b"\n> ")
send("/stats\n")
t += read_until(b"\n> ")
send("What is my name?\n")
t += read_until(b"\n> ")
send("/stats\n")
t += read_until(b"\n> ")
sys.stdout.write(t.decode("utf-8", "replace"))
sys.stdout.write("\n--- interrupt ---\n")
os.kill(pid, 9)
os.waitpid(pid, 0)

# A second session with an endless answer, interrupted by Ctrl-C.
pid, fd = pty.fork()
if pid == 0:
    os.execv(sipp, [sipp, "chat", "--temperature", "0", "--ignore-eos", "--max-tokens", "100000"])
buf = b""
t = read_until(b"\n> ")
send("Tell me a long story about dragons.\n")
read_until(b"dragons.\r\n")
# Let the answer run for a while before interrupting it.
while len(buf) < 200:
    select.select([fd], [], [], 5)
    buf += os.read(fd, 4096)
send("\x03")
t = read_until(b"[cancelled]")
t += read_until(b"\n> ")
send("/stats\n")
t += read_until(b"\n> ")
send("/exit\n")
time.sleep(0.5)
try:
    while True:
        r, _, _ = select.select([fd], [], [], 1)
        if not r:
            break
        t += os.read(fd, 4096)
except OSError:
    pass
_, status = os.waitpid(pid, 0)
sys.stdout.write(t.decode("utf-8", "replace"))
sys.stdout.write("\nexit=%d\n" % os.waitstatus_to_exitcode(status))
"#;

fn stats_line(transcript: &str, nth: usize) -> (usize, usize) {
    let line = transcript
        .lines()
        .filter(|l| l.contains("prompt tokens:"))
        .nth(nth)
        .unwrap_or_else(|| panic!("no stats line {nth} in {transcript}"));
    let nums: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    (nums[0], nums[1])
}

#[test]
fn two_turns_then_ctrl_c_returns_to_the_prompt() {
    let fetch = Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch"])
        .output()
        .expect("fetch");
    assert!(fetch.status.success());
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", DRIVER, env!("CARGO_BIN_EXE_sipp")])
        .output()
        .expect("python runs");
    let transcript = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{transcript}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (first_prompt, first_cached) = stats_line(&transcript, 0);
    let (second_prompt, second_cached) = stats_line(&transcript, 1);
    assert_eq!(first_cached, 0);
    // The second turn carries the first (question and answer) and reuses its KV:
    // all of the first prompt but perhaps its last token, the header's "\n",
    // which may merge with a leading newline of the answer when retokenized.
    assert!(second_prompt > first_prompt + 10, "{transcript}");
    assert!(
        second_cached + 1 >= first_prompt,
        "second turn reused {second_cached} of {first_prompt}: {transcript}"
    );
    let (_, after) = transcript
        .split_once("--- interrupt ---")
        .expect("second part");
    assert!(after.contains("[cancelled]"), "{after}");
    // Ctrl-C stopped the answer, not the program: /stats still answered.
    assert!(after.contains("prompt tokens:"), "{after}");
    assert!(after.trim_end().ends_with("exit=0"), "{after}");
}
