// The console in a real browser, as an operator uses it: log in with a token, find the poison
// group among the dead letters, read one letter, replay the group once the application is
// fixed, and check that the application then accepted each message exactly once and that the
// pages say so. A conflict's group must offer no plain replay. Screenshots of the main pages go
// to $SHOTS.
//
// Chromium is Debian's, started here with exactly the flags that work on these machines (and a
// fresh profile); playwright-core drives it over the DevTools protocol.
"use strict";
const { spawn } = require("child_process");
const fs = require("fs");
const os = require("os");
const path = require("path");

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const { chromium } = require(env("PLAYWRIGHT_CORE"));
const IDEM = env("IDEM_URL");
const APP = env("APP_URL");
const SCOPE = env("SCOPE");
const SHOTS = env("SHOTS");
const POISON = env("POISON_IDS").split(",");
const OK = env("OK_IDS").split(",");
const CONFLICT = env("CONFLICT_ID");

const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

const started = Date.now();
const log = (msg) => console.log(`[console-e2e] ${((Date.now() - started) / 1000).toFixed(1)}s ${msg}`);

function check(cond, msg) {
  if (!cond) throw new Error(`check failed: ${msg}`);
}

async function until(what, fn, timeoutMs = 20000) {
  const end = Date.now() + timeoutMs;
  let last;
  while (Date.now() < end) {
    last = await fn();
    if (last) return last;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
}

/** Starts Chromium with FLAGS, a fresh profile and a DevTools port; connects playwright. */
async function launch() {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "idem-console-chromium-"));
  const args = [...FLAGS, `--user-data-dir=${profile}`, "--remote-debugging-port=0", "about:blank"];
  const proc = spawn(env("CHROMIUM"), args, { stdio: ["ignore", "ignore", "pipe"] });
  const ws = await new Promise((resolve, reject) => {
    let err = "";
    const t = setTimeout(() => reject(new Error(`chromium did not start within 20 s:\n${err}`)), 20000);
    proc.stderr.on("data", (d) => {
      err += d;
      const m = err.match(/DevTools listening on (ws:\/\/\S+)/);
      if (m) {
        clearTimeout(t);
        resolve(m[1]);
      }
    });
    proc.on("exit", (code) => reject(new Error(`chromium exited with ${code}:\n${err}`)));
  });
  const browser = await chromium.connectOverCDP(ws);
  const close = async () => {
    await browser.close().catch(() => {});
    if (proc.exitCode === null) {
      const exited = new Promise((r) => proc.once("exit", r));
      proc.kill("SIGKILL");
      await exited;
    }
    try {
      fs.rmSync(profile, { recursive: true, force: true, maxRetries: 5 });
    } catch (e) {
      console.error(`[console-e2e] could not remove ${profile}: ${e.message}`);
    }
  };
  return { browser, close };
}

async function appStats() {
  const r = await fetch(`${APP}/stats`);
  return r.json();
}

async function shot(page, name) {
  const file = path.join(SHOTS, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  log(`screenshot ${file}`);
}

async function main() {
  fs.mkdirSync(SHOTS, { recursive: true });
  const { browser, close } = await launch();
  log("chromium up");
  let page;
  try {
    const ctx = browser.contexts()[0];
    page = await ctx.newPage();
    await page.setViewportSize({ width: 1280, height: 860 });

    // Log in: a wrong token is refused, the right one opens the store page.
    await page.goto(`${IDEM}/console`);
    check(page.url().endsWith("/console/login"), `the console asks to log in (at ${page.url()})`);
    await page.fill("#token", "not-a-token-0123456789");
    await Promise.all([page.waitForLoadState(), page.click("button[type=submit]")]);
    check((await page.textContent(".error")).includes("unknown token"), "a wrong token is refused");
    await page.fill("#token", env("IDEM_TOKEN"));
    await Promise.all([page.waitForURL(`${IDEM}/console`), page.click("button[type=submit]")]);
    check((await page.textContent("h1")) === "Store", "logged in, on the store page");
    log("logged in");

    // The charts, in a second tab of the same session, sampling while the replay happens.
    const charts = await ctx.newPage();
    await charts.setViewportSize({ width: 1280, height: 860 });
    await charts.goto(`${IDEM}/console/charts`);

    // The dead letters: the poison group (3) and the conflict (1).
    await page.click("nav >> text=Dead letters");
    await page.waitForURL(`${IDEM}/console/dead-letters`);
    const poisonRow = page.locator('tr[data-outcome="failed_permanent"]');
    const conflictRow = page.locator('tr[data-outcome="conflict"]');
    check((await poisonRow.count()) === 1, "one poison group");
    check((await poisonRow.locator("td.n").textContent()) === String(POISON.length), "the poison group holds every poison message");
    check((await conflictRow.locator("td.n").textContent()) === "1", "the conflict's group holds it");
    const conflictButtons = await conflictRow.locator("button").allTextContents();
    check(
      conflictButtons.includes("Discard all") && conflictButtons.includes("Accept all as new"),
      `a conflict offers discard and accept as new (${conflictButtons})`,
    );
    check(!conflictButtons.some((b) => /replay/i.test(b)), `a conflict offers no plain replay (${conflictButtons})`);
    await shot(page, "dead-letters");

    // One letter: its headers, payload and the store's record for its key.
    await Promise.all([page.waitForURL(/\/letter\?id=/), poisonRow.locator("td a.mono").first().click()]);
    const letter = await page.textContent("main");
    check(letter.includes("idem-reason") && letter.includes("422"), "the letter shows why it was dead-lettered");
    check(letter.includes("poison"), "the letter shows its payload");
    check((await page.textContent("#record")).includes("failed"), "the store's record for its key is failed");
    await shot(page, "letter");

    // The application is fixed; the operator replays the group.
    await fetch(`${APP}/fix`, { method: "POST" });
    await page.goto(`${IDEM}/console/dead-letters`);
    await Promise.all([
      page.waitForURL(/\/console\/dead-letters\//),
      page.locator('tr[data-outcome="failed_permanent"] >> button:has-text("Replay all")').click(),
    ]);
    const flash = await page.textContent("#flash");
    check(flash.includes(`Replayed under their key (${POISON.length})`), `the page reports the replay: ${flash}`);
    check(flash.includes(`${POISON.length} removed`), `the page reports the removal: ${flash}`);
    await shot(page, "replayed");
    log("replayed");

    // The application accepts each replayed message once, and nothing twice.
    await until("the replayed messages to reach the application", async () => {
      const s = await appStats();
      return POISON.every((id) => s.accepted[id] === 1);
    });
    await new Promise((r) => setTimeout(r, 1500)); // room for a duplicate delivery to show up
    const stats = await appStats();
    for (const id of [...POISON, ...OK]) check(stats.accepted[id] === 1, `${id} accepted exactly once (${JSON.stringify(stats.accepted)})`);
    for (const id of POISON) check(stats.refused[id] >= 1, `${id} was refused before the fix`);
    for (const [key, n] of Object.entries(stats.keys)) check(n === 1, `Idempotency-Key ${key} delivered ${n} times`);
    check(Object.keys(stats.keys).length === POISON.length + OK.length, "one Idempotency-Key per message");
    log(`application: ${JSON.stringify(stats.accepted)}`);

    // The page: the poison group is gone, the conflict stays.
    await page.goto(`${IDEM}/console/dead-letters`);
    check((await page.locator('tr[data-outcome="failed_permanent"]').count()) === 0, "the poison group is gone");
    check((await page.locator('tr[data-outcome="conflict"] td.n').textContent()) === "1", "the conflict is still there");

    // The store: every message completed once.
    const processed = POISON.length + OK.length;
    await page.goto(`${IDEM}/console?scope=${encodeURIComponent(SCOPE)}`);
    const row = page.locator("table.counts tbody tr", { hasText: SCOPE }).last();
    const completed = await row.locator("td").nth(1).textContent();
    check(completed === String(processed), `the store page counts ${processed} completed (shows ${completed})`);
    await shot(page, "store");

    // The charts: processed, duplicates, conflicts and dead letters of the scope.
    const cell = (series) => charts.locator(`#totals tr[data-scope="${SCOPE}"] td[data-series="${series}"]`);
    await until("the charts to count every processed message", async () => (await cell("processed").textContent()) === String(processed));
    check((await cell("duplicate").textContent()) === "1", "the charts count the duplicate");
    check((await cell("conflict").textContent()) === "1", "the charts count the conflict");
    check((await cell("dead_lettered").textContent()) === String(POISON.length + 1), "the charts count the dead letters");
    // A few samples, so the picture shows lines rather than a point.
    await until("five chart samples", async () => Number(await charts.getAttribute("#charts", "data-samples")) >= 5);
    check((await charts.locator(`#charts .chart[data-scope="${SCOPE}"] polyline[points*=" "]`).count()) === 4, "four series drawn");
    await shot(charts, "charts");
    log(`ok: ${POISON.length} dead letters replayed and each processed once; conflict offered no replay`);
  } catch (e) {
    if (page) {
      const file = path.join(os.tmpdir(), "idem-console-failure.png");
      await page.screenshot({ path: file, fullPage: true }).catch(() => {});
      console.error(`[console-e2e] failed on ${page.url()} (screenshot ${file})`);
    }
    throw e;
  } finally {
    await close();
  }
}

main().catch((e) => {
  console.error(`[console-e2e] ${e.stack || e}`);
  process.exit(1);
});
