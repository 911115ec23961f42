//! The console's pages in a real browser (SPEC §16, issue 61): a headless
//! Chromium, driven through chromedriver (Debian's `chromium` and
//! `chromium-driver`; `scripts/stack.sh chromium` installs them and
//! `scripts/test.sh` names the driver in `CHROMEDRIVER_BIN`), signs in,
//! triages by class, dry-runs and runs a replay, asks for a deletion and
//! has a second admin approve it, and reads every other page. A page that
//! does not render, or renders an error, fails the test.
//!
//! Screenshots of the main pages go to `target/tmp/screenshots/`, or to
//! `CONSOLE_SCREENSHOTS` when set (docs/guide/console/ is made so).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use crate::common::*;
use crate::console::token;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(90);

/// chromedriver in a process group of its own: the browsers it starts
/// are stopped with it, whatever the test came to.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start() -> Driver {
        use std::os::unix::process::CommandExt;
        let bin = std::env::var("CHROMEDRIVER_BIN").unwrap_or_else(|_| "chromedriver".into());
        let port = free_port();
        let log = log_dir().join("chromedriver.log");
        let child = Command::new(&bin)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .arg(format!("--log-path={}", log.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {bin} ({e}): `scripts/stack.sh chromium` installs Chromium and its driver")
            });
        Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The group: chromedriver and every browser it started.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

async fn browser(driver: &Driver) -> Client {
    let profile = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chromium-profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&profile);
    let mut options = json!({
        "args": [
            "--headless=new",
            // Root (CI) has no sandbox for Chromium to drop into.
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,1000",
            format!("--user-data-dir={}", profile.display()),
        ],
    });
    if let Ok(bin) = std::env::var("CHROMIUM_BIN") {
        options["binary"] = json!(bin);
    }
    let mut caps = serde_json::Map::new();
    caps.insert("browserName".into(), json!("chrome"));
    caps.insert("goog:chromeOptions".into(), options);
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let mut last = None;
    // The driver listens a moment after it starts.
    for _ in 0..100 {
        match ClientBuilder::new(connector.clone())
            .capabilities(caps.clone())
            .connect(&driver.url)
            .await
        {
            Ok(c) => return c,
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "no browser session from {} ({}): see {}",
        driver.url,
        last.unwrap_or_default(),
        log_dir().join("chromedriver.log").display()
    );
}

fn shots_dir() -> PathBuf {
    let dir = std::env::var("CONSOLE_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("screenshots"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    std::fs::write(shots_dir().join(format!("{name}.png")), png).unwrap();
}

/// The page's text, for a failure's message.
async fn body(c: &Client) -> String {
    match c.find(Locator::Css("body")).await {
        Ok(b) => b.text().await.unwrap_or_default(),
        Err(e) => format!("(no body: {e})"),
    }
}

/// Wait for the element `css` (the page it is on has rendered).
async fn wait_for(c: &Client, css: &str) -> fantoccini::elements::Element {
    match c.wait().at_most(T).for_element(Locator::Css(css)).await {
        Ok(e) => e,
        Err(e) => panic!(
            "no {css} on {} ({e}): {}",
            c.current_url()
                .await
                .map(|u| u.to_string())
                .unwrap_or_default(),
            body(c).await
        ),
    }
}

/// Open `path` and check it rendered: its heading `h1`, and no error.
async fn visit(c: &Client, base: &str, path: &str, h1: &str) {
    c.goto(&format!("{base}{path}")).await.unwrap();
    let heading = wait_for(c, "h1").await.text().await.unwrap();
    assert!(
        heading.starts_with(h1),
        "{path}: heading {heading:?}, not {h1:?}: {}",
        body(c).await
    );
    assert!(
        c.find(Locator::Css(".error")).await.is_err(),
        "{path} shows an error: {}",
        body(c).await
    );
}

async fn sign_in(c: &Client, base: &str, token: &str, who: &str) {
    c.goto(&format!("{base}/console/login")).await.unwrap();
    wait_for(c, "#token").await.send_keys(token).await.unwrap();
    c.find(Locator::Css("#sign-in"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let shown = wait_for(c, "#who").await.text().await.unwrap();
    assert!(shown.starts_with(who), "signed in as {shown:?}, not {who}");
}

async fn sign_out(c: &Client) {
    c.find(Locator::Css("#logout"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(c, "#token").await;
}

/// Fill the reason of the first form matching `form` and send it.
async fn send_form(c: &Client, form: &str, reason: &str) {
    let f = wait_for(c, form).await;
    f.find(Locator::Css("input[name=reason]"))
        .await
        .unwrap()
        .send_keys(reason)
        .await
        .unwrap();
    f.find(Locator::Css("button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn text(c: &Client, css: &str) -> String {
    wait_for(c, css).await.text().await.unwrap()
}

/// Seed 001's playbook in a browser: an operator signs in (a bad token
/// first), triages by class, dry-runs and runs a replay of the class it
/// may (each handler called once more), reads a letter; an admin asks to
/// delete another class's letters; the admin who asked cannot approve; a
/// second admin approves, and they are gone; the log verifies, and every
/// other page renders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_take_an_operator_and_two_admins_through_the_playbook() {
    use crate::consumer::{assert_all_acked, fixture, publish, DUP};
    use uuid::Uuid;
    let stack = stack();
    let mut f = fixture(
        "c_console_browser",
        "cbrw",
        "cbrw",
        DUP,
        &["--max-deliver", "2", "--backoff", "100ms"],
    )
    .await;
    let url = db_url(&stack.admin_url, "c_console_browser");
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cbrw"));
    let rejected = Uuid::new_v4();
    let transient = [Uuid::new_v4(), Uuid::new_v4()];
    publish(
        &f.js,
        "cbrw.e",
        Some(rejected),
        "a",
        br#"{"answers": [422]}"#,
    )
    .await;
    for (i, id) in transient.iter().enumerate() {
        publish(
            &f.js,
            "cbrw.e",
            Some(*id),
            &format!("c{i}"),
            br#"{"answers": [503, 503, 200]}"#,
        )
        .await;
    }
    let operator = token(&url, "olga.oncall", "operator");
    let asker = token(&url, "pat.platform", "admin");
    let approver = token(&url, "sam.security", "admin");
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_browser",
        &[
            "--streams",
            &dlq,
            "--operator-replay-classes",
            "transient_exhausted",
            "--replay-rate",
            "50",
        ],
    );
    let base = format!("http://{addr}");
    let calls = |id: &Uuid| f.handler.calls_for(*id).len();
    eventually(T, "three letters dead", || async {
        transient.iter().all(|id| calls(id) == 2) && calls(&rejected) == 1
    })
    .await;
    assert_all_acked(&f.js, &f.stream, "cbrw").await;

    let driver = Driver::start();
    let c = browser(&driver).await;

    // Signing in: a page asks for it; a bad token is refused and said why.
    c.goto(&format!("{base}/console/")).await.unwrap();
    wait_for(&c, "#token")
        .await
        .send_keys("oxr_nonsense")
        .await
        .unwrap();
    c.find(Locator::Css("#sign-in"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let why = text(&c, "#error").await;
    assert!(why.contains("unknown token"), "{why}");
    sign_in(&c, &base, &operator, "olga.oncall").await;

    // Triage: the overview groups the letters by class.
    eventually(T, "the overview's three letters", || async {
        c.goto(&format!("{base}/console/")).await.unwrap();
        text(&c, "#dlq-total").await == "3"
    })
    .await;
    let classes = text(&c, "#classes").await;
    assert!(
        classes.contains("transient_exhausted") && classes.contains("handler_rejected"),
        "{classes}"
    );
    shot(&c, "overview").await;
    c.find(Locator::LinkText("transient_exhausted"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(text(&c, "#total").await, "2");
    shot(&c, "dead-letters").await;

    // A dry run: the plan, bound to its letters.
    send_form(
        &c,
        "form[action='/console/replay']",
        "INC-7: pricing is back",
    )
    .await;
    assert_eq!(text(&c, "#to-act").await, "2", "{}", body(&c).await);
    shot(&c, "replay-plan").await;
    assert_eq!(calls(&transient[0]), 2, "a dry run replays nothing");

    // The replay: a job whose page follows it to the end.
    c.find(Locator::Css("#run-plan"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The job's page, once the form's answer has led there.
    wait_for(&c, "#job-state").await;
    let job_url = c.current_url().await.unwrap().to_string();
    assert!(job_url.contains("/console/jobs/"), "{job_url}");
    eventually(T, "the job done", || async {
        c.goto(&job_url).await.unwrap();
        text(&c, "#job-state").await == "done"
    })
    .await;
    let progress = text(&c, "#progress").await;
    assert!(progress.contains("2 replayed"), "{progress}");
    shot(&c, "replay-job").await;
    eventually(T, "each handler called once more", || async {
        transient.iter().all(|id| calls(id) == 3)
    })
    .await;

    // One letter: its payload shown to an operator.
    c.goto(&format!(
        "{base}/console/dead-letters?class=handler_rejected"
    ))
    .await
    .unwrap();
    wait_for(&c, ".group a[href^='/console/dead-letters/']")
        .await
        .click()
        .await
        .unwrap();
    let payload = text(&c, "#payload").await;
    assert!(payload.contains("answers"), "{payload}");
    shot(&c, "dead-letter").await;
    // An operator may not plan a deletion: no such form.
    c.goto(&format!("{base}/console/dead-letters"))
        .await
        .unwrap();
    wait_for(&c, ".group").await;
    assert!(c
        .find(Locator::Css("form[action='/console/delete']"))
        .await
        .is_err());
    sign_out(&c).await;

    // A deletion: one admin asks, and cannot approve it himself.
    sign_in(&c, &base, &asker, "pat.platform").await;
    c.goto(&format!(
        "{base}/console/dead-letters?class=handler_rejected"
    ))
    .await
    .unwrap();
    send_form(
        &c,
        "form[action='/console/delete']",
        "CHG-12: poison, signed off",
    )
    .await;
    assert_eq!(text(&c, "#letters").await, "1", "{}", body(&c).await);
    c.find(Locator::Css("#run-plan"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(text(&c, ".request .state").await, "pending");
    c.find(Locator::Css(".request .approve"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let refused = text(&c, "#error").await;
    assert!(refused.contains("second admin"), "{refused}");
    sign_out(&c).await;

    // A second admin approves: the letter is gone.
    sign_in(&c, &base, &approver, "sam.security").await;
    c.goto(&format!("{base}/console/approvals")).await.unwrap();
    c.find(Locator::Css(".request .approve"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    eventually(T, "the deletion done", || async {
        c.goto(&format!("{base}/console/approvals")).await.unwrap();
        text(&c, ".request .state").await == "deleted"
    })
    .await;
    shot(&c, "approvals").await;
    let js = f.js.clone();
    eventually(T, "the rejected letter deleted", || async {
        let mut s = js.get_stream(&dlq).await.unwrap();
        s.info().await.unwrap().state.messages == 2
    })
    .await;

    // The log: every step by its token, and a chain that holds.
    visit(&c, &base, "/console/log?verify=1", "Admin log").await;
    assert!(text(&c, "#verified").await.contains("holds"));
    let log = text(&c, "#log").await;
    for step in [
        "replay.plan",
        "replay.start",
        "delete.request",
        "delete.approve",
        "token:olga.oncall",
        "token:sam.security",
    ] {
        assert!(log.contains(step), "no {step} in the log: {log}");
    }
    shot(&c, "admin-log").await;

    // Every other page renders.
    visit(&c, &base, "/console/", "Overview").await;
    visit(&c, &base, "/console/jobs", "Replay jobs").await;
    visit(&c, &base, "/console/consumers", "Consumers").await;
    assert!(text(&c, "#consumers").await.contains("cbrw"));
    shot(&c, "consumers").await;

    // A reset with a plan: from the consumers page, the plan's page, then
    // (the durable's consumer stopped) the reset itself.
    // This test's durable's form (the stack's NATS holds other tests').
    let mine = "form.reset[data-durable='cbrw']";
    let form = wait_for(&c, mine).await;
    form.find(Locator::Css("input[name=seq]"))
        .await
        .unwrap()
        .send_keys("1")
        .await
        .unwrap();
    send_form(&c, mine, "INC-31: handler fixed, run it all again").await;
    assert_eq!(text(&c, "#from-seq").await, "1", "{}", body(&c).await);
    // Three events, and the two replays of the transient class.
    assert_eq!(text(&c, "#messages").await, "5", "{}", body(&c).await);
    assert!(text(&c, "#cli").await.contains("consumer reset"));
    shot(&c, "consumer-reset-plan").await;
    f.consumer.term(std::time::Duration::from_secs(30));
    c.find(Locator::Css("#run-reset"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let done = text(&c, "#reset-result").await;
    assert!(done.contains("starts over from sequence 1"), "{done}");
    visit(&c, &base, "/console/integrity", "Integrity").await;
    visit(&c, &base, "/console/tokens", "Tokens").await;
    assert!(text(&c, "#tokens").await.contains("olga.oncall"));
    c.close().await.unwrap();
}
