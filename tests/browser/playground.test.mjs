// The playground end to end in headless Chromium (Debian's `chromium`, driven by
// playwright-core): open the page, send a message, see streamed text, see the engine panel
// update, press Stop (the reply ends `cancelled` on the server), no console errors; a
// screenshot goes to tests/artifacts/playground.png.
//
// Starts its own `mtpx serve` ($MTPX_BIN, default target/release/mtpx) on a generated test
// model made larger than the default one so that a reply takes long enough to stop.
import { chromium } from "playwright-core";
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync } from "node:fs";
import { tmpdir } from "node:os";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.MTPX_BIN || path.join(root, "target/release/mtpx");
const artifacts = path.join(root, "tests/artifacts");
const fail = (msg) => { console.error("FAIL: " + msg); process.exitCode = 1; throw new Error(msg); };

const freePort = () => new Promise((resolve) => {
  const s = net.createServer().listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); });
});

async function waitHealthy(url, proc) {
  for (let i = 0; i < 600; i++) {
    if (proc.exitCode !== null) fail("mtpx serve exited with " + proc.exitCode);
    try { if ((await fetch(url + "/health")).ok) return; } catch (_) { /* not yet */ }
    await new Promise((r) => setTimeout(r, 100));
  }
  fail("mtpx serve was not healthy in 60 s");
}

const dir = mkdtempSync(path.join(tmpdir(), "mtpx-browser-"));
execFileSync(bin, ["make-test-model", "--out", dir, "--layers", "6", "--hidden", "384", "--intermediate", "1536",
  "--heads", "6", "--kv-heads", "2", "--head-dim", "64"]);
const port = await freePort();
const url = `http://127.0.0.1:${port}`;
const server = spawn(bin, ["serve", "--model", path.join(dir, "test-model.gguf"), "--port", String(port),
  "--context-window", "32768", "--kv-memory", "256MiB", "--kv-dtype", "f32",
  "--session-dir", path.join(dir, "sessions")], { stdio: "inherit" });
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run"],
});
try {
  await waitHealthy(url, server);
  const page = await browser.newPage({ viewport: { width: 1100, height: 800 }, bypassCSP: true });
  const errors = [];
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(url + "/");
  await page.waitForFunction(() => document.getElementById("transport").textContent === "WebSocket");
  await page.waitForFunction(() => document.getElementById("kv_text").textContent.startsWith("pages:"));
  // The random test model: ban its special tokens so the reply runs until stopped.
  await page.evaluate(() => {
    const base = window.settings;
    const ban = {};
    for (let i = 503; i < 512; i++) ban[i] = -100;
    window.settings = () => ({ ...base(), logit_bias: ban });
  });
  // Long enough that the reply is still running when Stop is pressed, on any machine.
  await page.fill("#max_tokens", "30000");
  await page.fill("#prompt", "Tell me a long story about pages.");
  const before = await page.textContent("#m_updated");
  await page.press("#prompt", "Enter");
  await page.waitForFunction(() => document.querySelector(".msg.assistant span")?.textContent.length > 20, null, { timeout: 30000 });
  const early = await page.textContent(".msg.assistant span");
  await page.waitForFunction((t) => document.querySelector(".msg.assistant span").textContent.length > t.length + 5, early, { timeout: 30000 });
  await page.waitForFunction((b) => document.getElementById("m_updated").textContent !== b, before, { timeout: 10000 });
  const queue = await page.textContent("#m_queue");
  if (!/^\d+ \/ \d+$/.test(queue)) fail("the running/waiting panel shows " + queue);
  if (await page.isDisabled("#stop")) fail("Stop is disabled while generating");
  // The click event itself, not a pointer click: Playwright's pointer click first waits for the
  // button to hold still for two animation frames, which a page re-rendering a fast stream on a
  // loaded 2-core machine failed to give within 30 s once (the button was enabled throughout).
  await page.locator("#stop").dispatchEvent("click");
  await page.waitForSelector(".msg.assistant .meta", { timeout: 15000 });
  const meta = await page.textContent(".msg.assistant .meta");
  if (!meta.startsWith("cancelled")) fail("the reply ended as: " + meta);
  await page.waitForFunction(() => document.getElementById("m_ttft").textContent.endsWith("ms"));
  // The server learns of the abort when the dropped stream reaches the scheduler (within a
  // step of it), not when the page shows "cancelled": poll, with a deadline.
  let stats;
  for (const deadline = Date.now() + 5000; ; await new Promise((r) => setTimeout(r, 50))) {
    stats = await (await fetch(url + "/v1/stats")).json();
    if (stats.scheduler.num_running === 0 || Date.now() > deadline) break;
  }
  if (stats.scheduler.num_running !== 0) fail("still running 5 s after stop: " + JSON.stringify(stats.scheduler));
  // A greedy reply on the random model loops, so the n-gram drafter's drafts are accepted:
  // their text is tinted and the panel shows acceptance per draft depth.
  await page.click("#reset");
  // The drafter list comes from the server: choosing n-gram lookup sends `speculative: "ngram"`.
  const drafterOptions = await page.$$eval("#drafter option", (os) => os.map((o) => o.value));
  if (!drafterOptions.includes("ngram")) fail("drafters offered: " + drafterOptions.join(", "));
  await page.selectOption("#drafter", "ngram");
  await page.fill("#temperature", "0");
  await page.fill("#max_tokens", "160");
  await page.fill("#prompt", "Say the same thing again and again.");
  await page.press("#prompt", "Enter");
  await page.waitForSelector(".msg.assistant .meta", { timeout: 60000 });
  const greedyMeta = await page.textContent(".msg.assistant .meta");
  if (!greedyMeta.startsWith("completed") && !greedyMeta.startsWith("incomplete")) fail("the greedy reply ended as: " + greedyMeta);
  const tinted = await page.locator(".msg.assistant .draft").count();
  if (tinted === 0) fail("no accepted drafts tinted in a looping greedy reply");
  const depthRows = await page.locator("#spec_depths tr").count();
  if (depthRows === 0) fail("no per-depth acceptance rows");
  const spec = await page.textContent("#m_spec");
  if (!/drafts\/round/.test(spec)) fail("the speculation panel shows " + spec);
  console.log(`playground: ${tinted} tinted drafts, ${depthRows} depths, ${spec}`);
  // Phone width stays readable: nothing wider than the viewport.
  await page.setViewportSize({ width: 380, height: 800 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  if (overflow > 1) fail("horizontal overflow at phone width: " + overflow + " px");
  await page.setViewportSize({ width: 1100, height: 800 });
  mkdirSync(artifacts, { recursive: true });
  await page.screenshot({ path: path.join(artifacts, "playground.png"), fullPage: true });
  if (errors.length) fail("console errors: " + errors.join("\n"));
  console.log("playground: ok (" + meta + ")");
} finally {
  await browser.close();
  server.kill("SIGTERM");
}
